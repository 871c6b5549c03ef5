#!/usr/bin/env bash
# Installs every Debian package that flce's build, tests and server need.
# Idempotent and non-interactive: installs only what is missing.
#   tools/setup.sh           everything: build, tests, the container stage
#   tools/setup.sh --build   only what `bazel build //server:flce_server
#                            //client:flce` needs (the image's build stage)
set -euo pipefail

PACKAGES=(
  bazel-bootstrap g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libopenblas-dev libdnnl-dev
  libssl-dev libmicrohttpd-dev libcurl4-openssl-dev
)
if [ "${1:-}" != "--build" ]; then
  PACKAGES+=(
    clang libclang-rt-dev shellcheck yamllint python3-yaml openssl
    python3 python3-numpy python3-grpcio python3-protobuf python3-torch
    python3-venv python3-pip python3-setuptools python3-wheel
    podman buildah debootstrap runc
  )
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
echo "tools/setup.sh: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
