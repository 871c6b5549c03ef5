#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after
# tools/device_bundle.sh packed .devbin/bundle.tar.xz here: the GPU test
# suite (REQUIRE_GPU=1, no skips allowed), `flce smoke` against a CUDA
# server, and flce_bench. Logs and gtest XML go to $OUT.
# Usage: tools/device_run.sh [tests] [smoke] [python] [examples] [bench] [rpc] [worker] [gemms]
#   [latency] [bulk] [hopper]
# bench reads BENCH_SHAPES, BENCH_DTYPES, BENCH_MODES, BENCH_WARMUP,
# BENCH_CHUNK_BYTES, BENCH_FLAGS (more flce_bench flags), BENCH_VARIANTS and
# BENCH_ROUNDS (below); gemms reads
# BENCH_SHAPES, GEMM_CHUNK_ROWS, GEMM_ALGOS and GEMM_FLAGS (more gemm_algos
# flags, e.g. --full=false); rpc reads RPC_SHAPE and RPC_FLAGS (e.g.
# "--transfer_mib=64,1024 --connections=0,1,2,4,8"); worker
# (bench/worker_bench.py) reads WORKER_TRANSPORTS, WORKER_FLAGS and WORKER_MPS; bulk
# (bench/bulk_bench.py) reads BULK_FLAGS; hopper (bench/hopper_gemm_bench)
# reads HOPPER_FLAGS and HOPPER_TIMEOUT (s, default 480).
set -uo pipefail
OUT="${OUT:-/tmp/flce-out}"
mkdir -p "$OUT" /tmp/flce
tar -C /tmp/flce -xJf .devbin/bundle.tar.xz
cublas="$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)"
cublas_dir="$(dirname "${cublas:-/usr/local/cuda/lib64/x}")"
# NCCL (loaded by a server with several devices) from wherever the machine has it.
nccl="$(find / -name 'libnccl.so.2' -not -path '*/proc/*' 2>/dev/null | head -1)"
nccl_dir="$(dirname "${nccl:-/usr/local/cuda/lib64/x}")"
export LD_LIBRARY_PATH="/tmp/flce/lib:${cublas_dir}:${nccl_dir}:/usr/local/cuda/lib64"
export NCCL_NVLS_ENABLE=0
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1
bin=/tmp/flce/bin
# The Python client installed from its wheel, as a user would (no index;
# torch, grpcio, protobuf and numpy are the machine's).
python3 -m pip install --quiet --no-index --no-deps --no-cache-dir --target /tmp/flce/site \
  /tmp/flce/python/flce-*-py3-none-any.whl
# CUDA_DEVICES: the devices of the several-engine servers the tests and the
# smoke run (default 0,0: two engines sharing one GPU; 0,1 on a machine of
# two GPUs, with NCCL between them).
CUDA_DEVICES="${CUDA_DEVICES:-0,0}"
# FLCE_PYTHON_FIRST: a folder searched before the installed client (an A/B
# against another version of the flce package, e.g. worker_bench's).
export PYTHONPATH=${FLCE_PYTHON_FIRST:+$FLCE_PYTHON_FIRST:}/tmp/flce/site:/tmp/flce/python
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
status=0
want() { [ "$#" -eq 0 ] || [[ " ${ARGS} " == *" $1 "* ]]; }
ARGS="$*"

