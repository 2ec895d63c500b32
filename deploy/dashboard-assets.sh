#!/usr/bin/env bash
# The dashboard's browser packages (xterm.js) into vendor/ for a server: the same pinned
# versions as scripts/setup_frontend.sh (read from its PACKAGES line), without the Chromium
# that script adds for the browser tests. Used by deploy/install-node.sh --control-plane and
# deploy/docker/Dockerfile.control-plane. Idempotent: npm keeps what is already there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

line="$(grep -E '^PACKAGES=\(' "$ROOT/scripts/setup_frontend.sh")" || {
  echo "dashboard-assets: no PACKAGES=(...) line in scripts/setup_frontend.sh" >&2; exit 1; }
eval "$line"  # our own file's array of "name@version" pins
if ! command -v npm >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "==> installing nodejs, npm"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi
mkdir -p "$ROOT/vendor"
[ -f "$ROOT/vendor/package.json" ] || echo '{"name": "aenv-vendor", "private": true}' > "$ROOT/vendor/package.json"
echo "==> dashboard packages into vendor/: ${PACKAGES[*]}"
npm install --prefix "$ROOT/vendor" --no-audit --no-fund --loglevel=error --save-exact "${PACKAGES[@]}" >/dev/null
