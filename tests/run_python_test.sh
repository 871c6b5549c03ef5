#!/bin/sh
# Runs a Python test with Debian's Python 3 (numpy, grpcio, torch come from
# python3-numpy, python3-grpcio, python3-torch), with the test helpers, the
# flce package and its generated stubs importable.
# Usage (from a Bazel sh_test): run_python_test.sh tests/SCRIPT.py [ARGS...]
root="${TEST_SRCDIR}/flce"
script="$1"
shift
export PYTHONPATH="${root}/tests:${root}/client/python:${root}/client/python/examples"
exec /usr/bin/python3 "${root}/${script}" "$@"
