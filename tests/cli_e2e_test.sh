#!/bin/sh
# Runs the CLI end-to-end test with Debian's Python (numpy comes from
# python3-numpy). Arguments: paths of flce_server and flce.
exec /usr/bin/python3 "${TEST_SRCDIR}/flce/tests/cli_e2e_test.py" "$@"
