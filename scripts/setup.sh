#!/usr/bin/env bash
# Installs everything aenv needs on a fresh Debian/Ubuntu machine, idempotently:
# system packages, Redis (if none answers), the Python venv, the database schema,
# the default team/template/API key and the base guest image (cached under var/).
# Each step is a function; sourced, this file only defines them, so deploy/install-node.sh
# and the node's container image (deploy/docker/Dockerfile.node) run the steps a node needs
# from this one list instead of a copy of it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# skopeo + umoci pull and unpack OCI images (vmm/oci). patchelf + binutils (readelf) relocate envd and resize2fs
# onto the tools drive's loader (vmm/toolsdrive.py). fuse3 (fusermount3, libfuse3) serves chunkfs's lazy files
# (python -m chunkfs serve: mfusepy loads libfuse3 with ctypes, so no libfuse3-dev). nfs-ganesha-vfs (+ its rpcbind)
# serves a sandbox's volumes over NFSv3 inside its own slot (vmm/net/volume_server.py); their system services stay off.
NODE_APT_PACKAGES=(qemu-system-x86 qemu-utils debootstrap e2fsprogs busybox-static curl ca-certificates redis-tools
                   nftables iproute2 util-linux dnsmasq-base skopeo umoci patchelf binutils fuse3
                   nfs-ganesha nfs-ganesha-vfs rpcbind)
# Only the tests use these: docker-registry + apache2-utils (htpasswd) are the local registry the tests push their
# own images to (harness/oci_registry.py); bash-static is the shell of the tests' image without glibc (harness/oci_images.py);
# The shellcheck package checks every shell script of the repository (tests/unit/test_shell_scripts.py, beside the test extra's).
# docker.io is the Docker engine tests/compose/ starts deploy/compose.yaml on (the Compose CLI is the test extra's).
TEST_APT_PACKAGES=(docker-registry apache2-utils bash-static shellcheck docker.io)
# The data plane's hot path (dataplane.serve starts it beside uvicorn; its own config, no listening port of
# its own): not on a node-only install, which runs no data plane.
DATAPLANE_APT_PACKAGES=(haproxy)

# QEMU 9.0 or newer (its dirty tracking under TCG is sound, so a snapshot's pre-copy capture
# stops even a 2 GiB guest for ~10 ms: docs/benchmarks.md "QEMU 10.0"). Debian 12 ships 7.2:
# there QEMU and the few packages its backport needs newer come from bookworm-backports (10.0,
# what Debian 13 ships), pinned so nothing else leaves bookworm. Elsewhere the distribution's.
QEMU_MIN_VERSION="1:9.0"
QEMU_BACKPORTS_SOURCE=/etc/apt/sources.list.d/aenv-bookworm-backports.sources
QEMU_BACKPORTS_PIN=/etc/apt/preferences.d/aenv-qemu
QEMU_BACKPORTS_PACKAGES=(qemu-system-x86 qemu-system-common qemu-system-data qemu-system-gui
                         qemu-system-modules-opengl qemu-system-modules-spice qemu-utils qemu-block-extra seabios
                         libpipewire-0.3-0 libpipewire-0.3-common libspa-0.2-modules)

setup_qemu_backports() {  # bookworm only: writes the backports source and the pin (0: changed, 1: as it was)
  local codename want_source want_pin changed=1
  # shellcheck source=/dev/null
  codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
  [ "$codename" = bookworm ] || return 1
  want_source="$(printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" "Suites: bookworm-backports" \
                 "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg")"
  want_pin="$(printf '%s\n' "Package: ${QEMU_BACKPORTS_PACKAGES[*]}" "Pin: release n=bookworm-backports" \
              "Pin-Priority: 990")"
  if [ "$(cat "$QEMU_BACKPORTS_SOURCE" 2>/dev/null)" != "$want_source" ]; then
    echo "==> adding bookworm-backports for QEMU ($QEMU_BACKPORTS_SOURCE)"
    printf '%s\n' "$want_source" | $SUDO tee "$QEMU_BACKPORTS_SOURCE" >/dev/null
    changed=0
  fi
  if [ "$(cat "$QEMU_BACKPORTS_PIN" 2>/dev/null)" != "$want_pin" ]; then
    printf '%s\n' "$want_pin" | $SUDO tee "$QEMU_BACKPORTS_PIN" >/dev/null
    changed=0
  fi
  return $changed
}

qemu_too_old() {  # an installed qemu-system-x86 older than QEMU_MIN_VERSION (none installed: no)
  local version
  version="$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null)" || return 1
  [ -n "$version" ] && dpkg --compare-versions "$version" lt "$QEMU_MIN_VERSION"
}

