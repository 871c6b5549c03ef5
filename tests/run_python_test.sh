#!/bin/sh
# Runs a Python test with Debian's Python 3 (numpy, grpcio, torch come from
# python3-numpy, python3-grpcio, python3-torch). A test that has the flce
# wheel (//client/python:wheel) among its data uses flce the way a user
# does: the wheel pip-installed, with no index, into a fresh virtual
# environment that sees the system's packages, and the test run from
# outside the source tree, with only the test helpers and the examples
# importable besides.
# Usage (from a Bazel sh_test): run_python_test.sh tests/SCRIPT.py [ARGS...]
set -e
root="${TEST_SRCDIR}/flce"
script="$1"
shift
python=/usr/bin/python3
for wheel in "$root"/client/python/flce-*-py3-none-any.whl; do
  [ -f "$wheel" ] || continue
  python="${TEST_TMPDIR}/venv/bin/python"
  /usr/bin/python3 -m venv --system-site-packages "${TEST_TMPDIR}/venv"
  "$python" -m pip install --quiet --no-index --no-cache-dir "$wheel"
  export FLCE_FROM_WHEEL="$wheel"
done
export PYTHONPATH="${root}/tests:${root}/client/python/examples"
# Paths among the arguments (the binaries under test) made absolute first.
n=$#
while [ "$n" -gt 0 ]; do
  arg="$1"
  shift
  case "$arg" in
    /*) ;;
    *) if [ -e "$arg" ]; then arg="$PWD/$arg"; fi ;;
  esac
  set -- "$@" "$arg"
  n=$((n - 1))
done
cd "${TEST_TMPDIR}"
exec "$python" "${root}/${script}" "$@"
