"""ASGI entry of the data plane, served by uvicorn (daphne buffers request bodies):

    uvicorn aenv_site.dataplane:application --host 0.0.0.0 --port 3001

Sets Django up first so the proxy can read sandboxes through the ORM."""
import logging
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aenv_site.settings")
django.setup()
# httpx logs every proxied request at INFO; uvicorn's access log already does.
logging.getLogger("httpx").setLevel(logging.WARNING)

from sandboxes.proxy import EnvdProxy, UpstreamBroken  # noqa: E402


class _QuietUpstreamBroken(logging.Filter):
    """A sandbox killed mid-stream is routine: the proxy logs one line for it and
    raises only so uvicorn drops the client connection; skip uvicorn's traceback."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBroken)


logging.getLogger("uvicorn.error").addFilter(_QuietUpstreamBroken())

application = EnvdProxy()
