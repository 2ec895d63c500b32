"""The COPY file flow: ``GET /templates/{id}/files/{hash}`` answers whether the team
already has that archive and where to PUT it; the PUT (no API key: the URL's signed token
names the team and the hash) stores it.

Archives are kept per (team, hash) and serve every template of the team. An upload is
spooled to a file, checked the way the builder will read it (a tar, gzipped or plain,
nothing outside the build context, bounded unpacked size), then moved or uploaded whole
into the file store and recorded: concurrent PUTs of one hash both succeed and leave one
complete copy."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

from channels.db import database_sync_to_async
from django.conf import settings
from django.core import signing
from django.utils import timezone

from sandboxes.errors import Forbidden, Invalid, Unavailable
from sandboxes.models import Team, Template

from template_builds import files
from template_builds.models import TemplateFile
from lifecycle.templates.common import HIDE, team_template

log = logging.getLogger(__name__)

UPLOAD_PATH = "/template-files/"


@dataclass
class UploadLink:
    present: bool
    url: str


def check_hash(files_hash: str) -> str:
    if not files.HASH.match(files_hash or ""):
        raise Invalid(f"invalid files hash '{files_hash}': 64 lowercase hex digits (SHA-256) expected")
    return files_hash


def upload_url(base_url: str, team: Team, files_hash: str, template_id: str = "") -> str:
    token = files.upload_token(team.pk, files_hash, template_id)
    base = (settings.AENV_TEMPLATE_UPLOAD_BASE_URL or base_url).rstrip("/")
    return f"{base}{UPLOAD_PATH}{files_hash}?token={quote(token, safe='')}"


async def upload_link(team: Team, template_ref: str, files_hash: str, base_url: str) -> UploadLink:
    """Whether (team, hash) is stored, and always a URL to PUT it to (the SDK uses it only
    when the archive is missing, or the step says ``forceUpload``)."""
    check_hash(files_hash)
    template = await team_template(team, template_ref, others=HIDE)
    present = await _present(team, files_hash)
    return UploadLink(present, upload_url(base_url, team, files_hash, template.pk))


def _present_sync(team: Team, files_hash: str) -> bool:
    if not TemplateFile.objects.filter(team=team, hash=files_hash).exists():
        return False
    try:
        return files.get_file_store().exists(team.pk, files_hash)
    except files.FileStoreError as exc:
        raise Unavailable(str(exc)) from exc


# The store may be slow (S3): off the request's thread, on the loop's default executor. That
# thread outlives the request, and Django closes a request's connection only on the request's
# own thread, so the call closes (with PostgreSQL: gives back to the pool) what it opened there
# (channels' database_sync_to_async): else each such thread kept a connection for its life.
_present = database_sync_to_async(_present_sync, thread_sensitive=False)


def upload_team(token: str, files_hash: str) -> tuple[Team, str]:
    """The team an upload URL was made for, and the template it was asked for; Forbidden
    when the token is not valid for this hash (expired, altered, or for another hash)."""
    check_hash(files_hash)
    try:
        team_id, template_id = files.check_upload_token(token or "", files_hash, settings.AENV_TEMPLATE_UPLOAD_URL_TTL)
    except signing.SignatureExpired:
        raise Forbidden("the upload URL has expired; ask for a new one") from None
    except (signing.BadSignature, ValueError, TypeError):  # TypeError/ValueError: a payload of another shape
        raise Forbidden("invalid upload URL") from None
    team = Team.objects.filter(pk=team_id).first()
    if team is None:
        raise Forbidden("invalid upload URL (its team is gone)")
    return team, template_id


def receive_upload(token: str, files_hash: str, chunks) -> TemplateFile:
    """Stores the archive read from ``chunks`` (an iterable of bytes) for the team the
    token names. Synchronous: run it in a thread. Invalid for a bad archive, Forbidden for
    a bad token, Unavailable when the store fails."""
    team, template_id = upload_team(token, files_hash)
    store = files.get_file_store()
    path, size = None, 0
    try:
        path, size = files.spool(chunks, store.staging_dir(), settings.AENV_TEMPLATE_FILE_MAX_BYTES)
        compressed = files.check_archive(path, settings.AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES)
        store.save(team.pk, files_hash, path)
        path = None
    except files.InvalidArchive as exc:
        raise Invalid(f"invalid upload: {exc}") from None
    except (files.FileStoreError, OSError) as exc:
        raise Unavailable(f"cannot store the upload: {exc}") from exc
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
    template = Template.objects.filter(pk=template_id).first() if template_id else None
    row, created = TemplateFile.objects.get_or_create(
        team=team, hash=files_hash, defaults=dict(size_bytes=size, gzip=compressed, template=template))
    if not created:
        TemplateFile.objects.filter(pk=row.pk).update(size_bytes=size, gzip=compressed, updated_at=timezone.now())
    log.info("template files %s of team %s stored (%d bytes, gzip=%s)", files_hash, team.slug, size, compressed)
    return row
