#!/usr/bin/env bash
# Third-party browser assets and the browser-test browser, idempotently:
#   - xterm.js (@xterm/xterm, @xterm/addon-fit) from the npm registry into vendor/
#     (ignored by git; settings.STATICFILES_DIRS exposes it as static/vendor/...),
#   - Debian's chromium for the Playwright browser tests (tests/browser/).
# Nothing third-party is committed. Called by scripts/setup.sh before collectstatic;
# safe to run again (it does nothing when the pinned versions are already there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENDOR="$ROOT/vendor"
# Pinned: the dashboard's terminal.js is written against these APIs.
PACKAGES=("@xterm/xterm@6.0.0" "@xterm/addon-fit@0.11.0")

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  apt_install nodejs npm
fi
# Browser tests drive /usr/bin/chromium headless.
if [ ! -x /usr/bin/chromium ]; then
  apt_install chromium
fi

installed_version() {  # $1 = package name → its installed version, or nothing
  local manifest="$VENDOR/node_modules/$1/package.json"
  if [ -f "$manifest" ]; then node -p "require(process.argv[1]).version" "$manifest" 2>/dev/null || true; fi
}

needed=()
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}"
  version="${spec##*@}"
  [ "$(installed_version "$name")" = "$version" ] || needed+=("$spec")
done
if [ ${#needed[@]} -gt 0 ]; then
  echo "==> installing browser packages into vendor/: ${needed[*]}"
  mkdir -p "$VENDOR"
  [ -f "$VENDOR/package.json" ] || echo '{"name": "aenv-vendor", "private": true}' > "$VENDOR/package.json"
  npm install --prefix "$VENDOR" --no-audit --no-fund --loglevel=error --save-exact "${PACKAGES[@]}" >/dev/null
fi
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}"
  [ "$(installed_version "$name")" = "${spec##*@}" ] || { echo "setup_frontend: $spec did not install" >&2; exit 1; }
done
