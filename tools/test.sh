#!/usr/bin/env bash
# Runs flce's whole test suite: installs what is missing, builds, runs every
# Bazel test, then prints "N passed, M failed[, K skipped]" counted from the
# tests' own result files (every test case, not every target). Exits non-zero
# on any failure. Tests tagged `gpu` skip cleanly without a device (set
# REQUIRE_GPU=1 to make a missing device a failure).
set -uo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

bep="$(mktemp)"
trap 'rm -f "$bep"' EXIT
bazel test //... --test_env=REQUIRE_GPU="${REQUIRE_GPU:-0}" \
  --build_event_json_file="$bep" "$@"
bazel_status=$?

# Count from this invocation's build events (cached results included), so a
# stale test.xml of a target that no longer builds is never counted.
mapfile -t targets < <(bazel query 'tests(//...)' 2>/dev/null)
/usr/bin/python3 - "$bep" "${targets[@]}" <<'PY'
import json
import sys
import xml.etree.ElementTree as ET
from urllib.parse import unquote, urlparse

bep_path, targets = sys.argv[1], sys.argv[2:]
results = {}  # label -> list of (status, test.xml path)
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

passed = failed = skipped = 0
for target in targets:
    if target not in results:
        print("no results for %s (did not build or run)" % target)
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
                print("%s: %s" % (target, status))
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
            print("%s: %s" % (target, status))
            failed += 1
line = "%d passed, %d failed" % (passed, failed)
if skipped:
    line += ", %d skipped" % skipped
print(line)
PY
count_status=$?
if [ "$bazel_status" -ne 0 ] || [ "$count_status" -ne 0 ]; then
  exit 1
fi
