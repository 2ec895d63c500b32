#!/usr/bin/env bash
# Stops what scripts/up.sh started. The node worker, told to stop, first pauses its running
# sandboxes to disk with their memory (AENV_NODE_STOP_PAUSE=0 in its environment keeps them
# running instead: VMs are separate processes and the next node worker reattaches them);
# a connect resumes a paused one after the next scripts/up.sh.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="${AENV_HOME:-$ROOT/var}/run"
quiet=${1:-}
for name in api dataplane lifecycle events node; do
  pidfile="$RUN/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    wait_s=5
    [ "$name" = node ] && wait_s=$(( ${AENV_NODE_STOP_TIMEOUT:-300} + 30 ))  # it pauses its sandboxes first
    [ "$quiet" = "--quiet" ] || [ "$name" != node ] || echo "stopping node (pausing its running sandboxes to disk)"
    for _ in $(seq $(( wait_s * 10 ))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    [ "$quiet" = "--quiet" ] || echo "stopped $name"
  fi
  rm -f "$pidfile"
done
