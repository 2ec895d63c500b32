#!/usr/bin/env bash
# A real aenv cluster on this machine: N node workers (default 3), each a "host" of its own
# (a network namespace with its own address, slot pool and AENV_HOME), against the machine's
# PostgreSQL and Redis, with the API, the data plane and the sweeper in the root namespace.
#   scripts/cluster.sh up [N]            start (idempotent: only what is missing)
#   scripts/cluster.sh status [--json]   processes, namespaces, GET /nodes
#   scripts/cluster.sh down [--purge]    stop (node workers pause their sandboxes to disk first)
# Ports: AENV_CLUSTER_API_PORT (3010), AENV_CLUSTER_DATAPLANE_PORT (3011). State: var/cluster/.
# The implementation is cluster/ (the tests drive the same code).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$(id -u)" -ne 0 ]; then
  echo "cluster.sh: needs root (it makes network namespaces, veths, routes and nftables rules); run it with sudo" >&2
  exit 1
fi
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "cluster.sh: no $ROOT/.venv; run scripts/setup.sh first" >&2
  exit 1
fi
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m cluster "$@"
