"""X-API-Key authentication for the E2B API. Keys are looked up by their hash."""
from django.utils import timezone
from rest_framework import authentication, exceptions

from .models import ApiKey, hash_api_key


class ApiKeyPrincipal:
    """What `request.user` is for an API-key request: the key's team, never a person."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, api_key: ApiKey):
        self.api_key = api_key
        self.team = api_key.team
        self.team_id = api_key.team_id

    def __str__(self) -> str:
        return f"apikey:{self.api_key.prefix}"


class ApiKeyAuthentication(authentication.BaseAuthentication):
    header = "HTTP_X_API_KEY"

    def authenticate(self, request):
        raw = request.META.get(self.header)
        if not raw:
            raise exceptions.NotAuthenticated("missing X-API-Key header")
        key = (
            ApiKey.objects.select_related("team")
            .filter(key_hash=hash_api_key(raw.strip()), revoked_at__isnull=True)
            .first()
        )
        if key is None:
            raise exceptions.AuthenticationFailed("invalid API key")
        now = timezone.now()
        if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        return ApiKeyPrincipal(key), key

    def authenticate_header(self, request):
        # Makes DRF answer 401 (not 403) for missing/invalid keys.
        return "X-API-Key"
