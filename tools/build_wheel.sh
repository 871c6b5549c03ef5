#!/usr/bin/env bash
# Builds the flce Python client's wheel offline, without Bazel: stages
# client/python (pyproject.toml, README.md, the flce sources), generates the
# message and service modules (flce_pb) from proto/flce/v1/loss_service.proto
# with Debian's protoc and grpc_python_plugin, and builds a pure-Python wheel
# with Debian's pip and setuptools (no index, no build isolation).
#   tools/build_wheel.sh [--native LIB] [OUT_DIR]   (default dist/); prints the wheel's path
# --native: the bulk port's transfers in native code, libflce_bulk.so (Bazel's
# //client/python:flce/libflce_bulk.so, which the Bazel target :wheel passes),
# go into the package; the wheel is then tagged for this machine's platform
# (py3-none-linux_x86_64: the library has no Python ABI, one wheel serves
# every interpreter). Without it the wheel is pure (py3-none-any) and the
# client moves the bulk port's bytes in Python (slower when transfers overlap).
# Refuses to build when the package's version (flce.__version__) is not the
# server's (common/version.h).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
native=""
if [ "${1:-}" = "--native" ]; then
  native="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
  shift 2
fi
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
python="${PYTHON:-/usr/bin/python3}"

server_version="$(sed -n 's/.*kVersion\[\] = "\(.*\)";/\1/p' "$root/common/version.h")"
client_version="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$root/client/python/flce/__init__.py")"
if [ -z "$server_version" ] || [ "$server_version" != "$client_version" ]; then
  echo "build_wheel: flce.__version__ ($client_version) is not the server's," \
    "common/version.h ($server_version)" >&2
  exit 1
fi

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp "$root/client/python/pyproject.toml" "$root/client/python/README.md" "$stage/"
mkdir -p "$stage/flce/integrations"
cp "$root"/client/python/flce/*.py "$stage/flce/"
cp "$root"/client/python/flce/integrations/*.py "$stage/flce/integrations/"
mkdir -p "$stage/flce_pb/v1"
/usr/bin/protoc --proto_path=flce_pb/v1="$root/proto/flce/v1" \
  --python_out="$stage" --grpc_python_out="$stage" \
  --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin \
  flce_pb/v1/loss_service.proto
echo "# Generated stubs of flce.v1 (tools/build_wheel.sh)." > "$stage/flce_pb/__init__.py"
cp "$stage/flce_pb/__init__.py" "$stage/flce_pb/v1/__init__.py"

platform=any
if [ -n "$native" ]; then
  cp "$native" "$stage/flce/libflce_bulk.so"
  platform="linux_$(uname -m)"
  printf '[bdist_wheel]\nplat_name = %s\n' "$platform" > "$stage/setup.cfg"
fi

# (Built in the stage, so nothing is written beside the sources.)
(cd "$stage" && HOME="$stage" "$python" -m pip wheel --quiet --no-deps --no-build-isolation \
  --no-index --no-cache-dir --wheel-dir "$out" "$stage" >&2)
wheel="$out/flce-$server_version-py3-none-$platform.whl"
[ -f "$wheel" ] || { echo "build_wheel: no $wheel" >&2; exit 1; }
echo "$wheel"
