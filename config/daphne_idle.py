"""The API's idle keep-alive timeout under daphne (one place, every way daphne is started).

Twisted, under daphne, closes a kept-alive connection after 60 s without a request, and daphne
has no option for it. The E2B SDKs keep pooled connections for up to 300 s: a request sent in
the instant the server closes its idle connection fails with "connection closed before message
completed" (bench/load.py saw a pause fail so). The API keeps idle connections a little longer
than the clients do (AENV_API_IDLE_TIMEOUT), so the client always closes first. Imported by
config.asgi, which daphne loads before it builds its HTTP factory."""
from __future__ import annotations


def lengthen_idle_timeout(seconds: float) -> None:
    """Every HTTP connection daphne accepts from now on waits ``seconds`` idle before it is
    closed (idempotent: the last call's value wins)."""
    try:
        from daphne.http_protocol import HTTPFactory  # noqa: PLC0415 - only where daphne is installed
    except ImportError:
        return
    init = getattr(HTTPFactory.__init__, "aenv_original", HTTPFactory.__init__)

    def init_with_idle_timeout(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.timeOut = seconds  # twisted copies it onto each connection it builds

    init_with_idle_timeout.aenv_original = init
    HTTPFactory.__init__ = init_with_idle_timeout
