#!/usr/bin/env bash
# Builds the flce Python client's wheel offline, without Bazel: stages
# client/python (pyproject.toml, README.md, the flce sources), generates the
# message and service modules (flce_pb) from proto/flce/v1/loss_service.proto
# with Debian's protoc and grpc_python_plugin, and builds a pure-Python wheel
# with Debian's pip and setuptools (no index, no build isolation).
#   tools/build_wheel.sh [OUT_DIR]     (default dist/); prints the wheel's path
# Refuses to build when the package's version (flce.__version__) is not the
# server's (common/version.h).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
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

# (Built in the stage, so nothing is written beside the sources.)
(cd "$stage" && HOME="$stage" "$python" -m pip wheel --quiet --no-deps --no-build-isolation \
  --no-index --no-cache-dir --wheel-dir "$out" "$stage" >&2)
wheel="$out/flce-$server_version-py3-none-any.whl"
[ -f "$wheel" ] || { echo "build_wheel: no $wheel" >&2; exit 1; }
echo "$wheel"
