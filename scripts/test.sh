#!/usr/bin/env bash
# The test command (README, .ci/run). Installs what the tests need (scripts/setup.sh
# plus PostgreSQL and a second E2B SDK generation), then runs:
#   1. the tests with real QEMU VMs on SQLite: drivers, the end-to-end server + node worker
#      + VMs driven by the E2B SDKs, networks, the cluster, the browser;
#   2. beside them, niced: the tests without VMs on SQLite (unit, envd on the host with the E2B
#      SDK, the code interpreter's server with its SDKs, the CLI, deploy files), in parallel
#      workers, and then the unit tests that use the database again, on PostgreSQL;
# before them, the docs site (mkdocs build --strict: a broken link fails the run). The compose
# tier's Docker images and the code interpreter template's steps are built in the background
# meanwhile (start_compose_images, start_template_prebuild below).
# Extra arguments go to both SQLite runs (e.g. a file or `-k name`) and narrow them: a narrowed
# run may select no tests of a pass (pytest's exit status 5). Without arguments every pass must
# run tests, and every tier of tests/tiers.py (VMs, network, PostgreSQL, browser, TS SDK, ...) must
# run here: a test of one that skipped fails its pass, with a line naming the tier and the reason
# (--require-tiers). On a machine that cannot run a tier, AENV_TEST_ALLOW_SKIP_TIERS=vm,browser
# lets the named tiers skip; CI does not set it.
# Sourced, this file only defines its functions (tests/unit/test_test_sh.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

