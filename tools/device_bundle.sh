#!/usr/bin/env bash
# Builds flce's binaries for a GPU machine and packs them, with the shared
# libraries they need that are neither glibc/libstdc++ nor CUDA's (gRPC,
# protobuf, Abseil, spdlog, fmt, re2, c-ares, OpenSSL, zlib, OpenBLAS, ...),
# into .devbin/bundle.tar.xz (git-ignored). tools/device_run.sh unpacks and
# runs them there. Usage: tools/device_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(
  //client/python:flce_pb
  //server:flce_server
  //client:flce
  //bench:flce_bench
  //bench:rpc_bench
  //kernels/cuda:cuda_engine_test
  //tests:server_integration_gpu_test
)
bazel build -c opt "${TARGETS[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for target in "${TARGETS[@]:1}"; do
  path="bazel-bin/$(echo "${target#//}" | tr ':' '/')"
  install -m 755 "$path" "$stage/bin/"
  strip --strip-debug "$stage/bin/$(basename "$path")"
done
# The Python client (sources, generated stubs, example) and its tests.
mkdir -p "$stage/python"
cp -r client/python/flce client/python/examples/train_tiny_lm.py "$stage/python/"
cp -r bazel-bin/client/python/flce_pb "$stage/python/"
cp tests/python_client_test.py tests/server_process.py bench/ipc_bench.py "$stage/python/"
# Libraries the GPU machine's own system provides (or must provide: the
# driver and cuBLAS) stay behind.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl|librt|libgcc_s|libstdc\+\+|libcublas|libcublasLt|libcuda)'
for bin in "$stage"/bin/*; do
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name lib; do
    if ! echo "$name" | grep -Eq "$skip" && [ -f "$lib" ]; then
      cp -L "$lib" "$stage/lib/$name"
    fi
  done
done
mkdir -p .devbin
tar -C "$stage" -cJf .devbin/bundle.tar.xz bin lib python
ls -la .devbin/bundle.tar.xz
