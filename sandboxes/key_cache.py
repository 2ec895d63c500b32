"""API keys recently looked up by this process, so a request does not build and run the
key's query again (about 1 ms of ORM work per request, issue 26's control plane).

Why it is safe: an entry lives ``AENV_API_KEY_CACHE_SECONDS`` (default 2 s) at most, and a
revocation made in this process drops it at once (``forget``, called by every revoking path
after its commit). A key revoked by another process (another API replica, a shell) is refused
there at once and here within that bound. 0 turns the cache off. Only live keys are kept:
an unknown or revoked key is looked up every time."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from django.conf import settings
from django.db.models.signals import post_delete, post_save

from sandboxes.models import ApiKey, hash_api_key

MAX_ENTRIES = 4096

_entries: "OrderedDict[str, tuple[float, ApiKey]]" = OrderedDict()
_lock = threading.Lock()


def lookup(raw: str) -> ApiKey | None:
    """The live key ``raw`` is (with its team), or None; a database read only when this
    process has not seen it live in the last ``AENV_API_KEY_CACHE_SECONDS``."""
    key_hash = hash_api_key(raw.strip())
    ttl = settings.AENV_API_KEY_CACHE_SECONDS
    now = time.monotonic()
    with _lock:
        hit = _entries.get(key_hash)
        if hit is not None and hit[0] > now:
            return hit[1]
    # unique: no ORDER BY (first() would add one, at a cost of its own in Django)
    key = next(iter(ApiKey.objects.select_related("team").filter(key_hash=key_hash, revoked_at__isnull=True)
                    .order_by()[:1]), None)
    if key is not None and ttl > 0:
        with _lock:
            _entries[key_hash] = (now + ttl, key)
            _entries.move_to_end(key_hash)
            while len(_entries) > MAX_ENTRIES:
                _entries.popitem(last=False)
    return key


def peek(raw: str) -> ApiKey | None:
    """The live key ``raw`` is if this process has it cached (no database read); else None."""
    with _lock:
        hit = _entries.get(hash_api_key(raw.strip()))
    return hit[1] if hit is not None and hit[0] > time.monotonic() else None


def forget(*key_hashes: str) -> None:
    """Drops these keys (revoked, deleted): the next request with one of them reads the database."""
    with _lock:
        for key_hash in key_hashes:
            _entries.pop(key_hash, None)


def clear() -> None:
    with _lock:
        _entries.clear()


def _dropped(sender, instance: ApiKey, **kwargs) -> None:
    forget(instance.key_hash)


# A key saved (revoked through its row) or deleted (a team's deletion cascades): dropped here.
# ``update()`` sends no signal: the revoking paths call ``forget`` themselves.
post_save.connect(_dropped, sender=ApiKey, dispatch_uid="aenv-key-cache-save")
post_delete.connect(_dropped, sender=ApiKey, dispatch_uid="aenv-key-cache-delete")
