#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then starts the control plane (daphne),
# the sandbox data plane (uvicorn), a node worker, the lifecycle sweeper (TTL and
# paused-sandbox retention) and the webhook delivery worker in the background, and prints
# the URLs and the API key for the E2B SDK. Stop everything with scripts/down.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export AENV_HOME="${AENV_HOME:-$ROOT/var}"
API_PORT="${AENV_API_PORT:-3000}"
SANDBOX_PORT="${AENV_SANDBOX_PORT:-3001}"
BIND="${AENV_BIND:-127.0.0.1}"
HOST_FOR_URLS="${AENV_PUBLIC_HOST:-127.0.0.1}"

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/down.sh" --quiet || true

RUN="$AENV_HOME/run"; LOGS="$AENV_HOME/logs"
mkdir -p "$RUN" "$LOGS"
export AENV_API_PUBLIC_URL="http://$HOST_FOR_URLS:$API_PORT" AENV_SANDBOX_PUBLIC_URL="http://$HOST_FOR_URLS:$SANDBOX_PORT"

start() {  # name, command...
  local name=$1; shift
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}
start node .venv/bin/python manage.py run_node
start lifecycle .venv/bin/python manage.py run_lifecycle
start events .venv/bin/python manage.py run_events_worker  # webhook deliveries
start api .venv/bin/daphne -b "$BIND" -p "$API_PORT" config.asgi:application
# uvicorn serving config.dataplane_asgi:application, with its hot path (HAProxy) when installed
start dataplane .venv/bin/python -m dataplane.serve --host "$BIND" --port "$SANDBOX_PORT" \
  -- --no-access-log --timeout-keep-alive 300

wait_http() {  # url, what
  for _ in $(seq 300); do
    if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "!! $2 did not come up; see $LOGS" >&2; exit 1
}
wait_http "http://127.0.0.1:$API_PORT/health" "API server"
for _ in $(seq 300); do
  .venv/bin/python manage.py node_status --quiet 2>/dev/null && break
  sleep 0.2
done
.venv/bin/python manage.py node_status --quiet || { echo "!! node worker did not register; see $LOGS/node.log" >&2; exit 1; }

# The system templates (code-interpreter-v1): built by the node when their recipe changed (minutes
# the first time under TCG), otherwise nothing; the build goes on in the background.
.venv/bin/python manage.py ensure_system_templates --no-wait || echo "!! system templates: see above" >&2

KEY="$(cat "$AENV_HOME/api_key")"
cat <<MSG

aenv is running (logs: $LOGS, stop: scripts/down.sh)
  API (E2B_API_URL):          http://$HOST_FOR_URLS:$API_PORT
  Sandboxes (E2B_SANDBOX_URL): http://$HOST_FOR_URLS:$SANDBOX_PORT
  API key:                    $KEY

export E2B_API_URL=http://$HOST_FOR_URLS:$API_PORT E2B_SANDBOX_URL=http://$HOST_FOR_URLS:$SANDBOX_PORT E2B_API_KEY=$KEY
MSG
