#!/usr/bin/env bash
# Builds and starts flce_server (installing what is missing). Flags pass
# through, e.g.: tools/run_server.sh --listen_address=0.0.0.0:50051 --backend=cpu
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //server:flce_server //client:flce
# Transparent huge pages for glibc's large allocations (request and response
# buffers): page faults are costly on virtual machines (see DESIGN.md).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
exec bazel-bin/server/flce_server "$@"
