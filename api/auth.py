"""Who calls the API: a team, by its ``X-API-Key`` (keys are looked up by their hash, through
``sandboxes.key_cache``: a revoked key is refused within ``AENV_API_KEY_CACHE_SECONDS``); a
person, by an access token (``Authorization: Bearer sk_e2b_…``) or the dashboard's signed-in
session, on the routes E2B gives to people (``/teams``, ``/access-tokens``, ``/api-keys``,
team metrics); or an operator, by E2B's ``X-Admin-Token`` on the routes that take it
(``GET /nodes``)."""
import hmac

from django.conf import settings
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from sandboxes.access_tokens import find_token
from sandboxes import key_cache
from sandboxes.models import AccessToken, ApiKey


class ApiKeyPrincipal:
    """What `request.user` is for an API-key request: the key's team, never a person."""

    is_authenticated = True
    is_anonymous = False
    is_operator = False

    def __init__(self, api_key: ApiKey):
        self.api_key = api_key
        self.team = api_key.team
        self.team_id = api_key.team_id

    def __str__(self) -> str:
        return f"apikey:{self.api_key.prefix}"


def _used_lately(key: ApiKey, now) -> bool:
    """``last_used_at`` is written at most once a minute."""
    return key.last_used_at is not None and (now - key.last_used_at).total_seconds() <= 60


class ApiKeyAuthentication(authentication.BaseAuthentication):
    header = "HTTP_X_API_KEY"

    def authenticate(self, request):
        raw = request.META.get(self.header)
        if not raw:
            raise exceptions.NotAuthenticated("missing X-API-Key header")
        key = key_cache.lookup(raw)
        if key is None:
            raise exceptions.AuthenticationFailed("invalid API key")
        now = timezone.now()
        if not _used_lately(key, now):
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
            key.last_used_at = now  # the cached row too: once a minute, not every request
        return ApiKeyPrincipal(key), key

    def answer_without_io(self, request):
        """What ``authenticate`` would answer, when that needs no database (the key cached
        live, its ``last_used_at`` recent); None otherwise. Lets a view authenticate in the
        event loop (api.loop_views) instead of a thread."""
        raw = request.META.get(self.header)
        key = key_cache.peek(raw) if raw else None
        if key is None or not _used_lately(key, timezone.now()):
            return None
        return ApiKeyPrincipal(key), key

    def authenticate_header(self, request):
        # Makes DRF answer 401 (not 403) for missing/invalid keys.
        return "X-API-Key"


class OptionalApiKeyAuthentication(ApiKeyAuthentication):
    """The same key, on routes a person may call too: no header, the next class decides."""

    def authenticate(self, request):
        if not request.META.get(self.header):
            return None
        return super().authenticate(request)


class AccessTokenAuthentication(authentication.BaseAuthentication):
    """E2B's ``AccessTokenAuth``: ``Authorization: Bearer sk_e2b_…``. ``request.user`` is the
    token's Django user (a person; the team it acts for is chosen per route), ``request.auth``
    the token. No header: the next class decides; another scheme, or an unknown token: 401."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "").strip()
        if not header:
            return None
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip().startswith(AccessToken.PREFIX):
            raise exceptions.AuthenticationFailed("expected Authorization: Bearer <access token (sk_e2b_…)>")
        token = find_token(raw)
        if token is None:
            raise exceptions.AuthenticationFailed("invalid access token")
        return token.user, token

    def authenticate_header(self, request):
        return 'Bearer realm="aenv"'


class OperatorPrincipal:
    """What ``request.user`` is for an ``X-Admin-Token`` request: the platform's operator,
    no team (a view that takes it must never reach for ``request.user.team``)."""

    is_authenticated = True
    is_anonymous = False
    is_operator = True
    team = None
    team_id = None

    def __str__(self) -> str:
        return "operator"


class AdminTokenAuthentication(authentication.BaseAuthentication):
    """E2B's ``AdminTokenAuth``: ``X-Admin-Token`` equal to ``AENV_ADMIN_TOKEN``. No header:
    the next class decides (a team's key); a wrong token, or none configured: 401. Why a
    token and not a team's key: operators see every team's load and the nodes' addresses,
    which no tenant's key may."""

    header = "HTTP_X_ADMIN_TOKEN"

    def authenticate(self, request):
        raw = request.META.get(self.header)
        if raw is None:
            return None
        expected = settings.AENV_ADMIN_TOKEN
        if not expected or not hmac.compare_digest(raw.strip().encode(), expected.encode()):
            raise exceptions.AuthenticationFailed("invalid admin token")
        return OperatorPrincipal(), None

    def authenticate_header(self, request):
        return "X-Admin-Token"


class IsOperator(permissions.BasePermission):
    """Operator-only routes (managing join tokens, revoking nodes): a team's key is refused
    (403); what a tenant's key can do must never add machines to the shared fleet."""

    message = "only operators (X-Admin-Token) may do this"

    def has_permission(self, request, view):
        return bool(getattr(request.user, "is_operator", False))


class NodeSecret:
    """What ``request.user`` is on the nodes' own routes: the bearer secret, unchecked; the
    view hands it to ``nodes.join`` (a join token, or a node's credential)."""

    is_authenticated = True
    is_anonymous = False
    is_operator = False
    team = None
    team_id = None

    def __init__(self, secret: str):
        self.secret = secret

    def __str__(self) -> str:
        return "node"


class NodeBearerAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <secret>`` on ``POST /nodes/join`` and ``/nodes/check-in``;
    none: 401."""

    def authenticate(self, request):
        scheme, _, secret = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise exceptions.NotAuthenticated("missing Authorization: Bearer header")
        return NodeSecret(secret.strip()), None

    def authenticate_header(self, request):
        return 'Bearer realm="aenv-node"'


class OptionalNodeBearerAuthentication(NodeBearerAuthentication):
    """The same header, but optional: ``POST /nodes/join`` may carry a Kubernetes pod's
    token in its body instead (the view asks for one or the other)."""

    def authenticate(self, request):
        if not request.META.get("HTTP_AUTHORIZATION", "").strip():
            return None
        return super().authenticate(request)
