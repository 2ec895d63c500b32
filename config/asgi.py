"""ASGI entry for daphne: HTTP goes to Django (API, dashboard, admin); WebSockets
go to Channels consumers. Request bodies reach Django whole whatever their framing
(config.request_body: chunked bodies, one size limit). The sandbox data plane is a separate app
(config.dataplane_asgi) served by uvicorn, because daphne buffers request bodies; AgentENV's
``/proxy`` (and header-routed paths the API has no route for) reach the same data plane
app here too, with that buffering (dataplane.mount)."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.conf import settings  # noqa: E402

from config.sqlite_wal import keep_thread_connections  # noqa: E402

# SQLite: each pooled request and transition thread keeps its connection (config.sqlite_wal).
keep_thread_connections(settings)

# Django's handler, each request's sync code on a pooled thread (config.request_threads).
from config.request_threads import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from config.daphne_idle import lengthen_idle_timeout  # noqa: E402

lengthen_idle_timeout(settings.AENV_API_IDLE_TIMEOUT)

from vmm import process_heap  # noqa: E402

# The API's C heap kept as the node worker's (vmm.process_heap says why): its request threads
# made an arena each, and in the seventh soak its RSS grew 16 % after the warm-up.
process_heap.limit_arenas(settings.AENV_MALLOC_ARENAS)
process_heap.Trimmer(settings.AENV_MALLOC_TRIM_INTERVAL).start()

from config.request_body import BoundedRequestBody  # noqa: E402

http_app = BoundedRequestBody(django_asgi_app)

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from dashboard.origin import SameOriginValidator  # noqa: E402
from dashboard.routing import websocket_urlpatterns  # noqa: E402

from dataplane.mount import ApiProxyMount  # noqa: E402
from dataplane.proxy import EnvdProxy  # noqa: E402

# Dashboard sockets: same-origin only (CSRF-safe), then the Django session and user.
application = ApiProxyMount(ProtocolTypeRouter({
    "http": http_app,
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
}), EnvdProxy())
