#!/usr/bin/env bash
# The test command (README, .ci/run). Installs what the tests need (scripts/setup.sh
# plus PostgreSQL and a second E2B SDK generation), then runs:
#   1. the tests without VMs on SQLite (unit, envd on the host with the E2B SDK, the code
#      interpreter's server with its SDKs, the CLI, deploy files), in parallel workers;
#   2. the tests with real QEMU VMs on SQLite: drivers, the end-to-end server + node worker
#      + VMs driven by the E2B SDKs, networks, the cluster, the browser;
#   3. the unit tests that use the database again, on PostgreSQL.
# Extra arguments go to both SQLite runs (e.g. a file or `-k name`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export AENV_HOME="${AENV_HOME:-$ROOT/var}"
export AENV_IMAGES_DIR="${AENV_IMAGES_DIR:-$AENV_HOME/images}"

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/setup_ts_sdk.sh"  # the TypeScript E2B SDK for tests/ts/ (tests/integration/test_ts_sdk.py)
"$ROOT/scripts/setup_ts_code_interpreter.sh"  # npm @e2b/code-interpreter (tests/code_interpreter/test_js_sdk.py)

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

# Long repeats of what the default run covers (200 pause cycles, a 400 MiB image, twelve cold
# boots at once) are marked slow: AENV_TEST_SLOW=1 runs them too.
SLOW="not slow"
[ "${AENV_TEST_SLOW:-0}" = 1 ] && SLOW="slow or not slow"

# Tests without VMs wait more than they compute (servers, subprocesses, timeouts): three
# pytest-xdist workers; the VM tests share two emulated cores, so they run one at a time.
status=0
run() {  # pytest; "no tests collected" (5: the arguments selected none of this part) is fine
  local rc=0
  "$@" || rc=$?
  [ $rc = 5 ] && rc=0
  [ $rc = 0 ] || status=$rc
}
echo "==> tests without VMs on SQLite (unit, envd, code interpreter, CLI, deploy files), 3 workers"
run .venv/bin/pytest -p no:cacheprovider -q -rs -n 3 --dist loadgroup --durations=15 -m "not vm and ($SLOW)" "$@"
echo "==> tests with real VMs on SQLite (drivers, the stack end to end with the SDKs, networks, cluster, browser)"
run .venv/bin/pytest -p no:cacheprovider -q -rs --durations=40 -m "vm and ($SLOW)" "$@"
echo "==> unit tests that use the database, on PostgreSQL, 3 workers"
run env DATABASE_URL="$PG_URL" .venv/bin/pytest -p no:cacheprovider -q -rs -n 3 --dist loadgroup --database-tests-only tests/unit
exit $status
