"""Prometheus ``/metrics`` of the control-plane processes (``prometheus-client``):
requests counted and timed by route and status on the API (a Django middleware) and on
the data plane (an ASGI wrapper), and the exposition of both.

With ``AENV_METRICS_TOKEN`` set (read per request) both answer ``/metrics`` only to
``Authorization: Bearer <token>`` (401 otherwise, compared in constant time); without it
they are open like AgentENV's. Either way the API's holds cluster-wide aggregates only
(counts by state and outcome, per-node figures, ``config.cluster_metrics``), never a team,
a sandbox id or a path; routes are the URL patterns (``sandboxes/<str:sandbox_id>``), so
ids never become label values.
"""
from __future__ import annotations

import time

from django.conf import settings
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from nodes.metrics_auth import CHALLENGE, UNAUTHORIZED, bearer_matches
from envd import ENVD_PORT

from api.middleware_base import AroundMiddleware

# API calls range from ~1 ms (a list) to minutes (a create waiting for a cold boot).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

API_REQUESTS = Counter("aenv_api_http_requests", "API requests answered", ["route", "method", "status"])
API_LATENCY = Histogram("aenv_api_http_request_duration_seconds", "API request duration until the answer",
                        ["route", "method"], buckets=LATENCY_BUCKETS)
DATAPLANE_REQUESTS = Counter("aenv_dataplane_http_requests", "Data plane requests answered",
                             ["route", "method", "status"])
DATAPLANE_LATENCY = Histogram("aenv_dataplane_http_request_duration_seconds",
                              "Data plane request duration until the response starts (streams last longer)",
                              ["route", "method"], buckets=LATENCY_BUCKETS)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


def _method(method: str) -> str:
    return method if method in METHODS else "other"


def exposition(registry=REGISTRY) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST


def authorized(authorization: str | None) -> bool:
    """No ``AENV_METRICS_TOKEN``: anyone; else ``Authorization: Bearer <token>`` only."""
    token = settings.AENV_METRICS_TOKEN
    return not token or bearer_matches(authorization, token)


def metrics_view(request):
    """``GET /metrics`` of the API (behind ``AENV_METRICS_TOKEN`` when set): the process's
    metrics, then the cluster's read from the database (``config.cluster_metrics``)."""
    from config.cluster_metrics import CLUSTER  # noqa: PLC0415 - reads the database: only the API imports it

    if not authorized(request.headers.get("Authorization")):
        response = HttpResponse(UNAUTHORIZED, status=401, content_type="text/plain; charset=utf-8")
        response["WWW-Authenticate"] = CHALLENGE
        return response
    body, content_type = exposition()
    return HttpResponse(body + generate_latest(CLUSTER), content_type=content_type)


class RequestMetricsMiddleware(AroundMiddleware):
    """Counts and times every API and dashboard request by its URL pattern, method and
    status (sync and async alike: ``AroundMiddleware``)."""

    def before(self, request):
        request.aenv_metrics_started = time.perf_counter()

    def after(self, request, response):
        self._observe(request, response, request.aenv_metrics_started)
        return response

    @staticmethod
    def _observe(request, response, started: float) -> None:
        match = getattr(request, "resolver_match", None)
        route = (match.route or UNMATCHED) if match is not None else UNMATCHED
        method = _method(request.method or "")
        API_REQUESTS.labels(route, method, str(response.status_code)).inc()
        API_LATENCY.labels(route, method).observe(time.perf_counter() - started)


def dataplane_route(target) -> str:
    """The data plane's route label: ``envd`` or ``port`` (a sandbox's other ports), by
    the target the proxy parsed; ``unrouted`` when the request names no sandbox."""
    if target is None:
        return "unrouted"
    return "envd" if target[1] == ENVD_PORT else "port"


class InstrumentedDataPlane:
    """Wraps the data plane's ASGI app: ``GET /metrics`` that names no sandbox (no
    ``E2b-Sandbox-Id``, no ``{port}-{id}.`` host) is its Prometheus exposition; every
    other HTTP request is passed on, counted and timed to its response's start."""

    def __init__(self, app, parse_target, registry=REGISTRY):
        self.app = app
        self.parse_target = parse_target  # headers dict → (sandbox id, port) or None
        self.registry = registry

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        target = self.parse_target({n.lower(): v for n, v in scope.get("headers", ())})
        if target is None and scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            return await self._expose(scope, send)
        route, method = dataplane_route(target), _method(scope["method"])
        started = time.perf_counter()
        observed = False

        async def timed_send(message):
            nonlocal observed
            if message["type"] == "http.response.start" and not observed:
                observed = True
                DATAPLANE_REQUESTS.labels(route, method, str(message["status"])).inc()
                DATAPLANE_LATENCY.labels(route, method).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            if not observed:  # the client or the upstream went away before any answer
                DATAPLANE_REQUESTS.labels(route, method, "none").inc()

    async def _expose(self, scope, send):
        authorization = next((v.decode("latin-1") for n, v in scope.get("headers", ()) if n.lower() == b"authorization"),
                             None)
        if not authorized(authorization):
            body = UNAUTHORIZED
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"www-authenticate", CHALLENGE.encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
            return
        body, content_type = exposition(self.registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
