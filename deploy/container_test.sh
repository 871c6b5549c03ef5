#!/usr/bin/env bash
# Builds flce's image from deploy/docker/Dockerfile with podman/buildah and
# runs it: the CI stage "container" of tools/test.sh. No registry is
# reachable here, so the base images are made from Debian's archive
# (debootstrap --variant=minbase bookworm) and passed as build arguments;
# the Dockerfile itself still names the public bases by default.
#
#   deploy/container_test.sh RESULTS.xml FLCE_CLI
#
# Writes one JUnit test case per check to RESULTS.xml (tools/test.sh counts
# them) and exits non-zero if any failed. FLCE_CLI is the host's `flce`
# binary: the checks talk to the container through its published ports.
# Checks: the CPU image builds; the build context holds no secret file; the
# image runs as UID 10001 and holds no secret file; `flce health` (the health
# port and the service port) and the image's own HEALTHCHECK answer SERVING;
# `flce smoke` passes through the published port; SIGTERM ends the server
# with exit code 0 within its grace period; the GPU variant builds (with the
# machine's CUDA toolkit mounted in place of NVIDIA's repository) and every
# shared library its binaries need resolves inside it (ldd).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
results="$1"
cli="$(realpath "$2")"

scratch="$(mktemp -d)"
export CONTAINERS_CONF="$scratch/containers.conf"
# crun fails on this kind of machine on cgroups and rlimits; runc with
# cgroupfs works.
cat > "$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
name="flce-ci-$$"
cleanup() {
  podman rm -f "$name" >/dev/null 2>&1
  rm -rf "$scratch"
}
trap cleanup EXIT

cache="${FLCE_CONTAINER_CACHE:-/var/cache/flce-container}"
base=localhost/flce-base:debian12
gpu_base=localhost/flce-cuda-runtime:13.0
cases=()  # "name|seconds|failure message (empty: passed)|skipped"
failed=0

# check NAME COMMAND...: runs COMMAND, its output into the case's log.
check() {
  local case="$1" start end out
  shift
  echo "== container: $case" >&2
  start=$(date +%s)
  out="$scratch/$case.log"
  if "$@" > "$out" 2>&1; then
    end=$(date +%s)
    cases+=("$case|$((end - start))||")
    echo "   ok ($((end - start)) s)" >&2
    return 0
  fi
  end=$(date +%s)
  failed=$((failed + 1))
  cases+=("$case|$((end - start))|$(tail -c 3000 "$out")|")
  echo "   FAILED ($((end - start)) s):" >&2
  tail -n 30 "$out" >&2
  return 1
}

skip() { cases+=("$1|0||$2"); echo "== container: $1 skipped: $2" >&2; }

write_results() {
  /usr/bin/python3 - "$results" "${cases[@]}" <<'PY'
import sys
import xml.etree.ElementTree as ET
suite = ET.Element("testsuite", name="container")
for entry in sys.argv[2:]:
    name, seconds, failure, skipped = entry.split("|", 3)
    case = ET.SubElement(suite, "testcase", classname="container", name=name, time=seconds)
    if failure:
        ET.SubElement(case, "failure", message="failed").text = failure
    elif skipped:
        ET.SubElement(case, "skipped", message=skipped)
suites = ET.Element("testsuites")
suites.append(suite)
ET.ElementTree(suites).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
PY
}

free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# --- base images -----------------------------------------------------------

make_base() {
  mkdir -p "$cache"
  if [ ! -s "$cache/bookworm-minbase.tar" ]; then
    local root="$scratch/rootfs"
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian
    tar -C "$root" -cf "$cache/bookworm-minbase.tar.part" .
    mv "$cache/bookworm-minbase.tar.part" "$cache/bookworm-minbase.tar"
    rm -rf "$root"
  fi
  podman import "$cache/bookworm-minbase.tar" "$base"
}

# What nvidia/cuda:13.0.0-runtime brings that the binaries link: cuBLAS,
# cuBLASLt and the CUDA runtime, from this machine's toolkit, in the same
# place (/usr/local/cuda/lib64, on the loader's path). The driver's
# libcuda.so.1 is the NVIDIA container toolkit's to mount at run time.
make_gpu_base() {
  local c lib
  c=$(buildah from "$base") || return 1
  buildah run --isolation chroot "$c" mkdir -p /usr/local/cuda-13.0/lib64 || return 1
  for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
    buildah copy "$c" "$(readlink -f "/usr/local/cuda/lib64/$lib")" \
      "/usr/local/cuda-13.0/lib64/$lib" || return 1
  done
  buildah run --isolation chroot "$c" sh -c \
    'ln -s cuda-13.0 /usr/local/cuda && echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig' \
    || return 1
  buildah commit --rm "$c" "$gpu_base"
}

# --- the build context -------------------------------------------------------

# A copy of the working tree (what `podman build .` would send), with secret
# files planted where an operator puts them; .dockerignore must keep them out.
context="$scratch/context"
make_context() {
  mkdir -p "$context"
  tar -c --exclude=./.git --exclude='./bazel-*' --exclude=./.devbin . | tar -C "$context" -x
  local overlay="$context/deploy/k8s/overlays/production"
  printf -- '-----BEGIN PRIVATE KEY-----\nplanted by container_test\n' > "$overlay/tls.key"
  printf 'worker planted-by-container-test\n' > "$overlay/tokens"
  printf 'planted\n' > "$overlay/tls.crt"
  mkdir -p "$context/secrets" && printf 'planted\n' > "$context/secrets/flce.pem"
}

