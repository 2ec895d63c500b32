"""ASGI entry of the data plane, served by uvicorn (daphne buffers request bodies):

    uvicorn config.dataplane_asgi:application --host 0.0.0.0 --port 3001

uvicorn's default ``--ws auto`` serves WebSocket upgrades with the ``websockets``
package (a dependency; ``dataplane.websockets`` bridges them to the guest): do not pass
``--ws none``, which would refuse them. Sets Django up first so the proxy can read
sandboxes through the ORM."""
import logging
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
from django.conf import settings  # noqa: E402

from config.sqlite_wal import keep_thread_connections  # noqa: E402

# Every request reads its sandbox's route: each executor thread keeps its SQLite connection.
keep_thread_connections(settings)
django.setup()
# httpx logs every proxied request at INFO; uvicorn's access log already does.
logging.getLogger("httpx").setLevel(logging.WARNING)

from config.prometheus import InstrumentedDataPlane  # noqa: E402
from dataplane.proxy import EnvdProxy, UpstreamBroken  # noqa: E402
from dataplane.addressing import parse_target  # noqa: E402


class _QuietUpstreamBroken(logging.Filter):
    """A sandbox killed mid-stream is routine: the proxy logs one line for it and
    raises only so uvicorn drops the client connection; skip uvicorn's traceback."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBroken)


logging.getLogger("uvicorn.error").addFilter(_QuietUpstreamBroken())

# GET /metrics naming no sandbox is the data plane's Prometheus exposition (requests by
# route and status); everything else goes to the proxy.
application = InstrumentedDataPlane(EnvdProxy(), parse_target)
