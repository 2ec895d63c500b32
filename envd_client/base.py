"""What the sync and the async client share: where envd is, how to authenticate, timeouts.

Why a module of its own: both clients are built the same way (an envd address or the
data plane plus a sandbox id, the sandbox's access token, the same timeouts) and must
send the same headers; only their ``httpx`` client class differs.
"""
from __future__ import annotations

import httpx

from envd import ENVD_PORT

from . import protocol
from .errors import EnvdError


class BaseClient:
    """Connection facts of one sandbox's envd. ``access_token`` is sent as
    ``X-Access-Token`` (``init`` and ``handoff_token`` replace it with the one they
    install); ``headers`` go on every request (e.g. the data plane's routing headers). Timeouts
    (seconds): ``timeout`` the total of a unary call (connect, send, answer: not per read),
    ``connect_timeout`` to connect, and
    ``stream_idle_timeout`` of silence after which a stream counts as dead (envd sends
    keepalives every ``protocol.KEEPALIVE_INTERVAL``; None: never)."""

    def __init__(self, base_url: str, access_token: str | None = None, *, headers: dict | None = None,
                 timeout: float = protocol.UNARY_TIMEOUT, connect_timeout: float = protocol.CONNECT_TIMEOUT,
                 stream_idle_timeout: float | None = protocol.STREAM_IDLE_TIMEOUT, transport=None):
        self.base_url = base_url.rstrip("/")
        self.access_token = access_token or None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self._client_options = {
            "base_url": self.base_url,
            # identity: what is read is what is counted against the caps (no inflating a small body)
            "headers": {"Connect-Protocol-Version": "1", "Accept-Encoding": "identity", **(headers or {})},
            "timeout": httpx.Timeout(timeout, connect=connect_timeout),
            "verify": protocol.tls_for(self.base_url),
        }
        if transport is not None:  # an httpx transport of the client's kind (tests: httpx.MockTransport)
            self._client_options["transport"] = transport

    @classmethod
    def at(cls, host: str, port: int = ENVD_PORT, access_token: str | None = None, **kwargs):
        """envd reached directly (the node: ``VMInfo.envd_host`` / ``envd_port``)."""
        return cls(f"http://{host}:{port}", access_token, **kwargs)

    @classmethod
    def through_proxy(cls, sandbox_url: str, sandbox_id: str, access_token: str | None = None, **kwargs):
        """envd reached through the data plane (``E2B_SANDBOX_URL``), which routes by the
        ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers."""
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT), **kwargs.pop("headers", {})}
        return cls(sandbox_url, access_token, headers=headers, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.base_url}>"

    # -- request plumbing shared by both transports ------------------------------------------

    def _headers(self, req: protocol.Request) -> dict:
        if self.access_token:
            return {**req.headers, "X-Access-Token": self.access_token}
        return req.headers

    def _total(self, req: protocol.Request) -> float | None:
        """The call's total deadline (seconds; None for an upload, whose length is the caller's)."""
        if not req.total:
            return None
        return self.timeout if req.timeout is None else req.timeout

    def _timeout(self, req: protocol.Request) -> httpx.Timeout:
        return httpx.Timeout(self.timeout if req.timeout is None else req.timeout, connect=self.connect_timeout)

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.stream_idle_timeout, connect=self.connect_timeout)

    @staticmethod
    def _check(req: protocol.Request, status: int, body: bytes) -> None:
        if status not in req.expect:
            raise EnvdError.from_response(status, body)