if [ -z "$ARGS" ] || want tests; then
  echo "== GPU tests"
  # The binaries that run flce's own GEMM kernels are killed after 240 s: a
  # kernel that never finishes (a barrier waited on forever) fails its test
  # binary (status 137 in the log) instead of the whole call.
  REQUIRE_GPU=1 timeout --signal=KILL 240 "$bin/gemm_test" --gtest_output="xml:$OUT/gemm_test.xml" \
    > "$OUT/gemm_test.log" 2>&1 || { echo "gemm_test: status $?" >> "$OUT/gemm_test.log"; status=1; }
  grep -E '^tuned' "$OUT/gemm_test.log"
  tail -3 "$OUT/gemm_test.log"
  REQUIRE_GPU=1 timeout --signal=KILL 240 "$bin/hopper_gemm_test" \
    --gtest_output="xml:$OUT/hopper_gemm_test.xml" > "$OUT/hopper_gemm_test.log" 2>&1 \
    || { echo "hopper_gemm_test: status $?" >> "$OUT/hopper_gemm_test.log"; status=1; }
  tail -3 "$OUT/hopper_gemm_test.log"
  REQUIRE_GPU=1 timeout --signal=KILL 240 "$bin/cuda_engine_test" \
    --gtest_output="xml:$OUT/cuda_engine_test.xml" > "$OUT/cuda_engine_test.log" 2>&1 \
    || { echo "cuda_engine_test: status $?" >> "$OUT/cuda_engine_test.log"; status=1; }
  tail -5 "$OUT/cuda_engine_test.log"
  grep -E "GEMM shapes on flce's Hopper GEMM" "$OUT/cuda_engine_test.log"
  REQUIRE_GPU=1 "$bin/cuda_shards_test" --gtest_output="xml:$OUT/cuda_shards_test.xml" \
    > "$OUT/cuda_shards_test.log" 2>&1 || status=1
  tail -3 "$OUT/cuda_shards_test.log"
  REQUIRE_GPU=1 "$bin/device_destinations_test" \
    --gtest_output="xml:$OUT/device_destinations_test.xml" \
    > "$OUT/device_destinations_test.log" 2>&1 || status=1
  tail -3 "$OUT/device_destinations_test.log"
  REQUIRE_GPU=1 FLCE_TEST_BACKEND=cuda "$bin/server_integration_gpu_test" \
    --gtest_filter='-ServerTimingTest.*' --gtest_output="xml:$OUT/server_integration_gpu_test.xml" \
    > "$OUT/server_integration_gpu_test.log" 2>&1 || status=1
  tail -5 "$OUT/server_integration_gpu_test.log"
  # The same suite on a server computing every problem in 3 vocabulary
  # shards of its one GPU (--vocab_shards=3).
  REQUIRE_GPU=1 FLCE_TEST_BACKEND=cuda FLCE_TEST_VOCAB_SHARDS=3 "$bin/server_integration_gpu_test" \
    --gtest_filter='-ServerTimingTest.*' \
    --gtest_output="xml:$OUT/server_integration_sharded_gpu_test.xml" \
    > "$OUT/server_integration_sharded_gpu_test.log" 2>&1 || status=1
  tail -3 "$OUT/server_integration_sharded_gpu_test.log"
  # And on servers over several engines (--cuda_devices=$CUDA_DEVICES; by
  # default two sharing the GPU):
  # every problem sharded over them, then requests spread over them.
  for mode in shard spread; do
    REQUIRE_GPU=1 FLCE_TEST_BACKEND=cuda FLCE_TEST_CUDA_DEVICES=$CUDA_DEVICES FLCE_TEST_CUDA_DEVICES_MODE=$mode \
      "$bin/server_integration_gpu_test" --gtest_filter='-ServerTimingTest.*' \
      --gtest_output="xml:$OUT/server_integration_two_engines_${mode}_gpu_test.xml" \
      > "$OUT/server_integration_two_engines_${mode}_gpu_test.log" 2>&1 || status=1
    tail -3 "$OUT/server_integration_two_engines_${mode}_gpu_test.log"
  done
  REQUIRE_GPU=1 "$bin/sticky_error_gpu_test" --gtest_output="xml:$OUT/sticky_error_gpu_test.xml" \
    > "$OUT/sticky_error_gpu_test.log" 2>&1 || status=1
  tail -3 "$OUT/sticky_error_gpu_test.log"
  grep -E 'read in place' "$OUT/device_destinations_test.log"
fi

if [ -z "$ARGS" ] || want python; then
  echo "== Python client and PyTorch training loop against --backend=auto (CUDA here)"
  python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__)'
  python3 /tmp/flce/python/python_client_test.py "$bin/flce_server" \
    > "$OUT/python_client_test.log" 2>&1 || status=1
  grep -E '(ok|FAIL|ERROR)$|^Ran|^OK|^FAILED' "$OUT/python_client_test.log"
  python3 /tmp/flce/python/call_channel_test.py "$bin/flce_server" \
    > "$OUT/call_channel_test.log" 2>&1 || status=1
  grep -E '(FAIL|ERROR)$|^Ran|^OK|^FAILED' "$OUT/call_channel_test.log"
  FLCE_TEST_BACKEND=cuda python3 /tmp/flce/python/row_pipeline_test.py \
    "$bin/flce_server" > "$OUT/row_pipeline_test.log" 2>&1 || status=1
  grep -E '(FAIL|ERROR)$|^Ran|^OK|^FAILED' "$OUT/row_pipeline_test.log"
  FLCE_TEST_BACKEND=cuda python3 /tmp/flce/python/vocab_parallel_test.py \
    "$bin/flce_server" > "$OUT/vocab_parallel_test.log" 2>&1 || status=1
  grep -E '(FAIL|ERROR)$|^Ran|^OK|^FAILED' "$OUT/vocab_parallel_test.log"
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
  FLCE_TEST_BACKEND=cuda REQUIRE_TRANSFORMERS=1 python3 /tmp/flce/python/integrations_test.py \
    "$bin/flce_server" > "$OUT/integrations_test.log" 2>&1 || status=1
  grep -E '(FAIL|ERROR|skipped.*)$|^Ran|^OK|^FAILED|largest|^torch.compile|^Trainer' \
    "$OUT/integrations_test.log"
fi

