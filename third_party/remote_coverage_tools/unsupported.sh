#!/bin/sh
echo "coverage is not supported by flce's offline Bazel build" >&2
exit 1
