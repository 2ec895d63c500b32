"""The node's TLS-interception CA on the node (``vmm.egress_ca``) and in its guests.

- ``node_ca()``: this node's CA, made at the node's start if missing (``run_node``) in
  ``AENV_EGRESS_CA_DIR``; the key never leaves the node (the proxy reads it there, or from
  ``NodeCA.mitmproxy_pem()``).
- ``needs_ca(network)``: whether a sandbox's network (its task's NetworkSpec or NetworkSpec
  JSON) has ``rules``: only then is its HTTPS to those hosts intercepted, and only then is the
  CA installed in it.
- ``install_in_guest``: envd's ``POST /aenv/trust`` with the CA's certificate (system bundle,
  every certifi copy, ``NODE_EXTRA_CA_CERTS``: ``envd.trust``), after ``/init`` at every start
  of such a sandbox's VM (create, restore, resume, fork), since the VM may have come from
  another node's capture."""
from __future__ import annotations

import functools

from django.conf import settings

from envd_client import EnvdClient, EnvdError
from vmm.egress_ca import NodeCA


class TrustFailed(Exception):
    """The guest's envd did not install the CA (the sandbox's HTTPS rules could not work)."""


@functools.lru_cache(maxsize=1)
def _ca(directory: str, node_id: str) -> NodeCA:
    return NodeCA.ensure(directory, node_id)


def node_ca() -> NodeCA:
    return _ca(str(settings.AENV_EGRESS_CA_DIR), settings.AENV_NODE_ID)


def needs_ca(network) -> bool:
    """True when ``network`` (a NetworkSpec, its JSON, or None) carries non-empty ``rules``."""
    rules = network.get("rules") if isinstance(network, dict) else getattr(network, "rules", None)
    return bool(rules)


def install_in_guest(host: str, port: int, access_token: str | None, timeout: float | None = None) -> dict:
    """Makes the guest at ``host:port`` trust this node's CA; TrustFailed if envd refuses."""
    pem = node_ca().cert_pem.decode()
    try:
        with EnvdClient.at(host, port, access_token) as envd:
            return envd.trust(pem) if timeout is None else envd.trust(pem, timeout=timeout)
    except EnvdError as exc:
        raise TrustFailed(f"envd /aenv/trust at {host}:{port} failed: {exc}") from None
