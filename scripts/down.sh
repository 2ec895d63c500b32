#!/usr/bin/env bash
# Stops what scripts/up.sh started. Sandboxes' VMs are separate processes and keep
# running (the node worker reattaches to them); kill them through the API.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="${AENV_HOME:-$ROOT/var}/run"
quiet=${1:-}
for name in api dataplane lifecycle node; do
  pidfile="$RUN/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    [ "$quiet" = "--quiet" ] || echo "stopped $name"
  fi
  rm -f "$pidfile"
done
