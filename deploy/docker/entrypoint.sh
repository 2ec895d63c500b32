#!/usr/bin/env bash
# The entrypoint of both images (run under tini, which reaps the daemonized QEMU processes
# that re-parent to PID 1 and passes SIGTERM on). The command names the process:
#   api | dataplane | sweeper   the control plane (Dockerfile.control-plane)
#   events                      the control plane's webhook delivery worker (Celery, queue control.events)
#   migrate                     the schema, then the default team, base template and an API key
#                               (printed once in this container's log)
#   node                        the node worker (Dockerfile.node, privileged): builds the guest
#                               images into AENV_IMAGES_DIR on its first start, then serves;
#                               AENV_NODE_JOIN_TOKEN_FILE: a file holding its join token (read
#                               when AENV_NODE_JOIN_TOKEN is unset; compose's join-tokens writes it);
#                               AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE: the pod's projected
#                               service-account token (Kubernetes), which it presents instead
#   join-tokens DIR ID...       a join token bound to each node id that has not joined yet, in
#                               DIR/<id>/token (0600); a joined (or revoked) node's is removed
#   health api|dataplane|sweeper|events|routes|node|worker   the container's health check (worker: the
#                               node worker's liveness, which never asks the database)
#   routes                      keeps this machine's routes to every node's slot pool
#                               (manage.py sync_pool_routes; Kubernetes: the aenv-routes DaemonSet)
#   node-pool DIR               this node's slot pool from a directory with one file per node
#                               name (Kubernetes: the aenv-node-pools ConfigMap), checked
#                               against every other node's; the node command does this itself
#                               when AENV_K8S_NODE_POOLS is set
# Anything else is run as given. Settings are environment variables (config/settings.py).
set -euo pipefail
# The checkout the image holds (/opt/aenv), found from this file.
cd "$(dirname "$(readlink -f "$0")")/../.."
PY=$PWD/.venv/bin/python
# The sweeper touches this after every sweep that reached the database (run_lifecycle
# --heartbeat); its health check wants it younger than SWEEPER_STALE seconds.
SWEEPER_HEARTBEAT=/tmp/aenv-sweeper.alive
SWEEPER_STALE=120
# The events worker touches this while the broker answers (run_events_worker --heartbeat, every 15 s).
EVENTS_HEARTBEAT=/tmp/aenv-events.alive
EVENTS_STALE=120
# The same for the route syncer (sync_pool_routes --heartbeat, a pass every 30 s).
ROUTES_HEARTBEAT=/tmp/aenv-routes.alive
ROUTES_STALE=150

die() { echo "entrypoint: $*" >&2; exit 1; }

# FILE STALE WHAT: fails unless FILE exists and was touched less than STALE seconds ago.
fresh() {
  [ -f "$1" ] || die "health: $3 has not happened yet ($1)"
  local age=$(( $(date +%s) - $(stat -c %Y "$1") ))
  [ "$age" -lt "$2" ] || die "health: $3 was ${age} s ago"
}

health() {
  case "${1:-}" in
    api) exec "$PY" -c 'import sys, urllib.request
sys.exit(0 if urllib.request.urlopen("http://127.0.0.1:3000/health", timeout=5).status == 204 else 1)' ;;
    dataplane) exec "$PY" -c 'import socket; socket.create_connection(("127.0.0.1", 3001), timeout=5).close()' ;;
    sweeper) fresh "$SWEEPER_HEARTBEAT" "$SWEEPER_STALE" "the sweeper's last sweep" ;;
    events) fresh "$EVENTS_HEARTBEAT" "$EVENTS_STALE" "the events worker's last broker check" ;;
    routes) fresh "$ROUTES_HEARTBEAT" "$ROUTES_STALE" "the route syncer's last pass" ;;
    # The node worker still serves its metrics port (AENV_NODE_METRICS_PORT: on 127.0.0.1
    # without AENV_METRICS_TOKEN, on AENV_NODE_ADDRESS with one). Never the database or the
    # broker: a liveness restart ends every VM of the node. Metrics off (0): nothing to ask.
    worker) exec "$PY" -c 'import os, socket, sys
port = int(os.environ.get("AENV_NODE_METRICS_PORT") or 9464)
if not port:
    sys.exit(0)
for host in ("127.0.0.1", os.environ.get("AENV_NODE_ADDRESS") or "127.0.0.1"):
    try:
        socket.create_connection((host, port), timeout=5).close()
        sys.exit(0)
    except OSError:
        pass
sys.exit(f"health: the node worker serves nothing on its metrics port {port}")' ;;
    node) exec "$PY" manage.py shell -c 'import sys
from django.conf import settings
from nodes.models import Node
node = Node.objects.filter(pk=settings.AENV_NODE_ID).first()
sys.exit(0 if node is not None and node.is_alive() else 1)' ;;
    *) die "health: api, dataplane, sweeper, events, routes, node or worker" ;;
  esac
}

