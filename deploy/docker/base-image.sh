#!/usr/bin/env bash
# The base image of aenv's container images (deploy/docker/Dockerfile.*): a minimal Debian
# bookworm root made here with debootstrap and imported as aenv-debian:bookworm, so nothing is
# pulled from an image registry (the machines aenv is built on reach only package mirrors). With
# a registry, skip this and build with --build-arg BASE_IMAGE=debian:bookworm.
#   deploy/docker/base-image.sh [--force]
# Idempotent, keyed by its recipe (this script, the mirror, the host's extra certificate
# authorities): the image is also tagged aenv-debian:recipe-<hash>, and a run whose recipe's tag
# exists only points $IMAGE at it (a changed recipe builds again instead of keeping a stale root).
# The root's tarball is cached per recipe under the checkout's ignored .cache/docker (beside
# .cache/packages), so importing it again after `docker image rm` is seconds, not a debootstrap.
# The host's own certificate authorities (/usr/local/share/ca-certificates) go into the root, so
# builds behind a TLS-intercepting proxy reach PyPI and npm as the host does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
IMAGE="${AENV_BASE_IMAGE:-aenv-debian:bookworm}"
MIRROR="${AENV_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="$ROOT/.cache/docker"
# The recipe's hash: this script without its comments, the mirror, the extra authorities.
RECIPE="$({ grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; echo "$MIRROR"
  cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true; } | sha256sum | cut -c1-16)"
RECIPE_TAG="${IMAGE%:*}:recipe-$RECIPE"
TARBALL="$CACHE/debian-bookworm-minbase-$RECIPE.tar"

force=0
[ "${1:-}" = "--force" ] && force=1
if [ "$force" = 0 ] && docker image inspect "$RECIPE_TAG" >/dev/null 2>&1; then
  [ "$(docker image inspect -f '{{.Id}}' "$RECIPE_TAG")" = "$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null)" ] \
    || docker tag "$RECIPE_TAG" "$IMAGE"
  exit 0
fi

if [ "$force" = 1 ] || [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { echo "base-image: debootstrap is not installed" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "base-image: debootstrap needs root" >&2; exit 1; }
  mkdir -p "$CACHE"
  rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  echo "==> debootstrap bookworm (minbase) from $MIRROR"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$MIRROR" >/dev/null
  cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
EOF
  # No service starts while an image installs its packages (there is no init to stop it).
  printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
  chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' > "$rootfs/etc/apt/apt.conf.d/90aenv-no-recommends"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
  fi
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log
  tar --numeric-owner -C "$rootfs" -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
  find "$CACHE" -maxdepth 1 -name 'debian-bookworm-minbase-*.tar' ! -name "${TARBALL##*/}" -delete  # older recipes
fi

echo "==> docker import $TARBALL as $IMAGE"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["bash"]' \
  "$TARBALL" "$IMAGE" >/dev/null
docker tag "$IMAGE" "$RECIPE_TAG"
# Older recipes' tags (their images go with them once no other tag or image uses them).
docker image ls --format '{{.Repository}}:{{.Tag}}' "${IMAGE%:*}" | grep -F ":recipe-" | grep -vxF "$RECIPE_TAG" \
  | xargs -r docker rmi >/dev/null 2>&1 || true
