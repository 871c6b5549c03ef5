#!/usr/bin/env bash
# Installs binaries into DEST/bin and the shared libraries they need into
# DEST/lib, except those every target system provides (glibc, libstdc++,
# libgcc) or must provide itself (the CUDA driver and cuBLAS, which come with
# the driver or the CUDA runtime image). Used by the container build and by
# tools/device_bundle.sh. Run with LD_LIBRARY_PATH=DEST/lib.
# Usage: tools/package.sh DEST BINARY...
set -euo pipefail
dest="$1"
shift
mkdir -p "$dest/bin" "$dest/lib"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread\.|libdl\.|librt\.|libgcc_s\.|libstdc\+\+\.|libcublas\.|libcublasLt\.|libcuda\.)'
for binary in "$@"; do
  install -m 755 "$binary" "$dest/bin/"
  strip --strip-debug "$dest/bin/$(basename "$binary")"
  ldd "$binary" | awk '/=>/ {print $1, $3}' | while read -r name lib; do
    if ! echo "$name" | grep -Eq "$skip" && [ -f "$lib" ]; then
      cp -L "$lib" "$dest/lib/$name"
    fi
  done
done
