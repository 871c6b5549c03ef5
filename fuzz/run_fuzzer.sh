#!/usr/bin/env bash
# Runs a fuzz target over its committed corpus. Built with libFuzzer
# (--config=fuzz) it fuzzes for FUZZ_SECONDS (default 60) starting from the
# corpus, writing new inputs to a scratch copy; built without, it replays the
# corpus once. Either way a crash or sanitizer report fails the test.
# Usage: run_fuzzer.sh FUZZER CORPUS_DIR
set -euo pipefail
fuzzer="$1"
corpus="$2"
scratch="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
mkdir -p "$scratch"
exec "$fuzzer" -max_total_time="${FUZZ_SECONDS:-60}" -rss_limit_mb=4096 -timeout=30 \
  -print_final_stats=1 "$scratch" "$corpus"
