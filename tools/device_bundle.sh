#!/usr/bin/env bash
# Builds flce's binaries for a GPU machine and packs them, with the shared
# libraries they need that are neither glibc/libstdc++ nor CUDA's (gRPC,
# protobuf, Abseil, spdlog, fmt, re2, c-ares, OpenSSL, zlib, OpenBLAS, ...),
# into .devbin/bundle.tar.xz (git-ignored). tools/device_run.sh unpacks and
# runs them there. Usage: tools/device_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(
  //client/python:wheel
  //server:flce_server
  //client:flce
  //bench:flce_bench
  //bench:rpc_bench
  //bench:gemm_algos
  //bench:hopper_gemm_bench
  //kernels/cuda:cuda_engine_test
  //kernels/cuda:cuda_shards_test
  //kernels/cuda:device_destinations_test
  //kernels/cuda:gemm_test
  //kernels/cuda:hopper_gemm_test
  //tests:server_integration_gpu_test
  //tests:sticky_error_gpu_test
)
bazel build -c opt "${TARGETS[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
binaries=()
for target in "${TARGETS[@]:1}"; do
  binaries+=("bazel-bin/$(echo "${target#//}" | tr ':' '/')")
done
tools/package.sh "$stage" "${binaries[@]}"
# The Python client as its wheel (device_run.sh installs it), the example,
# and the tests.
mkdir -p "$stage/python"
cp bazel-bin/client/python/flce-*-py3-none-any.whl client/python/examples/*.py "$stage/python/"
cp tests/python_client_test.py tests/call_channel_test.py tests/row_pipeline_test.py \
  tests/integrations_test.py tests/vocab_parallel_test.py tests/server_process.py \
  bench/worker_bench.py bench/bulk_bench.py \
  bench/same_host_latency.py "$stage/python/"
mkdir -p .devbin
tar -C "$stage" -cJf .devbin/bundle.tar.xz bin lib python
ls -la .devbin/bundle.tar.xz