setup_system_packages() {  # --node: only what a node runs; --all: also the tests' registry, shells and shellcheck
  local packages=("${NODE_APT_PACKAGES[@]}") missing=() p updated=""
  [ "${1:-}" = "--node" ] || packages+=("${DATAPLANE_APT_PACKAGES[@]}" "${TEST_APT_PACKAGES[@]}")
  python3 -c 'import venv, ensurepip' 2>/dev/null || packages+=(python3-venv python3-dev)
  if setup_qemu_backports; then $SUDO apt-get update -qq; updated=1; fi
  if [ -f "$QEMU_BACKPORTS_PIN" ] && qemu_too_old; then
    echo "==> upgrading QEMU to bookworm-backports' ($(dpkg-query -W -f='${Version}' qemu-system-x86) is older than 9.0)"
    [ -n "$updated" ] || $SUDO apt-get update -qq
    updated=1
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq qemu-system-x86 qemu-utils >/dev/null
  fi
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> installing system packages: ${missing[*]}"
    [ -n "$updated" ] || $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    # Only the tests run registries (on 127.0.0.1, their own config): not the package's service on *:5000.
    if [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true
    fi
    # The data plane starts its own HAProxy: never the package's system-wide one.
    if [[ " ${missing[*]} " == *" haproxy "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      $SUDO systemctl disable --now haproxy >/dev/null 2>&1 || true
    fi
    # Volume servers run per sandbox in its slot: never the packages' host-wide NFS server and portmapper.
    if [[ " ${missing[*]} " == *" nfs-ganesha "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      $SUDO systemctl disable --now nfs-ganesha rpcbind.socket rpcbind >/dev/null 2>&1 || true
    fi
  fi
}

setup_redis() {  # Redis is the Celery broker/result backend and the channel layer.
  if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    if ! command -v redis-server >/dev/null; then
      echo "==> installing redis-server"
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
    fi
    echo "==> starting redis-server on 127.0.0.1:6379"
    $SUDO redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
    for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && break; sleep 0.1; done
  fi
}

setup_docker_engine() {  # Debian's dockerd for tests/compose/, started when no engine answers (no systemd here)
  command -v dockerd >/dev/null || return 0
  docker info >/dev/null 2>&1 && return 0
  echo "==> starting dockerd (log: $AENV_HOME/docker/dockerd.log)"
  mkdir -p "$AENV_HOME/docker"
  $SUDO setsid dockerd >>"$AENV_HOME/docker/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
  echo "dockerd did not answer within 60 s: see $AENV_HOME/docker/dockerd.log" >&2
  return 1
}

setup_python_env() (  # the venv in .venv, re-installed only when pyproject.toml changes
  cd "$ROOT"
  if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    python3 -m venv .venv
  fi
  stamp=".venv/.aenv-installed-$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    echo "==> installing Python dependencies"
    .venv/bin/pip install -q -U pip >/dev/null
    .venv/bin/pip install -q -e '.[test]'
    rm -f .venv/.aenv-installed-* && touch "$stamp"
  fi
)

EGRESS_PROXY_PACKAGES="mitmproxy==11.0.2 dnspython==2.9.2 python-socks==3.2.1"
setup_egress_proxy_env() (  # mitmproxy for the node's egress proxy (vmm/net/egress.py) in .venv-egress:
  cd "$ROOT"                 # a venv of its own, as its pins (cryptography, pyOpenSSL) differ from aenv's
  stamp=".venv-egress/.aenv-installed-$(echo "$EGRESS_PROXY_PACKAGES" | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    echo "==> installing the egress proxy (mitmproxy) into .venv-egress"
    [ -x .venv-egress/bin/python ] || python3 -m venv .venv-egress
    # shellcheck disable=SC2086 # a list of requirements
    .venv-egress/bin/pip install -q $EGRESS_PROXY_PACKAGES
    rm -f .venv-egress/.aenv-installed-* && touch "$stamp"
  fi
)

setup_database() (  # the schema, the default team, the base template and an API key
  cd "$ROOT"
  echo "==> database schema"
  .venv/bin/python manage.py migrate --noinput -v 0
  .venv/bin/python manage.py task_signing_keys  # AENV_HOME/task-signing: this machine's nodes run only signed tasks
  .venv/bin/python manage.py bootstrap
)

setup_static_files() (  # xterm.js (npm) and the dashboard's static files
  cd "$ROOT"
  "$ROOT/scripts/setup_frontend.sh"
  .venv/bin/python manage.py collectstatic --noinput -v 0
)

setup_guest_images() (
  cd "$ROOT"
  local_images="${AENV_IMAGES_DIR:-$AENV_HOME/images}"
  echo "==> base guest image (built once, cached under $local_images)"
  .venv/bin/python -m vmm.images build --name base --images-dir "$local_images"
  # The default template shape (sandboxes.Template defaults: 2 vCPU, 512 MiB, 2 GiB disk) booted once and
  # captured with envd running: creating a sandbox is then a restore, not a cold boot. Cached per image
  # build + shape + driver fingerprint (accelerator, QEMU version, ...); a miss only means slower (cold) creates.
  echo "==> template snapshot of the base image (2 vCPU, 512 MiB)"
  .venv/bin/python -m vmm.templates build --image base --cpu 2 --memory 512 --disk 2048 \
    --images-dir "$local_images"
)

setup_system_template_packages() (  # what the system templates install offline (code-interpreter-v1's wheels and,
  # as root with the base image built, its venv made on the host in the guest's root file system)
  cd "$ROOT"
  echo "==> packages of the system templates (downloaded and built once per list, cached under .cache/packages)"
  .venv/bin/python manage.py ensure_system_templates --download-only
)

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  cd "$ROOT"
  export AENV_HOME="${AENV_HOME:-$ROOT/var}"
  mkdir -p "$AENV_HOME" "$ROOT/.cache"
  setup_system_packages --all
  # Only tests/compose/ needs the engine: a machine where it cannot start still gets the rest
  # (and that tier fails there, saying why).
  setup_docker_engine || echo "==> warning: no Docker engine: tests/compose/ cannot run here" >&2
  setup_redis
  setup_python_env
  setup_egress_proxy_env
  setup_database
  setup_static_files
  setup_guest_images
  setup_system_template_packages
fi
