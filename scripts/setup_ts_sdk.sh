#!/usr/bin/env bash
# The official E2B TypeScript SDK for the TypeScript end-to-end suite (tests/ts/,
# run by tests/integration/test_ts_sdk.py), idempotently: npm package `e2b`, newest 2.x
# at or above the floor below, from the npm registry into the ignored
# var/node/e2b-ts/ (nothing third-party is committed). Installs Node.js/npm via apt-get
# when missing. Does nothing when an installed version already satisfies the range.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${AENV_TS_SDK_DIR:-$ROOT/var/node/e2b-ts}"
RANGE="^2.51.0"   # the SDK generation that creates through POST /v2/sandboxes

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "==> installing system packages: nodejs npm"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi

# e2b 2.51 declares node ">=20.18.1 <21 || >=22" (Debian 12's and Ubuntu 24.04's own nodejs is 18).
if ! node -e '
  const [maj, min, pat] = process.versions.node.split(".").map(Number);
  process.exit((maj === 20 && (min > 18 || (min === 18 && pat >= 1))) || maj >= 22 ? 0 : 1);
'; then
  echo "setup_ts_sdk: the TypeScript E2B SDK needs Node.js >= 20.18.1 (or >= 22); found $(node --version)." >&2
  echo "  Install a newer nodejs (e.g. from NodeSource) and run this again." >&2
  exit 1
fi

installed_version() {
  local manifest="$PREFIX/node_modules/e2b/package.json"
  if [ -f "$manifest" ]; then node -p "require(process.argv[1]).version" "$manifest" 2>/dev/null || true; fi
}

satisfies() {  # $1 = version → 0 if it is a 2.x at or above the floor (2.51.0)
  node -e '
    const [maj, min] = process.argv[1].split(".").map(Number);
    process.exit(maj === 2 && min >= 51 ? 0 : 1);
  ' "$1"
}

current="$(installed_version)"
if [ -n "$current" ] && satisfies "$current"; then
  exit 0
fi
echo "==> installing e2b@$RANGE (TypeScript SDK) into $PREFIX"
mkdir -p "$PREFIX"
[ -f "$PREFIX/package.json" ] || echo '{"name": "aenv-e2b-ts", "private": true, "type": "module"}' > "$PREFIX/package.json"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "e2b@$RANGE" >/dev/null
current="$(installed_version)"
if [ -z "$current" ] || ! satisfies "$current"; then
  echo "setup_ts_sdk: e2b@$RANGE did not install (found '${current}')" >&2
  exit 1
fi
echo "==> e2b $current installed"
