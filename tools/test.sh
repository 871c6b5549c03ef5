#!/usr/bin/env bash
# Runs flce's whole test suite: installs what is missing, builds, runs every
# Bazel test, then the unit/integration/security tests again under ASan and
# UBSan (--config=asan) and the fuzzer for FUZZ_SECONDS (--config=fuzz,
# clang + libFuzzer), each in its own Bazel output base, then builds and runs
# the container image (deploy/container_test.sh, podman + buildah); prints
# "N passed, M failed[, K skipped]" counted from the tests' own result files
# (every test case, not every target) over all four. Exits non-zero on any
# failure. Tests tagged `gpu` skip cleanly without a device (REQUIRE_GPU=1
# makes a missing device a failure). FLCE_QUICK=1 runs the first stage only.
# Extra arguments go to the first stage's `bazel test`. bazel-bin and the
# other convenience links stay on the first stage's (the release) build.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
status=0
phases=()  # "name|BEP file|file listing the expected test targets"

# run_stage NAME OUTPUT_BASE_SUFFIX TARGET_PATTERN... -- BAZEL_TEST_ARGS...
run_stage() {
  local name="$1" suffix="$2"
  shift 2
  local patterns=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  local startup=() links=()
  if [ -n "$suffix" ]; then
    startup=(--output_base="$(bazel info output_base 2>/dev/null)-$suffix")
    links=(--symlink_prefix=/)  # no bazel-* links: they stay on the main build
  fi
  echo "== $name: bazel test ${patterns[*]} $*" >&2
  bazel "${startup[@]}" test "${patterns[@]}" --build_event_json_file="$scratch/$name.bep" \
    "${links[@]}" "$@" || status=1
  local query
  query="tests($(printf '%s + ' "${patterns[@]}" | sed 's/ + $//'))"
  bazel query "$query" 2>/dev/null > "$scratch/$name.targets"
  phases+=("$name|$scratch/$name.bep|$scratch/$name.targets")
}

run_stage main "" //... -- --test_env=REQUIRE_GPU="${REQUIRE_GPU:-0}" "$@"
if [ -z "${FLCE_QUICK:-}" ]; then
  run_stage asan asan //kernels:all //kernels/cpu/... //kernels/reference/... //proto/... \
    //server/... //client:npy_test //tests:server_integration_test //tests:security_test \
    //tests:hostile_client_test \
    //fuzz:request_fuzz_test -- --config=asan
  run_stage fuzz fuzz //fuzz/... -- --config=fuzz --test_env=FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
  # The image, built from deploy/docker/Dockerfile and run (as root: podman's
  # rootful mode; the base images come from debootstrap).
  echo "== container: deploy/container_test.sh" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO deploy/container_test.sh "$scratch/container.xml" bazel-bin/client/flce || status=1
  phases+=("container|junit:$scratch/container.xml|")
fi

/usr/bin/python3 - "${phases[@]}" <<'PY'
import json
import sys
import xml.etree.ElementTree as ET
from urllib.parse import unquote, urlparse

passed = failed = skipped = 0
for phase in sys.argv[1:]:
    name, bep_path, targets_path = phase.split("|")
    if bep_path.startswith("junit:"):  # a stage outside Bazel: its JUnit file
        p0, f0, s0 = passed, failed, skipped
        try:
            cases = list(ET.parse(bep_path[len("junit:"):]).getroot().iter("testcase"))
        except (OSError, ET.ParseError):
            cases = []
        if not cases:
            print("%s: no results (did not run)" % name)
            failed += 1
        for case in cases:
            if case.find("failure") is not None or case.find("error") is not None:
                print("%s: %s failed" % (name, case.get("name")))
                failed += 1
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
        print("%s: %d passed, %d failed, %d skipped" % (name, passed - p0, failed - f0, skipped - s0))
        continue
    with open(targets_path) as f:
        targets = [line.strip() for line in f if line.strip()]
    results = {}  # label -> list of (status, test.xml path)
    try:
        with open(bep_path) as f:
            for line in f:
                event = json.loads(line)
                if "testResult" not in event.get("id", {}) or "testResult" not in event:
                    continue
                label = event["id"]["testResult"]["label"]
                result = event["testResult"]
                xml = None
                for output in result.get("testActionOutput", []):
                    if output.get("name") == "test.xml":
                        xml = unquote(urlparse(output["uri"]).path)
                results.setdefault(label, []).append((result.get("status", ""), xml))
    except OSError:
        pass
    p0, f0, s0 = passed, failed, skipped
    for target in targets:
        if target not in results:
            print("%s: no results for %s (did not build or run)" % (name, target))
            failed += 1
            continue
        for status, xml in results[target]:
            try:
                cases = list(ET.parse(xml).getroot().iter("testcase"))
            except (OSError, TypeError, ET.ParseError):
                cases = []
            if not cases:
                # No per-case results (e.g. a crash before any test ran).
                if status == "PASSED":
                    passed += 1
                else:
                    print("%s: %s: %s" % (name, target, status))
                    failed += 1
                continue
            bad = 0
            for case in cases:
                if case.find("failure") is not None or case.find("error") is not None:
                    failed += 1
                    bad += 1
                elif case.get("result") == "skipped" or case.find("skipped") is not None:
                    skipped += 1
                else:
                    passed += 1
            if status != "PASSED" and bad == 0:
                # The target failed outside its test cases (crash, timeout).
                print("%s: %s: %s" % (name, target, status))
                failed += 1
    print("%s: %d passed, %d failed, %d skipped" % (name, passed - p0, failed - f0, skipped - s0))
line = "%d passed, %d failed" % (passed, failed)
if skipped:
    line += ", %d skipped" % skipped
print(line)
sys.exit(1 if failed else 0)
PY
count_status=$?
if [ "$status" -ne 0 ] || [ "$count_status" -ne 0 ]; then
  exit 1
fi
