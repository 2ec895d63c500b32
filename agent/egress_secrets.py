"""The node worker's side of secrets: which API a node asks for secret values and how it
proves which node it is (``vmm.egress_secrets`` is the client itself, which the egress proxy
loads in its own Python environment).

- Where: ``AENV_CONTROL_PLANE_URL``, else ``AENV_API_PUBLIC_URL`` (the single-machine default).
- Who: a node that joined presents its credential (``AENV_HOME/node_credential``); one that
  never joined its id and a token derived from ``DJANGO_SECRET_KEY`` (``nodes.node_auth``).

``proxy_config()`` is what the worker hands the proxy (``SecretResolver.from_config``): it
carries the node's credential, so it goes only where the proxy alone reads it.
``resolver()`` / ``fill_headers`` serve code that runs in the worker itself."""
from __future__ import annotations

import threading

from django.conf import settings

from agent.join import stored_credential
from nodes import node_auth
from vmm.egress_secrets import SecretResolver


def node_headers(node_id: str, credential: str | None, secret_key: str) -> dict:
    """How this node authenticates to the resolve route (module docstring)."""
    if credential:
        return {"Authorization": f"Bearer {credential}"}
    return {"Authorization": f"Bearer {node_auth.derived_token(secret_key, node_id)}", node_auth.NODE_HEADER: node_id}


def proxy_config() -> dict:
    """``{"url", "headers"}`` for ``SecretResolver.from_config`` on this node."""
    node_id = settings.AENV_NODE_ID
    return {"url": settings.AENV_CONTROL_PLANE_URL or settings.AENV_API_PUBLIC_URL,
            "headers": node_headers(node_id, stored_credential(node_id), settings.SECRET_KEY)}


_resolver: SecretResolver | None = None
_lock = threading.Lock()


def resolver() -> SecretResolver:
    """This worker process's resolver (made on first use)."""
    global _resolver
    with _lock:
        if _resolver is None:
            _resolver = SecretResolver.from_config(proxy_config())
        return _resolver


def fill_headers(sandbox_id: str, host: str, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` (a matching rule's ``transform.headers``) with every ``${e2b.secrets.NAME}``
    replaced by its value for ``sandbox_id``'s request to ``host``."""
    return resolver().fill_headers(sandbox_id, host, headers)