if [ -z "$ARGS" ] || want examples; then
  echo "== the Python examples as a user runs them, against --backend=cuda"
  "$bin/flce_server" --backend=cuda --insecure --listen_address=127.0.0.1:50061 \
    > "$OUT/examples_server.log" 2>&1 &
  examples_server=$!
  for _ in $(seq 100); do "$bin/flce" --server=127.0.0.1:50061 health > /dev/null 2>&1 && break; sleep 0.1; done
  python3 /tmp/flce/python/train_tiny_lm.py --server=127.0.0.1:50061 --steps=5 --compare || status=1
  for arch in llama gemma2; do
    python3 /tmp/flce/python/hf_trainer.py --server=127.0.0.1:50061 --arch=$arch --steps=3 \
      2> "$OUT/hf_trainer_$arch.log" || status=1
  done
  python3 /tmp/flce/python/ddp_train.py --server=127.0.0.1:50061 --world=2 --recipe=registered \
    || status=1
  kill -TERM "$examples_server"; wait "$examples_server"
fi

if [ -z "$ARGS" ] || want smoke; then
  echo "== flce smoke against --backend=cuda"
  "$bin/flce_server" --backend=cuda --insecure --listen_address=127.0.0.1:50051 > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do "$bin/flce" health > /dev/null 2>&1 && break; sleep 0.1; done
  "$bin/flce" info
  "$bin/flce" smoke --matrix --n=257 --h=129 --v=8191 > "$OUT/smoke.log" 2>&1 || status=1
  # No label smoothing, V a multiple of 8 over 8192: STORE_GRADS's one-pass rows.
  for dtype in bf16 fp32; do
    for reduction in mean sum; do
      for options in "" "--bias --class_weight --softcap=30"; do
        # shellcheck disable=SC2086
        "$bin/flce" smoke --dtype=$dtype --reduction=$reduction --mode=store_grads --n=257 \
          --h=129 --v=20008 --z_loss=1e-3 $options >> "$OUT/smoke.log" 2>&1 || status=1
      done
    done
  done
  grep -E '^(PASS|FAIL)' "$OUT/smoke.log"
  kill -TERM "$server"; wait "$server" || status=1
  tail -2 "$OUT/server.log"
  echo "== flce smoke --matrix against --backend=cuda --vocab_shards=2"
  "$bin/flce_server" --backend=cuda --vocab_shards=2 --insecure --listen_address=127.0.0.1:50051 \
    > "$OUT/server_sharded.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do "$bin/flce" health > /dev/null 2>&1 && break; sleep 0.1; done
  "$bin/flce" smoke --matrix --n=257 --h=129 --v=8191 > "$OUT/smoke_sharded.log" 2>&1 || status=1
  grep -E '^(PASS|FAIL)' "$OUT/smoke_sharded.log" | sort | uniq -c
  kill -TERM "$server"; wait "$server" || status=1
  # Two engines sharing the GPU: the several-device server's path on one.
  echo "== flce smoke --matrix against --backend=cuda --cuda_devices=$CUDA_DEVICES"
  "$bin/flce_server" --backend=cuda --cuda_devices="$CUDA_DEVICES" --insecure \
    --listen_address=127.0.0.1:50051 > "$OUT/server_two_engines.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do "$bin/flce" health > /dev/null 2>&1 && break; sleep 0.1; done
  "$bin/flce" info | grep -iE 'device|backend'
  "$bin/flce" smoke --matrix --n=257 --h=129 --v=8191 > "$OUT/smoke_two_engines.log" 2>&1 || status=1
  grep -E '^(PASS|FAIL)' "$OUT/smoke_two_engines.log" | sort | uniq -c
  kill -TERM "$server"; wait "$server" || status=1
  echo "== flce smoke --matrix against --backend=cuda --cuda_devices=$CUDA_DEVICES --cuda_devices_mode=spread"
  "$bin/flce_server" --backend=cuda --cuda_devices="$CUDA_DEVICES" --cuda_devices_mode=spread --insecure \
    --listen_address=127.0.0.1:50051 > "$OUT/server_spread.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do "$bin/flce" health > /dev/null 2>&1 && break; sleep 0.1; done
  "$bin/flce" smoke --matrix --n=257 --h=129 --v=8191 > "$OUT/smoke_spread.log" 2>&1 || status=1
  grep -E '^PASS:|^FAIL' "$OUT/smoke_spread.log"
  kill -TERM "$server"; wait "$server" || status=1
fi

