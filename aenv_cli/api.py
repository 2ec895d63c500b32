"""The API client every ``aenv`` command shares: an httpx client on the E2B REST API
that sends the key, how an error answer becomes an ``ApiError`` (``<status>: <message>``,
exit status by ``aenv_cli.errors``), and E2B's list conventions (``X-Next-Token`` pages,
the SDK's metadata filter encoding)."""
from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote, urlencode

import httpx

from envd_client.protocol import tls_for

from . import __version__
from .config import Config
from .errors import ApiError, CliError

__all__ = ["API_TIMEOUT", "ApiError", "CliError", "Config", "check", "client", "error_message", "message_of",
           "metadata_filter", "pages", "segment"]

API_TIMEOUT = 60.0  # seconds, as the SDK's default request timeout
PAGE_SIZE = 100  # the API's largest page


def message_of(resp: httpx.Response) -> str:
    """The message of an error answer (E2B's ``{code, message}``, else its text)."""
    try:
        body = resp.json()
        message = body.get("message", resp.text) if isinstance(body, dict) else resp.text
    except ValueError:
        message = resp.text
    return str(message).strip() or resp.reason_phrase


def error_message(resp: httpx.Response) -> str:
    """``<status>: <message>`` of an error answer."""
    return f"{resp.status_code}: {message_of(resp)}"


def check(resp: httpx.Response) -> httpx.Response:
    """The answer, or ApiError with its status and message."""
    if resp.status_code >= 400:
        raise ApiError(resp.status_code, message_of(resp))
    return resp


def client(config: Config, timeout: float = API_TIMEOUT) -> httpx.Client:
    """An httpx client on the API that sends the key (no TLS set-up for a plain-http
    API: loading the CA bundle costs more than ``aenv ls``'s request)."""
    return httpx.Client(base_url=config.api_url, timeout=timeout, verify=tls_for(config.api_url),
                        headers={"X-API-Key": config.api_key, "User-Agent": f"aenv-cli/{__version__}"})


def segment(value: str) -> str:
    """``value`` as one path segment (a name may hold ``/`` and ``:``), as the SDK sends it."""
    return quote(value, safe="")


def metadata_filter(metadata: dict[str, str]) -> str:
    """The ``metadata`` query value of a list, encoded as the SDK encodes it (each key and
    value percent-encoded, then joined as form data; httpx encodes the whole once more)."""
    return urlencode({quote(k): quote(v) for k, v in metadata.items()})


def pages(api: httpx.Client, path: str, params: dict | None = None, *, page_size: int = PAGE_SIZE,
          max_items: int | None = None) -> Iterator[dict]:
    """Every row of a paginated list, asking ``page_size`` at a time and following
    ``X-Next-Token`` to the end (or until ``max_items`` rows)."""
    params = {**(params or {}), "limit": page_size}
    seen = 0
    while True:
        resp = check(api.get(path, params=params))
        for row in resp.json():
            yield row
            seen += 1
            if max_items is not None and seen >= max_items:
                return
        token = resp.headers.get("x-next-token")
        if not token:
            return
        params["nextToken"] = token
