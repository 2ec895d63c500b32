#!/usr/bin/env bash
# The entrypoint of both images (run under tini, which reaps the daemonized QEMU processes
# that re-parent to PID 1 and passes SIGTERM on). The command names the process:
#   api | dataplane | sweeper   the control plane (Dockerfile.control-plane)
#   migrate                     the schema, then the default team, base template and an API key
#                               (printed once in this container's log)
#   node                        the node worker (Dockerfile.node, privileged): builds the guest
#                               images into AENV_IMAGES_DIR on its first start, then serves
#   health api|dataplane|node   the container's health check
# Anything else is run as given. Settings are environment variables (config/settings.py).
set -euo pipefail
cd /opt/aenv
PY=/opt/aenv/.venv/bin/python

die() { echo "entrypoint: $*" >&2; exit 1; }

health() {
  case "${1:-}" in
    api) exec "$PY" -c 'import sys, urllib.request
sys.exit(0 if urllib.request.urlopen("http://127.0.0.1:3000/health", timeout=5).status == 204 else 1)' ;;
    dataplane) exec "$PY" -c 'import socket; socket.create_connection(("127.0.0.1", 3001), timeout=5).close()' ;;
    node) exec "$PY" manage.py shell -c 'import sys
from django.conf import settings
from nodes.models import Node
node = Node.objects.filter(pk=settings.AENV_NODE_ID).first()
sys.exit(0 if node is not None and node.is_alive() else 1)' ;;
    *) die "health: api, dataplane or node" ;;
  esac
}

case "${1:-}" in
  api) exec .venv/bin/daphne --bind 0.0.0.0 --port 3000 config.asgi:application ;;
  dataplane) exec .venv/bin/uvicorn config.dataplane_asgi:application --host 0.0.0.0 --port 3001 \
               --no-access-log --timeout-keep-alive 300 ;;
  sweeper) exec "$PY" manage.py run_lifecycle ;;
  migrate) "$PY" manage.py migrate --noinput; exec "$PY" manage.py bootstrap ;;
  node)
    command -v qemu-system-x86_64 >/dev/null || die "the node worker runs from the node image (Dockerfile.node)"
    # Network namespaces and nftables need CAP_SYS_ADMIN and CAP_NET_ADMIN: a privileged container.
    unshare --net true 2>/dev/null || die "the node container must run privileged (network namespaces, nftables, /dev/kvm)"
    [ -e /dev/kvm ] || echo "entrypoint: no /dev/kvm: guests run under QEMU TCG (software emulation)" >&2
    # debootstrap needs the privileges the image build does not have, so the images are made
    # here, once per volume (cached; rebuilt only when a recipe changes).
    # shellcheck source=SCRIPTDIR/../../scripts/setup.sh
    source scripts/setup.sh
    setup_guest_images
    exec "$PY" manage.py run_node ;;
  health) shift; health "$@" ;;
  "") die "a command: api, dataplane, sweeper, migrate, node or health" ;;
  *) exec "$@" ;;
esac