# Prints the pool of node AENV_NODE_ID from DIR (a file per node name holding its CIDR;
# nodes/pools.py reads it: ConfigMap volumes add ..data entries, which are skipped). Refuses a
# node with no pool, a value that is not an IPv4 network, and a pool that overlaps another
# node's: two nodes with one pool would give two guests the same address.
# DIR ID...: one token per node id that never joined (its row has no credential; a revoked node
# keeps its credential, so it stays out until an operator issues it a token), replacing (revoking)
# the unspent one an earlier run made; a joined node's token file goes. Unused tokens expire
# (AENV_NODE_JOIN_TOKEN_TTL).
join_tokens() {
  local dir=${1:?join-tokens: a directory}; shift
  [ "$#" -gt 0 ] || die "join-tokens: the node ids"
  JOIN_DIR=$dir JOIN_NODE_IDS="$*" "$PY" manage.py shell --no-imports -c 'import os
from pathlib import Path
from nodes import join
from nodes.models import Node, NodeJoinToken
from nodes.signing import write_atomically
MAKER = "compose join-tokens"
for node_id in os.environ["JOIN_NODE_IDS"].split():
    path = Path(os.environ["JOIN_DIR"], node_id, "token")
    path.parent.mkdir(parents=True, exist_ok=True)
    if Node.objects.filter(pk=node_id).exclude(credential_hash="").exists():
        path.unlink(missing_ok=True)
        print(f"join-tokens: {node_id} has joined: no token", flush=True)
        continue
    for old in NodeJoinToken.objects.filter(node_id=node_id, created_by=MAKER, used_at=None, revoked_at=None):
        join.revoke_token(old.prefix)
    token, raw = join.create_token(node_id=node_id, created_by=MAKER)
    write_atomically(path, (raw + "\n").encode(), 0o600)
    print(f"join-tokens: {node_id}: token {token.prefix}... until {token.expires_at:%Y-%m-%d %H:%M} UTC", flush=True)'
}

node_pool() {
  local dir=${1:?node-pool: a directory}
  [ -n "${AENV_NODE_ID:-}" ] || die "node-pool: AENV_NODE_ID is not set"
  "$PY" -m nodes.pools "$dir" "$AENV_NODE_ID"
}

case "${1:-}" in
  api) exec .venv/bin/daphne --bind 0.0.0.0 --port 3000 config.asgi:application ;;
  # uvicorn serving config.dataplane_asgi:application, with its hot path (HAProxy) beside it
  dataplane) exec "$PY" -m dataplane.serve --host 0.0.0.0 --port 3001 -- --no-access-log --timeout-keep-alive 300 ;;
  sweeper) exec "$PY" manage.py run_lifecycle --heartbeat "$SWEEPER_HEARTBEAT" ;;
  events) exec "$PY" manage.py run_events_worker --heartbeat "$EVENTS_HEARTBEAT" ;;  # webhook deliveries
  migrate) "$PY" manage.py migrate --noinput; exec "$PY" manage.py bootstrap ;;
  node)
    command -v qemu-system-x86_64 >/dev/null || die "the node worker runs from the node image (Dockerfile.node)"
    # Network namespaces and nftables need CAP_SYS_ADMIN and CAP_NET_ADMIN: a privileged container.
    unshare --net true 2>/dev/null || die "the node container must run privileged (network namespaces, nftables, /dev/kvm)"
    if [ -n "${AENV_K8S_NODE_POOLS:-}" ]; then
      AENV_NET_POOL=$(node_pool "$AENV_K8S_NODE_POOLS") || die "no slot pool for this node"
      export AENV_NET_POOL
      echo "entrypoint: node $AENV_NODE_ID: slot pool $AENV_NET_POOL" >&2
    fi
    if [ -z "${AENV_NODE_JOIN_TOKEN:-}" ] && [ -s "${AENV_NODE_JOIN_TOKEN_FILE:-}" ]; then
      AENV_NODE_JOIN_TOKEN=$(cat "$AENV_NODE_JOIN_TOKEN_FILE")
      export AENV_NODE_JOIN_TOKEN
    fi
    # Kubernetes: no join token, the kubelet's projected token (audience aenv-join, rotated);
    # agent.join reads the file itself at each join, so only its presence is checked here.
    if [ -z "${AENV_NODE_JOIN_TOKEN:-}" ] && [ -n "${AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE:-}" ]; then
      [ -s "$AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE" ] || die "no Kubernetes token at $AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE (AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE): mount the projected service-account token there"
      echo "entrypoint: node ${AENV_NODE_ID:-} joins with its pod's Kubernetes token" >&2
    fi
    [ -e /dev/kvm ] || echo "entrypoint: no /dev/kvm: guests run under QEMU TCG (software emulation)" >&2
    # A seed (AENV_IMAGES_SEED: another machine's images directory, mounted read-only, e.g. the
    # test host's in deploy/compose.ci.yaml) fills the images directory first (what is missing):
    # its stages too, since the tools drive's recipe names the Python and packages it is frozen
    # from, so a node image rebuilds that stage but takes debootstrap's and the system's as built.
    if [ -n "${AENV_IMAGES_SEED:-}" ]; then
      images="${AENV_IMAGES_DIR:-$AENV_HOME/images}"
      mkdir -p "$images"
      echo "entrypoint: seeding $images from $AENV_IMAGES_SEED" >&2
      cp -a -n "$AENV_IMAGES_SEED/." "$images/"
    fi
    # debootstrap needs the privileges the image build does not have, so the images are made
    # here, once per volume (cached; rebuilt only when a recipe changes).
    # shellcheck source=SCRIPTDIR/../../scripts/setup.sh
    source scripts/setup.sh
    setup_guest_images
    exec "$PY" manage.py run_node ;;
  health) shift; health "$@" ;;
  node-pool) shift; node_pool "$@" ;;
  join-tokens) shift; join_tokens "$@" ;;
  routes) exec "$PY" manage.py sync_pool_routes --pools "${AENV_K8S_NODE_POOLS:?routes: set AENV_K8S_NODE_POOLS to the pools folder}" \
            --heartbeat "$ROUTES_HEARTBEAT" ;;
  "") die "a command: api, dataplane, sweeper, events, migrate, node, node-pool, join-tokens, routes or health" ;;
  *) exec "$@" ;;
esac
