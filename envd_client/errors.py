"""The one exception hierarchy of envd calls.

``EnvdError`` is a ``envd.wire.ConnectError``: every failure carries a Connect code
(``not_found``, ``unauthenticated``, ``invalid_argument``, ...). envd's plain-HTTP
endpoints (``/init``, ``/files``) and proxies answer errors without a Connect code; those
are mapped from the HTTP status as the E2B SDK maps them (401 → ``unauthenticated``,
404 → ``not_found``, 502/503 → ``unavailable``). ``EnvdUnavailable`` is the subclass for
transport failures: nothing listening, a refused or reset connection, a timeout, a
stream that broke or went silent — the sandbox may be gone, paused or still booting — or
no whole answer within the call's total deadline. ``EnvdAnswerTooLarge`` (code
``resource_exhausted``): the guest sent more than the call's cap (``envd_client.limits``).
"""
from __future__ import annotations

from envd.wire import CODE_TO_HTTP, ConnectError, error_from_response


class EnvdError(ConnectError):
    """An envd call failed. ``code`` is the Connect code, ``message`` envd's words,
    ``status`` the HTTP status when the failure was an HTTP answer (else None)."""

    def __init__(self, code: str, message: str = "", *, status: int | None = None):
        super().__init__(code if code in CODE_TO_HTTP else "unknown", message)
        self.status = status

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code

    @classmethod
    def from_response(cls, status: int, body: bytes) -> "EnvdError":
        """The error an HTTP error answer stands for (Connect error body or not)."""
        return error_from_response(status, body, cls, status=status)


class EnvdUnavailable(EnvdError):
    """envd could not be reached or the connection broke (code ``unavailable``)."""

    def __init__(self, message: str = ""):
        super().__init__("unavailable", message)


class EnvdAnswerTooLarge(EnvdError):
    """The guest sent more than the call's cap (code ``resource_exhausted``): the read
    stopped there and the connection was closed."""

    def __init__(self, what: str, cap: int):
        super().__init__("resource_exhausted", f"the guest sent too much: {what} exceeds {cap} bytes")
        self.cap = cap


def transport_error(exc: BaseException) -> EnvdUnavailable:
    """The EnvdUnavailable for an httpx transport exception (named, for the logs)."""
    text = str(exc)
    return EnvdUnavailable(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)

