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

from sandboxes.proxy import EnvdProxy  # noqa: E402

application = EnvdProxy()
