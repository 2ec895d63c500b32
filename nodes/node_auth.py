"""How a node proves which node it is when it calls the API for itself (today: its egress
proxy asking for a secret's value, ``POST /nodes/secrets/resolve``).

- A node that joined (``nodes.join``) presents its credential (``Authorization: Bearer
  aenv_node_…``), which names it.
- A node that never joined (the single-machine default, ``scripts/cluster.sh`` namespaces)
  has no credential: it presents ``X-Aenv-Node-Id`` and a bearer token derived by HKDF-SHA256
  from ``DJANGO_SECRET_KEY`` and its id (``derived_token``). Every process of a deployment
  shares that key already (``nodes.sealed``), so no new secret is handed out, and the token
  reveals nothing of the key; it is refused for a node that joined (it must use its
  credential, which revoking it takes away) and wherever AENV_NODE_JOIN_REQUIRED is on.

Why the identity matters: a value is given to a node only for sandboxes placed on it
(``team_secrets.resolve``)."""
from __future__ import annotations

import hmac

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from nodes import join
from nodes.models import Node
from sandboxes.errors import Forbidden, Unauthenticated

_INFO = b"aenv node identity v1:"
NODE_HEADER = "X-Aenv-Node-Id"


def claimed_id(meta: dict) -> str:
    """The node id a request claims in ``NODE_HEADER`` (a WSGI/ASGI ``META``), "" without one."""
    return meta.get("HTTP_" + NODE_HEADER.upper().replace("-", "_"), "").strip()


def derived_token(secret_key: str, node_id: str) -> str:
    """The bearer token of node ``node_id`` that never joined (64 hex digits)."""
    if not secret_key:
        raise ValueError("a derived node token needs DJANGO_SECRET_KEY")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + node_id.encode())
    return hkdf.derive(secret_key.encode()).hex()


def authenticate(bearer: str, claimed_id: str = "") -> Node:
    """The node that presents ``bearer`` (and, for a derived token, claims ``claimed_id``):
    Unauthenticated for an unknown secret, Forbidden (or NodeRevoked) when it may not."""
    bearer = (bearer or "").strip()
    if bearer.startswith(join.CREDENTIAL_MARK):
        node = join.authenticate(bearer)
        if claimed_id and claimed_id != node.pk:
            raise Forbidden(f"this credential is node {node.pk}'s, not {claimed_id}'s", code="node_other_id",
                            retry=False)
        return node
    if not claimed_id:
        raise Unauthenticated(f"a node without a credential names itself with {NODE_HEADER}", code="node_unknown",
                              retry=False)
    node = Node.objects.filter(pk=claimed_id).first()
    if node is None or not hmac.compare_digest(bearer, derived_token(settings.SECRET_KEY, claimed_id)):
        raise Unauthenticated("unknown node credential", code="node_unknown", retry=False)
    if node.revoked_at is not None:
        raise join.NodeRevoked(node)
    if node.credential_hash:
        raise Forbidden(f"node {node.pk} joined: it authenticates with its credential", code="node_joined",
                        retry=False)
    if settings.AENV_NODE_JOIN_REQUIRED:
        raise Forbidden(f"node {node.pk} never joined (AENV_NODE_JOIN_REQUIRED)", code="node_not_joined",
                        retry=False)
    return node
