#!/usr/bin/env bash
# Builds and starts flce_server (installing what is missing). Flags pass
# through, e.g.: tools/run_server.sh --tls_cert_file=server.crt --tls_key_file=server.key
# With no flags it serves plaintext on loopback only (127.0.0.1:50051) for a
# first look; any other address needs TLS or an explicit --insecure.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //server:flce_server //client:flce
# Transparent huge pages for glibc's large allocations (request and response
# buffers): page faults are costly on virtual machines (see DESIGN.md).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
if [ "$#" -eq 0 ]; then
  set -- --insecure --listen_address=127.0.0.1:50051
fi
exec bazel-bin/server/flce_server "$@"
