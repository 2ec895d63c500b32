"""Every change to a team's secrets, and the checks on what a request gives (E2B's rules where
its SDK states them, aenv's where it is silent). Callers (the API, the dashboard) only call
these; nothing here returns a value once it is sealed.

- name: lower-cased (E2B's canonical form); letters, digits, ``.``, ``_``, ``-``, 1..128
  characters, starting with a letter or digit; not ``sec_…`` (E2B reserves it for ids). A
  name goes into the marker ``${e2b.secrets.NAME}``, so braces, spaces and control characters
  never belong in one.
- value: a non-empty string of at most ``MAX_VALUE_BYTES`` (UTF-8) without CR, LF or NUL: it
  is put into HTTP headers, where those would split or end the header.
- metadata: string to string, at most 32 entries, keys at most 128 bytes, values 1024, all
  of it 8192 (E2B's limits).
- versions: each update stores a new version and makes it current; the newest
  ``KEEP_VERSIONS`` are kept."""
from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from sandboxes.errors import Conflict, Invalid, NotFound
from sandboxes.models import Team
from team_secrets import crypto
from team_secrets.models import ID_PREFIX, Secret, SecretVersion

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
MAX_VALUE_BYTES = 16384
MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_METADATA_TOTAL = 32, 128, 1024, 8192
KEEP_VERSIONS = 100
MAX_PAGE = 100


def _utf8(text: str, what: str) -> None:
    """A JSON string may carry lone surrogates (``"\\ud800"``), which no UTF-8 holds: a 400 here,
    not an encoding error (whose text would quote the value) further on."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise Invalid(f"{what} is not valid Unicode (a lone surrogate)") from None


def checked_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise Invalid("name must be a non-empty string")
    _utf8(name, "name")
    name = name.lower()
    if name.startswith(ID_PREFIX):
        raise Invalid(f'secret names may not start with "{ID_PREFIX}": it marks secret ids')
    if not NAME.fullmatch(name):
        raise Invalid("a secret name has 1 to 128 letters, digits, '.', '_' or '-' and starts with a letter or digit")
    return name


def checked_value(value) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid("value must be a non-empty string")
    _utf8(value, "value")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise Invalid(f"value is longer than {MAX_VALUE_BYTES} bytes")
    if any(c in value for c in "\r\n\0"):
        raise Invalid("value may not contain CR, LF or NUL: it is sent in HTTP headers")
    return value


def checked_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise Invalid("metadata must be an object of strings")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise Invalid(f"metadata has at most {MAX_METADATA_ENTRIES} entries")
    total = 0
    for key, value in metadata.items():
        _utf8(key + value, "metadata")
        if len(key.encode()) > MAX_METADATA_KEY or len(value.encode()) > MAX_METADATA_VALUE:
            raise Invalid(f"metadata keys have at most {MAX_METADATA_KEY} bytes and values {MAX_METADATA_VALUE}")
        total += len(key.encode()) + len(value.encode())
    if total > MAX_METADATA_TOTAL:
        raise Invalid(f"metadata has at most {MAX_METADATA_TOTAL} bytes in all")
    return dict(metadata)


def find(team: Team, ref: str) -> Secret:
    """The team's secret with this id or (case-insensitive) name; NotFound otherwise, another
    team's included."""
    if isinstance(ref, str) and ref:
        found = Secret.objects.filter(team=team).filter(Q(pk=ref) | Q(name=ref.lower())).first()
        if found is not None:
            return found
    raise NotFound(f'secret "{ref}" not found', retry=False)


def _add_version(secret: Secret, version: int, value: str) -> None:
    sealed, key_id = crypto.seal(value, secret.pk, version)
    SecretVersion.objects.create(secret=secret, version=version, sealed=sealed, key_id=key_id)


def create(team: Team, name, value, metadata=None) -> Secret:
    name, value, metadata = checked_name(name), checked_value(value), checked_metadata(metadata)
    try:
        with transaction.atomic():
            now = timezone.now()
            secret = Secret.objects.create(team=team, name=name, metadata=metadata, current_version=1,
                                           created_at=now, updated_at=now)
            _add_version(secret, 1, value)
    except IntegrityError:
        raise Conflict(f'a secret named "{name}" already exists', retry=False) from None
    return secret


def update(team: Team, ref: str, value, metadata=None) -> Secret:
    """A new version with ``value``, made current; ``metadata`` (when given) replaces the old."""
    value = checked_value(value)
    metadata = checked_metadata(metadata) if metadata is not None else None
    with transaction.atomic():
        secret = find(team, ref)
        secret = Secret.objects.select_for_update().get(pk=secret.pk)
        secret.current_version += 1
        secret.updated_at = timezone.now()
        if metadata is not None:
            secret.metadata = metadata
        secret.save(update_fields=["current_version", "updated_at", "metadata"])
        _add_version(secret, secret.current_version, value)
        SecretVersion.objects.filter(secret=secret, version__lte=secret.current_version - KEEP_VERSIONS).delete()
    return secret


def destroy(team: Team, ref: str) -> None:
    """The secret and every version of it are deleted (E2B: all versions inaccessible)."""
    find(team, ref).delete()


def versions(team: Team, ref: str) -> list[SecretVersion]:
    return list(find(team, ref).versions.defer("sealed").order_by("-version"))


def current_value(secret: Secret) -> str:
    """The current version's value (for the node's resolve only; never for an answer to a team)."""
    row = SecretVersion.objects.get(secret=secret, version=secret.current_version)
    return crypto.open_sealed(row.sealed, row.key_id, secret.pk, row.version)


@dataclass
class Page:
    items: list
    next_token: str | None


def _token(secret: Secret) -> str:
    raw = json.dumps([secret.created_at.isoformat(), secret.pk]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _untoken(token: str) -> tuple[datetime, str]:
    try:
        stamp, pk = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        when = datetime.fromisoformat(stamp)
        if not isinstance(pk, str) or when.tzinfo is None:
            raise ValueError("bad token")
        return when, pk
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise Invalid("invalid nextToken", retry=False) from None


def listed(team: Team, limit: int = MAX_PAGE, next_token: str | None = None) -> Page:
    """The team's secrets, newest first, keyset-paginated."""
    qs = Secret.objects.filter(team=team).order_by("-created_at", "-id")
    if next_token:
        when, pk = _untoken(next_token)
        qs = qs.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=pk))
    rows = list(qs[:limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, _token(rows[-1]) if more and rows else None)