context_holds_no_secret() {
  printf 'FROM %s\nCOPY . /ctx\n' "$base" > "$scratch/Containerfile.context"
  buildah bud --isolation chroot --network host -f "$scratch/Containerfile.context" \
    -t localhost/flce-context-check "$context" || return 1
  local found
  found=$(podman run --rm --network=host localhost/flce-context-check sh -c \
    'cd /ctx && find . -name tls.key -o -name tokens -o -name tls.crt -o -name "*.pem" -o -name .git -o -name "bazel-*"')
  podman rmi localhost/flce-context-check >/dev/null
  if [ -n "$found" ]; then
    echo "the build context holds: $found"
    return 1
  fi
  # The planted files are there to be excluded (not absent by accident).
  test -f "$context/deploy/k8s/overlays/production/tls.key"
}

build_image() {  # VARIANT EXTRA_ARGS...
  local variant="$1"
  shift
  buildah bud --isolation chroot --network host --layers --format docker \
    -f deploy/docker/Dockerfile --build-arg VARIANT="$variant" \
    --build-arg BUILD_BASE="$base" "$@" -t "localhost/flce:$variant-ci" "$context"
}

# --- the running image -------------------------------------------------------

port=$(free_port)
health_port=$(free_port)
grace_seconds=10

start_container() {
  podman run -d --name "$name" -p "127.0.0.1:$port:50051" -p "127.0.0.1:$health_port:8081" \
    localhost/flce:cpu-ci --insecure --backend=cpu --listen_address=0.0.0.0:50051 \
    --health_address=0.0.0.0:8081 --shutdown_grace="${grace_seconds}s" || return 1

  for _ in $(seq 1 60); do
    if "$cli" --server="127.0.0.1:$health_port" --timeout=2s health >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.5
  done
  podman logs "$name"
  return 1
}

runs_as_non_root() {
  local user uid
  user=$(podman image inspect --format '{{.Config.User}}' localhost/flce:cpu-ci)
  uid=$(podman exec "$name" id -u)
  echo "image user '$user', process uid $uid"
  [ "$user" = 10001 ] && [ "$uid" = 10001 ]
}

image_holds_no_secret() {
  local found
  found=$(podman run --rm --user 0 --entrypoint /bin/sh localhost/flce:cpu-ci -c \
    'find / -xdev \( -name "*.key" -o -name tokens -o -name "*.pem" -o -name "*.p12" \) -print;
     grep -rlI "PRIVATE KEY" /opt /etc /root /home /src /tmp 2>/dev/null')
  if [ -n "$found" ]; then
    echo "secret-looking files in the image: $found"
    return 1
  fi
}

health() {
  "$cli" --server="127.0.0.1:$health_port" health &&
    "$cli" --server="127.0.0.1:$port" health &&
    podman healthcheck run "$name"
}

smoke() {
  "$cli" --server="127.0.0.1:$port" smoke --dtype=bf16 --n=33 --h=64 --v=1003 \
    --label_smoothing=0.1 --bias --class_weight
}

sigterm_exits_0() {
  local start end code
  start=$(date +%s)
  podman kill --signal TERM "$name" || return 1
  timeout $((grace_seconds + 20)) podman wait "$name" || return 1
  end=$(date +%s)
  code=$(podman inspect --format '{{.State.ExitCode}}' "$name")
  podman logs "$name" 2>&1 | tail -n 5
  echo "exit code $code after $((end - start)) s (grace ${grace_seconds} s)"
  [ "$code" = 0 ] && [ $((end - start)) -le $((grace_seconds + 5)) ]
}

gpu_image_libraries() {
  build_image gpu --build-arg CUDA_TOOLKIT=mounted --build-arg GPU_BASE="$gpu_base" \
    --volume "$(readlink -f /usr/local/cuda):/usr/local/cuda:ro" || return 1
  podman run --rm --entrypoint /bin/sh localhost/flce:gpu-ci -c \
    'for b in /opt/flce/bin/flce_server /opt/flce/bin/flce; do
       ldd "$b" | grep -q cublas || [ "$b" = /opt/flce/bin/flce ] || { echo "$b: no cuBLAS (built without CUDA?)"; exit 1; }
       if ldd "$b" | grep "not found"; then echo "$b: missing libraries"; exit 1; fi
     done; ldd /opt/flce/bin/flce_server'
}

if check base_image make_base; then
  check build_context_holds_no_secret eval 'make_context && context_holds_no_secret'
  if check build_cpu_image build_image cpu --build-arg CPU_BASE="$base"; then
    check image_holds_no_secret image_holds_no_secret
    if check container_serves start_container; then
      check runs_as_non_root runs_as_non_root
      check health_serving health
      check smoke_through_published_port smoke
      check sigterm_exits_0_within_grace sigterm_exits_0
    fi
  fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    check gpu_runtime_base make_gpu_base && check gpu_image_libraries gpu_image_libraries
  else
    skip gpu_image_libraries "no CUDA toolkit at /usr/local/cuda"
  fi
fi
podman rmi -f localhost/flce:cpu-ci localhost/flce:gpu-ci >/dev/null 2>&1
write_results
echo "container: ${#cases[@]} checks, $failed failed" >&2
[ "$failed" -eq 0 ]
