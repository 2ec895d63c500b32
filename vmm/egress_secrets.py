"""The egress proxy's client for secret values: what turns ``${e2b.secrets.NAME}`` in a
rule's headers into the value, for one sandbox's request to one host, without the value ever
travelling in a task's arguments or touching the guest.

It asks the API's node-only ``POST /nodes/secrets/resolve`` (``team_secrets.resolve``
decides: the sandbox must be on this node and live, the secret its team's, and one of its
``network.rules`` for a host pattern matching ``host`` must carry that marker) and keeps the
answer in memory for the ``ttl`` the API gives. Refusals are not kept.

Standard library only, no Django, no aenv import: the proxy runs in mitmproxy's own Python
environment and loads this file by its path (as it does ``vmm/net/domains.py``). The node
worker builds the configuration (``agent.egress_secrets.proxy_config``: the API's URL and the
node's authentication headers) and hands it to the proxy."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

MARKER = re.compile(r"\$\{e2b\.secrets\.([^{}\s\x00-\x1f\x7f-\x9f]+)\}")
ROUTE = "/nodes/secrets/resolve"
TIMEOUT = 10.0


class SecretRefused(Exception):
    """The API refused (``status`` 403: the rules do not send it to that host; 404: no such
    live sandbox on this node, or no such secret in its team; 401: this node is unknown).
    The proxy fails the request (E2B: an unknown reference fails when it is resolved)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class SecretUnavailable(Exception):
    """The API could not be asked or failed (unreachable, timed out, 5xx): the request must
    fail rather than leave without its header."""


def _post(url: str, headers: dict, body: dict, timeout: float) -> tuple[int, dict]:
    """POST JSON; (status, JSON body) for any HTTP answer; SecretUnavailable for no answer."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the node's own API URL
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise SecretUnavailable(f"the API cannot be asked: {type(exc).__name__}") from None
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        data = None
    return status, data if isinstance(data, dict) else {}


post_json = _post  # the egress proxy asks the API for upstream proxies' passwords with it too


@dataclass
class _Entry:
    value: str
    version: int
    expires: float


class SecretResolver:
    """Values by (sandbox, name, host), asked for once per ``ttl``; thread-safe.
    ``base_url``: the API (``AENV_CONTROL_PLANE_URL`` or ``AENV_API_PUBLIC_URL``);
    ``headers``: the node's authentication; ``post`` and ``clock``: for tests."""

    def __init__(self, base_url: str, headers: dict, *, post=_post, clock=time.monotonic, timeout: float = TIMEOUT):
        self.url = base_url.rstrip("/") + ROUTE
        self._headers = dict(headers)
        self._post, self._clock, self._timeout = post, clock, timeout
        self._cache: dict[tuple[str, str, str], _Entry] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: dict, **kwargs) -> "SecretResolver":
        """From ``agent.egress_secrets.proxy_config()``'s ``{"url", "headers"}``."""
        return cls(config["url"], config["headers"], **kwargs)

    def value(self, sandbox_id: str, name: str, host: str) -> str:
        """The value of secret ``name`` for a request of ``sandbox_id`` to ``host`` (its SNI or Host)."""
        key = (sandbox_id, name.lower(), host.lower().rstrip("."))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.expires > self._clock():
                return entry.value
        status, body = self._post(self.url, self._headers, {"sandboxID": sandbox_id, "name": name, "host": host},
                                  self._timeout)
        if status >= 500:
            raise SecretUnavailable(f"the API answered {status}")
        if status != 200 or not isinstance(body.get("value"), str):
            raise SecretRefused(status, str(body.get("message") or "refused"))
        ttl = max(0, int(body.get("ttl") or 0))
        with self._lock:
            self._cache[key] = _Entry(body["value"], int(body.get("version") or 0), self._clock() + ttl)
        return body["value"]

    def fill(self, sandbox_id: str, host: str, text: str) -> str:
        """``text`` with every marker replaced by its value (the first refusal raises)."""
        return MARKER.sub(lambda m: self.value(sandbox_id, m.group(1), host), text)

    def fill_headers(self, sandbox_id: str, host: str, headers: dict[str, str]) -> dict[str, str]:
        """A matching rule's ``transform.headers``, markers filled, for one request."""
        return {name: self.fill(sandbox_id, host, value) for name, value in headers.items()}

    def forget(self, sandbox_id: str | None = None) -> None:
        """Drops what is kept for ``sandbox_id`` (None: everything): at its kill, pause or
        network update, so a removed rule stops sending the value at once."""
        with self._lock:
            for key in [k for k in self._cache if sandbox_id is None or k[0] == sandbox_id]:
                del self._cache[key]

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)
