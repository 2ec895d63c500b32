"""Joining: how a machine becomes a node the control plane gives work to, and how an
operator takes that back.

An operator issues a one-time join token (``manage.py node_tokens``, ``POST
/nodes/join-tokens``, the dashboard's nodes page); the new node presents it once to ``POST
/nodes/join`` and gets its own long-lived credential, which it keeps and presents at each
start (``POST /nodes/check-in``). Only SHA-256 hashes of both are stored. Revoking a node
marks it revoked and draining: placement never picks it, ``nodes.client`` sends it nothing,
its own heartbeats do not revive it, and it can join again only with a new token issued for
its id after the revocation (an unbound token lying around must not resurrect it).

In Kubernetes the nodes are a DaemonSet's pods, which no operator hands a token: where
AENV_NODE_JOIN_KUBERNETES is on, a pod presents its projected service-account token instead
(``kubernetes_identity``: checked with the cluster's TokenReview, bound to the pod's node),
and is admitted by the same rules (``join_kubernetes``, ``_admit``).

Every decision about tokens, credentials and revoked nodes is here; the API, the commands,
the dashboard and the node worker only call it.
"""
from __future__ import annotations

import re
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes import db_roles, token_review
from nodes.models import Node, NodeJoinToken
from sandboxes.errors import Forbidden, Invalid, NotFound, Unauthenticated
from sandboxes.models import hash_api_key

TOKEN_MARK = "aenv_join_"
CREDENTIAL_MARK = "aenv_node_"
PREFIX_LEN = len(TOKEN_MARK) + 8  # what lists show and revocations name: the mark and 8 hex digits
MIN_TTL, MAX_TTL = 60, 30 * 24 * 3600
# Node ids name Celery queues (node.<id>), Redis ACL users and netns instances.
# Lower case, as deploy/install-node.sh checks it.
NODE_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class JoinRefused(Forbidden):
    """The token or node is known but may not join (revoked, used, expired, bound elsewhere)."""

    def __init__(self, message: str, code: str):
        super().__init__(message, code=code, retry=False)


class NodeRevoked(JoinRefused):
    """The node was revoked by an operator: it gets no work and may not register."""

    def __init__(self, node: Node):
        super().__init__(f"node {node.pk} was revoked at {node.revoked_at:%Y-%m-%d %H:%M:%S} UTC; "
                         "it may join again only with a new join token issued for it", "node_revoked")


# Join tokens and node credentials are kept as API keys are: only their SHA-256.
hash_secret = hash_api_key


def parse_ttl(text: str | int) -> int:
    """``90``, ``30m``, ``24h``, ``7d`` -> seconds, between a minute and 30 days."""
    match = _DURATION.fullmatch(str(text).strip().lower())
    if not match:
        raise Invalid(f"ttl {text!r}: a number of seconds, or with s, m, h or d (e.g. 24h)")
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if not MIN_TTL <= seconds <= MAX_TTL:
        raise Invalid(f"ttl {text!r}: between {MIN_TTL} s and {MAX_TTL // 86400} days")
    return seconds


# Names of the API's own /nodes/... routes (api.nodes.urls): GET /nodes/{id} could not show them.
RESERVED_IDS = frozenset({"join", "check-in", "join-tokens"})


def check_node_id(node_id: str) -> str:
    if node_id in RESERVED_IDS:
        raise Invalid(f"node id {node_id!r} is reserved (it names an API route)")
    if not NODE_ID.fullmatch(node_id or ""):
        raise Invalid(f"node id {node_id!r}: 1-64 lower-case letters, digits, '.', '_' or '-', starting with a letter or digit")
    return node_id


def create_token(*, node_id: str = "", ttl: int | str | None = None, created_by: str = "") -> tuple[NodeJoinToken, str]:
    """A new join token and its raw value (shown once; only its hash is kept). ``node_id``
    binds it to that id: the only way to re-admit a revoked node or replace a joined node's
    credential."""
    if node_id:
        check_node_id(node_id)
    seconds = parse_ttl(settings.AENV_NODE_JOIN_TOKEN_TTL if ttl in (None, "") else ttl)
    while True:  # the visible prefix is unique too (it names the token); a clash is a 1 in 4e9 retry
        raw = TOKEN_MARK + secrets.token_hex(24)
        if not NodeJoinToken.objects.filter(prefix=raw[:PREFIX_LEN]).exists():
            break
    token = NodeJoinToken.objects.create(prefix=raw[:PREFIX_LEN], token_hash=hash_secret(raw), node_id=node_id,
                                         created_by=created_by[:150],
                                         expires_at=timezone.now() + timedelta(seconds=seconds))
    return token, raw


