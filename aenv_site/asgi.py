"""ASGI entry for daphne: HTTP goes to Django (API, dashboard, admin); WebSockets
go to Channels consumers. The sandbox data plane is a separate app
(aenv_site.dataplane) served by uvicorn, because daphne buffers request bodies."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aenv_site.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

application = ProtocolTypeRouter({
    "http": django_asgi_app,
    "websocket": URLRouter([]),
})
