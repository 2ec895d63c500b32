"""The data plane on the API's port, as AgentENV serves it on its API's: ``/proxy[/…]``
(the prefix is not forwarded), and any path the API has no route for when the request
carries a sandbox routing header (``x-agentenv-sandbox-id`` or ``e2b-sandbox-id``: AgentENV's
``aenv`` sends envd's calls to the API's URL that way). Both go to the very data plane app
of the data plane's port (``dataplane.proxy.EnvdProxy``), marked so that they are answered
in AgentENV's dialect (``dataplane.answers``); real API routes win (``/health`` is the
API's: reach a guest's with ``/proxy/health``).

Limitations, from daphne (which serves this port): it reads a request's whole body
before the app sees any of it, so bodies here reach the guest only once complete —
unary calls, uploads and streamed *responses* work, but a client stream that stays open
(envd's ``StreamInput``: a PTY's keyboard) never starts. Such clients belong on the data
plane's port (uvicorn: bodies streamed both ways). WebSocket upgrades are bridged, but
daphne does not offer ASGI's ``websocket.http.response``: a refused upgrade is closed with
daphne's 403 rather than the refusal's own status.
"""
from django.urls import Resolver404, resolve

from dataplane.addressing import API_MOUNT, has_proxy_prefix, names_a_sandbox


def _api_has_route(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True


class ApiProxyMount:
    """ASGI: ``proxy`` (the data plane app) for AgentENV's data plane paths, ``app`` (the
    API, dashboard and their sockets) for everything else."""

    def __init__(self, app, proxy):
        self.app = app
        self.proxy = proxy

    def for_data_plane(self, scope) -> bool:
        if scope["type"] not in ("http", "websocket"):
            return False
        if has_proxy_prefix(scope.get("raw_path") or scope["path"].encode()):
            return True
        headers = {n.lower(): v for n, v in scope.get("headers", ())}
        return names_a_sandbox(headers) and not _api_has_route(scope["path"])

    async def __call__(self, scope, receive, send):
        if self.for_data_plane(scope):
            return await self.proxy({**scope, API_MOUNT: True}, receive, send)
        return await self.app(scope, receive, send)