def find_token(prefix: str) -> NodeJoinToken:
    """By its listed prefix (with or without the ``aenv_join_`` mark)."""
    prefix = (prefix or "").strip().rstrip("…")
    if not prefix.startswith(TOKEN_MARK):
        prefix = TOKEN_MARK + prefix
    token = NodeJoinToken.objects.filter(prefix=prefix[:PREFIX_LEN]).first()
    if token is None or len(prefix) < PREFIX_LEN:
        raise NotFound(f"no join token {prefix!r}", code="join_token_not_found")
    return token


def listed_tokens(limit: int = 500) -> list[NodeJoinToken]:
    """The newest tokens, each with ``state_now`` (for the API's and the dashboard's lists)."""
    now = timezone.now()
    tokens = list(NodeJoinToken.objects.order_by("-created_at")[:limit])
    for token in tokens:
        token.state_now = token.state(now)
    return tokens


def revoke_token(prefix: str) -> NodeJoinToken:
    """Revoke the token (idempotent); a node that already joined with it stays joined."""
    token = find_token(prefix)
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        NodeJoinToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=token.revoked_at)
    return token


def join(raw_token: str, node_id: str = "") -> tuple[Node, str]:
    """Spend the join token on node ``node_id`` (or the id the token is bound to): its row is
    created or claimed, with a new credential whose raw value is returned once.

    Unknown token: Unauthenticated (401). Revoked, used or expired token, a token bound to
    another id, a revoked node without a token issued for it after the revocation, or a
    joined node claimed by an unbound token: JoinRefused (403).

    With per-node database roles (``nodes.db_roles``) the node's row carries
    ``database_url`` (its role's URL, for the join's answer only; else None); a control plane
    that cannot make the role: Unavailable (503), and the token stays unspent."""
    raw_token = (raw_token or "").strip()
    node_id = (node_id or "").strip()
    with transaction.atomic():
        token = NodeJoinToken.objects.select_for_update().filter(token_hash=hash_secret(raw_token)).first()
        if token is None or not raw_token.startswith(TOKEN_MARK):
            raise Unauthenticated("unknown join token", code="join_token_unknown", retry=False)
        state = token.state()
        if state != "active":
            raise JoinRefused(f"join token {token.prefix}… is {state}", f"join_token_{state}")
        if token.node_id and node_id and node_id != token.node_id:
            raise JoinRefused(f"join token {token.prefix}… is for node {token.node_id}, not {node_id}",
                              "join_token_other_node")
        node_id = check_node_id(node_id or token.node_id)
        return _admit(node_id, token, bound=token.node_id == node_id)


def _admit(node_id: str, token: NodeJoinToken | None, *, bound: bool) -> tuple[Node, str]:
    """The rules every way of joining shares, inside the caller's transaction: a revoked node
    comes back only with ``token`` issued for its id after the revocation; a node that has
    joined gets a new credential only from a join ``bound`` to its id (a token issued for it,
    or its Kubernetes node's own token); then the new credential, ``token`` spent, and the
    node's database role."""
    node = Node.objects.select_for_update().filter(pk=node_id).first()
    if node is not None and node.revoked_at is not None:
        if token is None or token.node_id != node_id or token.created_at <= node.revoked_at:
            raise NodeRevoked(node)
    elif node is not None and node.credential_hash and not bound:
        raise JoinRefused(f"node {node_id} has joined already; a new credential for it needs a join token "
                          "issued for that node id", "node_already_joined")
    credential = CREDENTIAL_MARK + secrets.token_hex(32)
    fields = dict(credential_hash=hash_secret(credential), joined_via=token, revoked_at=None)
    if node is None:
        node = Node.objects.create(pk=node_id, **fields)
    else:
        if node.revoked_at is not None:
            fields["draining"] = False  # the revocation drained it; the operator's new token re-admits it
        Node.objects.filter(pk=node_id).update(**fields)
        node.refresh_from_db()
    if token is not None:
        NodeJoinToken.objects.filter(pk=token.pk).update(used_at=timezone.now(), used_by=node_id)
    node.database_url = db_roles.issue(node_id) if db_roles.enabled() else None
    return node, credential


# --- Kubernetes: the pod's service-account token instead of a join token ------------------

SERVICE_ACCOUNT_USER = "system:serviceaccount:"