if [ -z "$ARGS" ] || want bench; then
  shapes="${BENCH_SHAPES:-8192x4096x128256,8192x2304x256000,4096x4096x32000,32768x4096x128256}"
  read -r -a bench_flags <<< "${BENCH_FLAGS:-}"
  # BENCH_VARIANTS: ';'-separated sets of more flags (an empty one: none),
  # each a process of its own, in turn for BENCH_ROUNDS rounds (an A/B in
  # one call, e.g. ";--cuda_hopper_gemms=dx,dw").
  IFS=';' read -r -a variants <<< "${BENCH_VARIANTS:-}"
  [ "${#variants[@]}" -eq 0 ] && variants=("")
  for round in $(seq "${BENCH_ROUNDS:-1}"); do
    for variant in "${variants[@]}"; do
      read -r -a variant_flags <<< "$variant"
      echo "== flce_bench --backend=cuda --shapes=$shapes ${BENCH_FLAGS:-} $variant (round $round)"
      "$bin/flce_bench" --backend=cuda --shapes="$shapes" --dtypes="${BENCH_DTYPES:-bf16}" \
        --modes="${BENCH_MODES:-store_grads,recompute}" --warmup="${BENCH_WARMUP:-20}" --iters=10 \
        --cuda_chunk_bytes="${BENCH_CHUNK_BYTES:-0}" ${bench_flags[@]+"${bench_flags[@]}"} \
        ${variant_flags[@]+"${variant_flags[@]}"} 2>&1 | tee -a "$OUT/bench.txt" || status=1
    done
  done
fi
if want gemms && [ -n "$ARGS" ]; then
  shapes="${BENCH_SHAPES:-8192x2304x256000}"
  echo "== gemm_algos --shapes=$shapes"
  read -r -a gemm_flags <<< "${GEMM_FLAGS:-}"
  "$bin/gemm_algos" --shapes="$shapes" --chunk_rows="${GEMM_CHUNK_ROWS:-2048}" \
    --algos="${GEMM_ALGOS:-24}" ${gemm_flags[@]+"${gemm_flags[@]}"} 2>&1 | tee -a "$OUT/gemm_algos.txt" || status=1
fi
if want hopper && [ -n "$ARGS" ]; then
  echo "== hopper_gemm_bench ${HOPPER_FLAGS:-}"
  read -r -a hopper_flags <<< "${HOPPER_FLAGS:-}"
  timeout --signal=KILL "${HOPPER_TIMEOUT:-480}" "$bin/hopper_gemm_bench" \
    ${hopper_flags[@]+"${hopper_flags[@]}"} 2>&1 | tee -a "$OUT/hopper_gemm_bench.txt" || status=1
fi
if want rpc && [ -n "$ARGS" ]; then
  echo "== rpc_bench --backend=cuda --shape=${RPC_SHAPE:-8192x4096x128256}"
  read -r -a rpc_flags <<< "${RPC_FLAGS:-}"
  "$bin/rpc_bench" --backend=cuda --shape="${RPC_SHAPE:-8192x4096x128256}" --dtype=bf16 \
    --iters=10 ${rpc_flags[@]+"${rpc_flags[@]}"} 2>&1 | tee "$OUT/rpc_bench.txt" || status=1
fi
if want worker && [ -n "$ARGS" ]; then
  read -r -a worker_flags <<< "${WORKER_FLAGS:-}"
  # WORKER_MPS=1: once more with the worker and the server as clients of
  # one MPS daemon (the GPU then runs both without switching contexts).
  for mps in "" ${WORKER_MPS:+mps}; do
    echo "== worker_bench --transports=${WORKER_TRANSPORTS:-cuda_ipc}${mps:+ under MPS}"
    [ -n "$mps" ] && nvidia-cuda-mps-control -d
    python3 /tmp/flce/python/worker_bench.py "$bin/flce_server" \
      --transports="${WORKER_TRANSPORTS:-cuda_ipc}" --json="$OUT/worker_bench${mps:+_mps}.json" \
      ${worker_flags[@]+"${worker_flags[@]}"} 2>&1 | tee "$OUT/worker_bench${mps:+_mps}.txt" \
      || status=1
    [ -n "$mps" ] && { echo quit | nvidia-cuda-mps-control; }
  done
fi
if want latency && [ -n "$ARGS" ]; then
  echo "== same_host_latency ${LATENCY_FLAGS:-}"
  read -r -a latency_flags <<< "${LATENCY_FLAGS:-}"
  python3 /tmp/flce/python/same_host_latency.py "$bin/flce_server" \
    ${latency_flags[@]+"${latency_flags[@]}"} 2>&1 | tee "$OUT/same_host_latency.txt" || status=1
fi
if want bulk && [ -n "$ARGS" ]; then
  echo "== bulk_bench ${BULK_FLAGS:-}"
  read -r -a bulk_flags <<< "${BULK_FLAGS:-}"
  python3 /tmp/flce/python/bulk_bench.py "$bin/flce_server" \
    --backend=cuda --json="$OUT/bulk_bench.json" ${bulk_flags[@]+"${bulk_flags[@]}"} 2>&1 \
    | tee "$OUT/bulk_bench.txt" || status=1
fi
exit "$status"