install_test_dependencies() {
  "$ROOT/scripts/setup.sh"
  start_compose_images  # Docker's engine and the venv are there now
  start_template_prebuild  # the base image and the code interpreter's venv are there now
  "$ROOT/scripts/setup_ts_sdk.sh"  # the TypeScript E2B SDK for tests/ts/ (tests/integration/test_ts_sdk.py)
  "$ROOT/scripts/setup_ts_code_interpreter.sh"  # npm @e2b/code-interpreter (tests/code_interpreter/test_js_sdk.py)

  # PostgreSQL for the second unit-test run.
  if ! (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
    local sudo="" ver
    [ "$(id -u)" != 0 ] && sudo="sudo"
    if ! compgen -G "/etc/postgresql/*/main" >/dev/null; then
      echo "==> installing postgresql"
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >/dev/null
    fi
    ver=$(find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | head -1)
    $sudo sed -i -E 's/^(host|local)(\s+all\s+all\s+.*)(peer|scram-sha-256|md5)$/\1\2trust/' "/etc/postgresql/$ver/main/pg_hba.conf" || true
    $sudo pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null && break; sleep 0.2; done
  fi

  # The pre-2.51 SDK generation (v1 create/connect paths, client-side key format check).
  local old_sdk_venv="$AENV_HOME/venvs/e2b-2.45.1"
  if [ ! -x "$old_sdk_venv/bin/python" ] || ! "$old_sdk_venv/bin/python" -c 'import e2b' 2>/dev/null; then
    echo "==> installing e2b==2.45.1 into $old_sdk_venv"
    python3 -m venv "$old_sdk_venv"
    "$old_sdk_venv/bin/pip" install -q 'e2b==2.45.1'
  fi
  export AENV_OLD_SDK_PYTHON="$old_sdk_venv/bin/python"
}

# The compose tier's images (tests/compose/, harness/compose_stack.py) are built in the background
# from setup.sh's end until the VM pass, beside the other installs, the docs and the pass without
# VMs (an un-narrowed run only). They are keyed by a hash of their inputs: a machine that built
# them for this tree builds nothing; a cold build (debootstrap, apt, pip, npm in containers) is
# about five minutes that were the VM pass's. The VM pass waits for it (not niced). The compose
# test takes the same lock, so a build still running then is waited for, never repeated.
COMPOSE_PREBUILD=0
COMPOSE_IMAGES_PID=""
start_compose_images() {
  [ "$COMPOSE_PREBUILD" = 1 ] && command -v docker >/dev/null || return 0
  mkdir -p "$AENV_HOME/docker"
  echo "==> the compose tier's images, in the background (log: $AENV_HOME/docker/compose-images.log)"
  "$ROOT/.venv/bin/python" -m harness.compose_stack build >"$AENV_HOME/docker/compose-images.log" 2>&1 &
  COMPOSE_IMAGES_PID=$!
}
wait_compose_images() {
  [ -n "$COMPOSE_IMAGES_PID" ] || return 0
  if wait "$COMPOSE_IMAGES_PID"; then
    echo "==> $(tail -n 1 "$AENV_HOME/docker/compose-images.log")"
  else
    echo "==> the compose images' build failed (the compose test tries again and says why):" \
      "$AENV_HOME/docker/compose-images.log" >&2
  fi
  COMPOSE_IMAGES_PID=""
}

# The system templates' steps (code-interpreter-v1: the venv's COPY, ~49 s of the VM pass under
# TCG, and the server's) built into the node layer cache by a throwaway stack
# (harness/template_prebuild.py) in the background of the rest of the installs and the docs (an
# un-narrowed run only, on a machine that runs VMs); the VM pass's build of the recipe then only
# finalizes. Not niced: the VM pass waits for it (it never shares the cores with the VM tests),
# while the pass without VMs beside it is. If it failed, that build does every step, as before.
TEMPLATE_PREBUILD=0
TEMPLATE_PREBUILD_PID=""
start_template_prebuild() {
  [ "$TEMPLATE_PREBUILD" = 1 ] && [ "$(id -u)" = 0 ] && command -v qemu-system-x86_64 >/dev/null || return 0
  echo "==> the system templates' steps into the layer cache, in the background (log: $AENV_HOME/template-prebuild.log)"
  "$ROOT/.venv/bin/python" -m harness.template_prebuild >"$AENV_HOME/template-prebuild.log" 2>&1 &
  TEMPLATE_PREBUILD_PID=$!
}
wait_template_prebuild() {
  [ -n "$TEMPLATE_PREBUILD_PID" ] || return 0
  wait "$TEMPLATE_PREBUILD_PID" || true  # the log's last line says why; the VM pass builds every step then
  echo "==> $(tail -n 1 "$AENV_HOME/template-prebuild.log")"
  TEMPLATE_PREBUILD_PID=""
}

status=0
failed=()
times=()  # "what: N s" of each step, printed at the end: where a CI run's time went
timed() {  # what, command...: the command, its wall time kept in times
  local what=$1 t0=$SECONDS
  shift
  "$@"
  local rc=$?
  times+=("$what: $((SECONDS - t0)) s")
  return "$rc"
}
run_pass() {  # name, narrowed (1: the caller's arguments narrowed this pass), command...
  # "no tests collected" (5) is fine only when the caller's arguments selected none of this pass.
  local name=$1 narrowed=$2 rc=0
  shift 2
  timed "$name" "$@" || rc=$?
  if [ "$rc" = 5 ] && [ "$narrowed" = 1 ]; then rc=0; fi
  if [ "$rc" != 0 ]; then
    [ "$rc" = 5 ] && echo "==> $name: no tests collected (exit status 5), and this pass must run tests" >&2
    status=$rc
    failed+=("$name (exit status $rc)")
  fi
  return 0
}

logged() {  # log, command...: the command's output shown and kept in log; its own exit status
  local log=$1
  shift
  PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$log"  # unbuffered: into a pipe Python would hold it back
  return "${PIPESTATUS[0]}"
}

failed_tests() {  # logs...: pytest's short summary lines of what failed (-rfE), for the run's last lines
  grep -hE '^(FAILED|ERROR) ' "$@" 2>/dev/null | head -n 60
}

main() {
  cd "$ROOT"
  export AENV_HOME="${AENV_HOME:-$ROOT/var}"
  export AENV_IMAGES_DIR="${AENV_IMAGES_DIR:-$AENV_HOME/images}"
  [ $# -gt 0 ] || { COMPOSE_PREBUILD=1; TEMPLATE_PREBUILD=1; }
  local started=$SECONDS
  timed "test dependencies" install_test_dependencies

  # Long repeats of what the default run covers (200 pause cycles, a 400 MiB image, twelve cold
  # boots at once) are marked slow: AENV_TEST_SLOW=1 runs them too.
  local slow="not slow" narrowed=0 strict=(--require-tiers)
  [ "${AENV_TEST_SLOW:-0}" = 1 ] && slow="slow or not slow"
  # Arguments narrow the SQLite passes: they may then select nothing and skip tiers.
  if [ $# -gt 0 ]; then narrowed=1; strict=(); fi

  # The docs site first (seconds): mkdocs --strict fails on a broken link, a missing page or
  # anchor. A narrowed run is about its tests; tests/unit/test_docs_site.py builds it too.
  if [ "$narrowed" = 0 ]; then
    echo "==> the docs site (mkdocs build --strict into var/site)"
    run_pass "docs site" 0 env NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir var/site
  fi

  # Tests without VMs wait more than they compute (servers, subprocesses, timeouts), and the VM
  # pass leaves the cores idle between guests' bursts: the pass without VMs and then the
  # PostgreSQL pass run beside the VM pass, niced, two pytest-xdist workers each, their output
  # into a log shown when the VM pass ends (~15 min of CI less than one after another). The VM
  # tests run one at a time: they share two emulated cores.
  local beside_log="$AENV_HOME/test-logs/beside-the-vm-pass.log" beside_failed="$AENV_HOME/test-logs/beside-failed"
  local vm_log="$AENV_HOME/test-logs/vm-pass.log" beside_times="$AENV_HOME/test-logs/beside-times"
  mkdir -p "$AENV_HOME/test-logs"
  rm -f "$beside_log" "$beside_failed" "$vm_log" "$beside_times"
  echo "==> tests without VMs on SQLite (unit, envd, code interpreter, CLI, deploy files), then the unit tests" \
    "that use the database on PostgreSQL: beside the VM pass (log: $beside_log)"
  (
    # its own steps only (it was handed the ones before it); it hands them back in $beside_times
    # shellcheck disable=SC2030
    times=()
    run_pass "tests without VMs" "$narrowed" nice -n 10 .venv/bin/pytest -p no:cacheprovider -q -rfEs -n 2 \
      --dist loadgroup --durations=15 "${strict[@]}" -m "not vm and ($slow)" "$@"
    # Never narrowed: all of tests/unit's database tests, so it always runs tests and its tiers.
    # Pools of 16 (not 48) per process: the VM pass's cluster shares the server's 100 connections.
    run_pass "unit tests on PostgreSQL" 0 env DATABASE_URL="${AENV_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/aenv}" \
      AENV_DB_POOL_SIZE=16 \
      nice -n 10 .venv/bin/pytest -p no:cacheprovider -q -rfEs -n 2 --dist loadgroup --require-tiers \
      --database-tests-only tests/unit
    if [ ${#failed[@]} -gt 0 ]; then printf '%s\n' "${failed[@]}" >"$beside_failed"; fi
    printf '%s\n' "${times[@]}" >"$beside_times"
    exit "$status"
  ) >"$beside_log" 2>&1 &
  local beside=$! beside_status=0
  timed "waiting for the compose images" wait_compose_images  # before the VMs: they share the two cores
  timed "waiting for the template prebuild" wait_template_prebuild
  echo "==> tests with real VMs on SQLite (drivers, the stack end to end with the SDKs, networks, cluster, browser)"
  run_pass "tests with VMs" "$narrowed" logged "$vm_log" .venv/bin/pytest -p no:cacheprovider -q -rfEs --durations=40 \
    "${strict[@]}" \
    -m "vm and ($slow)" "$@"
  wait "$beside" || beside_status=$?
  echo "==> the passes beside the VM pass ($beside_log):"
  cat "$beside_log"
  if [ "$beside_status" != 0 ]; then
    status=$beside_status
    if [ -s "$beside_failed" ]; then mapfile -t -O "${#failed[@]}" failed <"$beside_failed"
    else failed+=("the passes beside the VM pass (exit status $beside_status)"); fi
  fi

  # shellcheck disable=SC2031  # the main shell's own times (the subshell's came back in $beside_times)
  if [ -s "$beside_times" ]; then mapfile -t -O "${#times[@]}" times < <(sed 's/^/beside the VM pass: /' "$beside_times"); fi
  times+=("the whole run: $((SECONDS - started)) s")
  printf '==> time, %s\n' "${times[@]}"
  if [ ${#failed[@]} -gt 0 ]; then
    printf '==> failed: %s\n' "${failed[@]}" >&2
    # the failed tests by name last: a CI page that shows only the run's head and tail names them
    failed_tests "$vm_log" "$beside_log" | sed 's/^/==>   /' >&2
  fi
  return "$status"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
