"""The node's side of secrets: how its egress proxy gets the value behind a
``${e2b.secrets.NAME}`` marker, without the value ever travelling in a task's arguments.

The proxy calls ``fill_headers(sandbox_id, host, headers)`` (or ``resolver().value(...)``) for
a request of that sandbox to ``host`` (the TLS SNI or HTTP Host it saw). The resolver asks the
API's node-only ``POST /nodes/secrets/resolve`` (``team_secrets.resolve`` decides: the sandbox
must be on this node and live, the secret its team's, and one of its ``network.rules`` for a
host pattern matching ``host`` must carry that marker) and keeps the answer in this process's
memory for the ``ttl`` the API gives (``AENV_EGRESS_SECRET_CACHE_TTL``). Refusals are not
kept; ``forget(sandbox_id)`` drops a sandbox's values (its kill, pause, network update).

Which node asks: a node that joined presents its credential (``AENV_HOME/node_credential``);
one that never joined its id and a token derived from ``DJANGO_SECRET_KEY``
(``nodes.node_auth``). Where: ``AENV_CONTROL_PLANE_URL``, else ``AENV_API_PUBLIC_URL``."""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import httpx
from django.conf import settings

from agent.join import stored_credential
from nodes import node_auth

MARKER = re.compile(r"\$\{e2b\.secrets\.([^{}\s\x00-\x1f\x7f-\x9f]+)\}")
TIMEOUT = 10.0


class SecretRefused(Exception):
    """The API refused the value (``status``: 403 host not allowed, 404 no such sandbox here or
    no such secret, 401 this node is not known); ``message`` says why. Not cached."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class SecretUnavailable(Exception):
    """The API could not be asked (unreachable, timed out, answered 5xx): the proxy should
    fail the request rather than send it without its header."""


@dataclass
class _Entry:
    value: str
    version: int
    expires: float


class SecretResolver:
    """Asks the API for values and keeps them for their ttl; thread-safe. ``http``: a client
    to use (tests: one on the API's ASGI app), else one of its own."""

    def __init__(self, base_url: str, headers: dict, http: httpx.Client | None = None,
                 clock=time.monotonic):
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers)
        self._http = http or httpx.Client(timeout=TIMEOUT)
        self._clock = clock
        self._cache: dict[tuple[str, str, str], _Entry] = {}
        self._lock = threading.Lock()

    def value(self, sandbox_id: str, name: str, host: str) -> str:
        """The value of secret ``name`` for a request of ``sandbox_id`` to ``host``."""
        key = (sandbox_id, name.lower(), host.lower().rstrip("."))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.expires > self._clock():
                return entry.value
        try:
            answer = self._http.post(f"{self.base_url}/nodes/secrets/resolve", headers=self._headers,
                                     json={"sandboxID": sandbox_id, "name": name, "host": host})
        except httpx.HTTPError as exc:
            raise SecretUnavailable(f"the API at {self.base_url} cannot be asked: {type(exc).__name__}") from None
        try:
            body = answer.json()
        except ValueError:
            body = {}
        if answer.status_code >= 500 or not isinstance(body, dict):
            raise SecretUnavailable(f"the API answered {answer.status_code}")
        if answer.status_code != 200:
            raise SecretRefused(answer.status_code, str(body.get("message") or answer.reason_phrase))
        ttl = max(0, int(body.get("ttl") or 0))
        with self._lock:
            self._cache[key] = _Entry(body["value"], int(body["version"]), self._clock() + ttl)
        return body["value"]

    def fill(self, sandbox_id: str, host: str, text: str) -> str:
        """``text`` with every secret marker replaced by its value (SecretRefused /
        SecretUnavailable for the first that cannot be had)."""
        return MARKER.sub(lambda m: self.value(sandbox_id, m.group(1), host), text)

    def fill_headers(self, sandbox_id: str, host: str, headers: dict[str, str]) -> dict[str, str]:
        """A rule's ``transform.headers`` with their markers filled, for one request."""
        return {name: self.fill(sandbox_id, host, value) for name, value in headers.items()}

    def forget(self, sandbox_id: str | None = None) -> None:
        """Drops the values kept for ``sandbox_id`` (None: all)."""
        with self._lock:
            for key in [k for k in self._cache if sandbox_id is None or k[0] == sandbox_id]:
                del self._cache[key]

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


def node_headers(node_id: str, credential: str | None, secret_key: str) -> dict:
    """How this node authenticates to the resolve route (module docstring)."""
    if credential:
        return {"Authorization": f"Bearer {credential}"}
    return {"Authorization": f"Bearer {node_auth.derived_token(secret_key, node_id)}", node_auth.NODE_HEADER: node_id}


_resolver: SecretResolver | None = None
_resolver_lock = threading.Lock()


def resolver() -> SecretResolver:
    """This node process's resolver, made from the settings on first use."""
    global _resolver
    with _resolver_lock:
        if _resolver is None:
            node_id = settings.AENV_NODE_ID
            _resolver = SecretResolver(settings.AENV_CONTROL_PLANE_URL or settings.AENV_API_PUBLIC_URL,
                                       node_headers(node_id, stored_credential(node_id), settings.SECRET_KEY))
        return _resolver


def fill_headers(sandbox_id: str, host: str, headers: dict[str, str]) -> dict[str, str]:
    """The proxy's one call: ``headers`` (a matching rule's ``transform.headers``) with every
    ``${e2b.secrets.NAME}`` replaced by its value for ``sandbox_id``'s request to ``host``."""
    return resolver().fill_headers(sandbox_id, host, headers)
