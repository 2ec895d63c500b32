#!/usr/bin/env bash
# The official code interpreter SDK for Node (npm @e2b/code-interpreter, pinned) for
# tests/code_interpreter/test_js_sdk.py, idempotently: from the npm registry into the ignored
# var/node/code-interpreter-ts/ (nothing third-party is committed). Needs Node.js >= 20.18
# (its `e2b` dependency's floor; scripts/setup_ts_sdk.sh checks and explains the same).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${AENV_TS_CODE_INTERPRETER_DIR:-$ROOT/var/node/code-interpreter-ts}"
VERSION="2.8.0"

manifest="$PREFIX/node_modules/@e2b/code-interpreter/package.json"
if [ -f "$manifest" ] && [ "$(node -p "require(process.argv[1]).version" "$manifest" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
echo "==> installing @e2b/code-interpreter@$VERSION into $PREFIX"
mkdir -p "$PREFIX"
[ -f "$PREFIX/package.json" ] || echo '{"name": "aenv-code-interpreter-ts", "private": true, "type": "module"}' > "$PREFIX/package.json"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "@e2b/code-interpreter@$VERSION" >/dev/null