def kubernetes_identity(raw_token: str, node_id: str = "") -> str:
    """The node id a Kubernetes DaemonSet pod may join as, from its projected service-account
    token (no database: call it off the request's database thread, it waits on the cluster).

    The cluster's TokenReview (``nodes.token_review``) must find the token authentic, for
    the audience AENV_NODE_JOIN_KUBERNETES_AUDIENCE, of the service account
    AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT, and bound to a pod on a node: that node's name
    is the node id (the DaemonSet's AENV_NODE_ID is ``spec.nodeName``), and ``node_id``, when
    given, must be it. Kubernetes joins off, or a token that is not authentic: Unauthenticated
    (401) or JoinRefused (403); the review impossible: Unavailable (503)."""
    if not settings.AENV_NODE_JOIN_KUBERNETES:
        raise JoinRefused("this control plane does not take Kubernetes tokens (AENV_NODE_JOIN_KUBERNETES is off); "
                          "join with a join token", "kubernetes_join_off")
    raw_token = (raw_token or "").strip()
    if not raw_token:
        raise Unauthenticated("empty Kubernetes token", code="kubernetes_token_invalid", retry=False)
    audience = settings.AENV_NODE_JOIN_KUBERNETES_AUDIENCE
    status = token_review.review(raw_token, audience)
    if status.get("authenticated") is not True:
        why = str(status.get("error") or "not authenticated")[:300]
        raise Unauthenticated(f"the Kubernetes token was not accepted by the cluster: {why}",
                              code="kubernetes_token_invalid", retry=False)
    # An authenticator that ignored the review's audiences answers none: the token may be one
    # for the API server itself (any pod's), which must not let a pod in.
    if audience not in (status.get("audiences") or []):
        raise JoinRefused(f"the Kubernetes token is not for the audience {audience!r} "
                          "(a projected token with that audience is needed)", "kubernetes_token_audience")
    user = status.get("user") if isinstance(status.get("user"), dict) else {}
    expected = SERVICE_ACCOUNT_USER + settings.AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT
    if user.get("username") != expected:
        raise JoinRefused(f"the Kubernetes token is {user.get('username') or 'nobody'}'s, not the nodes' service "
                          f"account {settings.AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT}",
                          "kubernetes_token_service_account")
    extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
    names = extra.get(token_review.NODE_NAME) or []
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str) or not names[0]:
        raise JoinRefused("the Kubernetes token names no node (a token projected into a pod is needed, "
                          "on Kubernetes 1.30 or later)", "kubernetes_token_no_node")
    node_name = names[0]
    node_id = (node_id or "").strip()
    if node_id and node_id != node_name:
        raise JoinRefused(f"the Kubernetes token is from a pod on node {node_name}, not {node_id}",
                          "kubernetes_token_other_node")
    return check_node_id(node_name)


def join_kubernetes(node_id: str) -> tuple[Node, str]:
    """Admit node ``node_id`` that ``kubernetes_identity`` vouched for, as a join token bound to
    it would: a new credential (its database role too), even where it had one (the pod lost its
    host's AENV_HOME, or runs again after a reinstall). A revoked node comes back only when an
    operator has issued a join token for its id since the revocation: this join spends it."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        token = None
        if node is not None and node.revoked_at is not None:
            token = NodeJoinToken.objects.select_for_update().filter(
                node_id=node_id, used_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now(),
                created_at__gt=node.revoked_at).order_by("created_at").first()
        return _admit(node_id, token, bound=True)


def authenticate(raw_credential: str) -> Node:
    """The node a credential belongs to: Unauthenticated if none, NodeRevoked if revoked."""
    raw_credential = (raw_credential or "").strip()
    node = None
    if raw_credential.startswith(CREDENTIAL_MARK):
        node = Node.objects.filter(credential_hash=hash_secret(raw_credential)).first()
    if node is None:
        raise Unauthenticated("unknown node credential", code="node_unknown", retry=False)
    if node.revoked_at is not None:
        raise NodeRevoked(node)
    return node


def revoke_node(node_id: str) -> Node:
    """Revoke node ``node_id``: revoked and draining (no placement, no task sent), its
    unspent tokens revoked with it, its database role (if any) cut off. Idempotent. Its VMs
    keep running until someone stops them on the host: the control plane no longer talks to it."""
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None:
            raise NotFound(f'node "{node_id}" not found', code="node_not_found")
        if node.revoked_at is None:
            Node.objects.filter(pk=node_id).update(revoked_at=now, draining=True)
        NodeJoinToken.objects.filter(node_id=node_id, used_at__isnull=True, revoked_at__isnull=True).update(
            revoked_at=now)
    db_roles.cut(node_id)
    node.refresh_from_db()
    return node


def usable(nodes):
    """``nodes`` (a Node queryset) without those the control plane gives no work: revoked
    ones, and, where AENV_NODE_JOIN_REQUIRED, those that never joined."""
    nodes = nodes.filter(revoked_at__isnull=True)
    if settings.AENV_NODE_JOIN_REQUIRED:
        nodes = nodes.exclude(credential_hash="")
    return nodes


def refusal(node: Node) -> str | None:
    """Why no task may be sent to ``node`` (None: it may), the same rule as ``usable``."""
    if node.revoked_at is not None:
        return f"node {node.pk} was revoked at {node.revoked_at:%Y-%m-%d %H:%M:%S} UTC"
    if settings.AENV_NODE_JOIN_REQUIRED and not node.credential_hash:
        return f"node {node.pk} never joined with a join token (AENV_NODE_JOIN_REQUIRED)"
    return None
