#!/usr/bin/env bash
# Runs flce's whole test suite: installs what is missing, builds, runs every
# Bazel test, then prints "N passed, M failed[, K skipped]" counted from the
# tests' own result files (every test case, not every target). Exits non-zero
# on any failure. Tests tagged `gpu` skip cleanly without a device (set
# REQUIRE_GPU=1 to make a missing device a failure).
set -uo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

bazel test //... --test_env=REQUIRE_GPU="${REQUIRE_GPU:-0}" "$@"
bazel_status=$?

testlogs="$(bazel info bazel-testlogs 2>/dev/null)"
mapfile -t targets < <(bazel query 'tests(//...)' 2>/dev/null)
/usr/bin/python3 - "$testlogs" "${targets[@]}" <<'PY'
import os
import sys
import xml.etree.ElementTree as ET

testlogs, targets = sys.argv[1], sys.argv[2:]
passed = failed = skipped = 0
for target in targets:
    path = os.path.join(testlogs, target.lstrip("/").replace(":", "/"), "test.xml")
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        print("no results for %s (did not build or run)" % target)
        failed += 1
        continue
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
line = "%d passed, %d failed" % (passed, failed)
if skipped:
    line += ", %d skipped" % skipped
print(line)
PY
count_status=$?
if [ "$bazel_status" -ne 0 ] || [ "$count_status" -ne 0 ]; then
  exit 1
fi
