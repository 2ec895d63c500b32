#!/usr/bin/env bash
# The test command (README, .ci/run). Installs what the tests need (scripts/setup.sh
# plus PostgreSQL and a second E2B SDK generation), then runs:
#   1. the whole suite on SQLite: unit, envd-on-host with the E2B SDK, real QEMU VMs,
#      and the end-to-end server + node worker + VMs driven by the E2B SDK;
#   2. the database-facing unit tests again on PostgreSQL.
# Extra arguments go to the first pytest run (e.g. `-m "not slow"`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export AENV_HOME="${AENV_HOME:-$ROOT/var}"
export AENV_IMAGES_DIR="${AENV_IMAGES_DIR:-$AENV_HOME/images}"

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/setup_ts_sdk.sh"  # the TypeScript E2B SDK for tests/ts/ (tests/integration/test_ts_sdk.py)

# PostgreSQL for the second unit-test run.
PG_URL="${AENV_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/aenv}"
if ! (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    echo "==> installing postgresql"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
  fi
  ver=$(ls /etc/postgresql | head -1)
  $SUDO sed -i -E 's/^(host|local)(\s+all\s+all\s+.*)(peer|scram-sha-256|md5)$/\1\2trust/' "/etc/postgresql/$ver/main/pg_hba.conf" || true
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null && break; sleep 0.2; done
fi

# The pre-2.51 SDK generation (v1 create/connect paths, client-side key format check).
OLD_SDK_VENV="$AENV_HOME/venvs/e2b-2.45.1"
if [ ! -x "$OLD_SDK_VENV/bin/python" ] || ! "$OLD_SDK_VENV/bin/python" -c 'import e2b' 2>/dev/null; then
  echo "==> installing e2b==2.45.1 into $OLD_SDK_VENV"
  python3 -m venv "$OLD_SDK_VENV"
  "$OLD_SDK_VENV/bin/pip" install -q 'e2b==2.45.1'
fi
export AENV_OLD_SDK_PYTHON="$OLD_SDK_VENV/bin/python"

status=0
echo "==> tests on SQLite (unit, envd, VMs, end to end)"
.venv/bin/pytest -p no:cacheprovider -q -rs "$@" || status=$?
echo "==> unit tests on PostgreSQL"
DATABASE_URL="$PG_URL" .venv/bin/pytest -p no:cacheprovider -q -rs tests/unit || status=$?
exit $status
