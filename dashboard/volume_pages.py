"""The team's volumes in the dashboard: the list (who mounts each), create, delete (refused
with the API's 409 while a live sandbox or a snapshot mounts it, the message shown as is), and
a file browser with download and a small upload.

Why through ``volumes.content`` (as the content API): guests write into the same directory,
so a volume may hold symlinks or special files a hostile guest planted; the content layer walks
every path without following a symlink, lists them as what they are, and reads only regular
files. Downloads are attachments of type octet-stream, never rendered. Another team's volume
is a 404 like an unknown one."""
from __future__ import annotations

import os
import posixpath
import stat
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_GET, require_POST

from api.errors import status_of
from lifecycle.volumes import records
from sandboxes.errors import LifecycleError
from sandboxes.states import LIVE
from snapshots.states import LIVE as SNAPSHOT_LIVE
from volumes import content, store
from volumes.models import SandboxVolume, SnapshotVolume, Volume

from dashboard.actions import _create_result
from dashboard.teams import current_team
from dashboard.views import _base_context, team_page

ENTRIES_SHOWN = 500      # a directory's entries on one page (the rest is counted, not shown)
SIZE_WALK_LIMIT = 20_000  # entries walked to add up a volume's size on its page


def _mounts(volume_ids) -> dict[str, dict]:
    """Per volume id: the live sandboxes that mount it (id, path, state) and the snapshots
    that hold it — what keeps a delete from going through."""
    users: dict[str, dict] = {vid: {"sandboxes": [], "snapshots": []} for vid in volume_ids}
    for m in (SandboxVolume.objects.filter(volume_id__in=volume_ids, sandbox__state__in=LIVE)
              .select_related("sandbox").order_by("sandbox__created_at", "path")):
        users[m.volume_id]["sandboxes"].append({"id": m.sandbox_id, "path": m.path, "state": m.sandbox.state})
    for m in (SnapshotVolume.objects.filter(volume_id__in=volume_ids, snapshot__state__in=SNAPSHOT_LIVE)
              .order_by("snapshot__created_at", "path")):
        users[m.volume_id]["snapshots"].append({"id": m.snapshot_id, "path": m.path})
    return users


def volume_size(root, limit: int = SIZE_WALK_LIMIT) -> dict:
    """Bytes and files under ``root``, adding up at most ``limit`` entries (a guest can make
    millions): ``complete`` says whether the figure is the whole. ``os.fwalk`` walks by
    directory fds and never enters a symlink, even one swapped in during the walk."""
    total = files = seen = 0
    try:
        for _dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
            seen += len(dirnames)
            for name in filenames:
                seen += 1
                if seen > limit:
                    return {"bytes": total, "files": files, "complete": False}
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    files += 1
            if seen > limit:
                return {"bytes": total, "files": files, "complete": False}
    except OSError:
        pass  # the root went away (a delete): what was counted
    return {"bytes": total, "files": files, "complete": True}


def _crumbs(path: str) -> list[dict]:
    """``/a/b`` → links to ``/``, ``/a``, ``/a/b``."""
    out = [{"name": "/", "path": "/"}]
    parts = content.split(path)
    for i, part in enumerate(parts):
        out.append({"name": part, "path": "/" + "/".join(parts[: i + 1])})
    return out


def _browse_path(raw: str | None) -> str:
    parts = content.split(raw or "/")  # Invalid for '..', NUL, too long
    return "/" + "/".join(parts)


# --------------------------------------------------------------------------- pages
@require_GET
@team_page
def volume_list(request):
    volumes = list(Volume.objects.filter(team=request.team).order_by("name", "id"))
    users = _mounts([v.id for v in volumes])
    rows = [{"volume": v, **users[v.id]} for v in volumes]
    return render(request, "dashboard/volumes.html", _base_context(request, "volumes", rows=rows))


@require_GET
@team_page
def volume_detail(request, volume_id):
    """The volume's facts, who mounts it, and one directory of its files (``?path=``)."""
    volume = get_object_or_404(Volume, pk=volume_id, team=request.team)
    files = store.files_of(volume)
    error, entries, entry, total = "", [], None, 0
    try:
        path = _browse_path(request.GET.get("path"))
        entry = files.stat(path)
        if entry["type"] == "directory":
            listed = files.list(path, 1, settings.AENV_VOLUME_MAX_LIST_ENTRIES)
            total = len(listed)
            # directories first, then by name (the content layer sorts by name)
            entries = sorted(listed, key=lambda e: (e["type"] != "directory", e["name"]))[:ENTRIES_SHOWN]
    except content.ContentError as exc:
        error, path = exc.message, "/"
    parent = posixpath.dirname(path) if path != "/" else None
    upload_dir = path if entry is None or entry["type"] == "directory" else parent
    return render(request, "dashboard/volume_detail.html", _base_context(
        request, "volumes", volume=volume, users=_mounts([volume.id])[volume.id], path=path, entry=entry,
        entries=entries, total=total, shown=ENTRIES_SHOWN, crumbs=_crumbs(path), parent=parent, error=error,
        upload_dir=upload_dir,
        size=volume_size(store.volume_root(volume.team_id, volume.id)),
        upload_limit=settings.AENV_API_MAX_BODY_BYTES,
    ))


def _opened(request, volume_id: str, raw_path: str | None) -> tuple[int, int, str]:
    """(fd, size, file name) of a regular file of the team's volume; 404 otherwise."""
    team = current_team(request)
    volume = Volume.objects.filter(pk=volume_id, team=team).first() if team is not None else None
    if volume is None:
        raise Http404("volume not found")
    try:
        path = _browse_path(raw_path)
        fd, size = store.files_of(volume).open_file(path)
    except content.ContentError as exc:
        raise Http404(exc.message) from None
    return fd, size, posixpath.basename(path)


@require_GET
@login_required
async def volume_download(request, volume_id):
    """A file of the volume, streamed as an attachment (never shown inline: a guest wrote it)."""
    fd, size, name = await sync_to_async(_opened)(request, volume_id, request.GET.get("path"))
    response = StreamingHttpResponse(content.VolumeFiles.async_chunks(fd), content_type="application/octet-stream")
    response["Content-Length"] = str(size)
    # a guest picks the name: no control character (a newline) may reach the header
    shown = "".join(c if c.isprintable() else "_" for c in name)
    response["Content-Disposition"] = content_disposition_header(True, shown)
    response["Cache-Control"] = "no-store"
    return response


# --------------------------------------------------------------------------- actions
def _back(volume_id: str | None = None, path: str = "/") -> str:
    if volume_id is None:
        return reverse("dashboard:volumes")
    return reverse("dashboard:volume", args=[volume_id]) + ("" if path == "/" else "?" + urlencode({"path": path}))


@require_POST
@login_required
async def volume_create(request):
    team = await sync_to_async(current_team)(request)
    if team is None:
        raise Http404("no team")
    name = (request.POST.get("name") or "").strip()
    try:
        volume = await records.create_volume(team, name)
    except LifecycleError as exc:
        return _create_result(request, _back(), "error", f"Create failed: {exc.message}", status=status_of(exc))
    return _create_result(request, _back(volume.id), "success", f"Volume {volume.name} created.", status=201,
                          volume=volume.id, redirect=_back(volume.id))


@require_POST
@login_required
async def volume_delete(request, volume_id):
    """Deletes the volume and its files; the API's 409 while something mounts it."""
    team = await sync_to_async(current_team)(request)
    if team is None:
        raise Http404("volume not found")
    try:
        await records.delete_volume(team, volume_id)
    except LifecycleError as exc:
        return _create_result(request, _back(), "error", f"Delete failed: {exc.message}", status=status_of(exc))
    return _create_result(request, _back(), "success", "Volume deleted.", status=200, redirect=_back())


def _write_upload(request, volume_id: str):
    """The sync part of an upload: the team's volume, the target directory, the write."""
    team = current_team(request)
    volume = Volume.objects.filter(pk=volume_id, team=team).first() if team is not None else None
    if volume is None:
        raise Http404("volume not found")
    upload = request.FILES.get("file")
    directory = request.POST.get("dir") or "/"
    if upload is None or not upload.name:
        return None, directory, "Choose a file to upload."
    name = posixpath.basename(upload.name.replace("\\", "/"))
    try:
        directory = _browse_path(directory)
        entry = store.files_of(volume).write(posixpath.join(directory, name), upload.chunks(),
                                             max_bytes=settings.AENV_VOLUME_MAX_FILE_BYTES)
    except content.ContentError as exc:
        return exc.status, directory, f"Upload failed: {exc.message}"
    return entry, directory, ""


@require_POST
@login_required
async def volume_upload(request, volume_id):
    """One file into a directory of the volume (created or replaced whole, as the content
    API writes). The dashboard takes bodies up to AENV_API_MAX_BODY_BYTES; larger files go
    through the content API (``aenv volume put``, the SDK)."""
    result, directory, error = await sync_to_async(_write_upload)(request, volume_id)
    back = _back(volume_id, directory)
    if error:
        return _create_result(request, back, "error", error, status=result if isinstance(result, int) else 400)
    return _create_result(request, back, "success", f"Uploaded {result['path']} ({result['size']} bytes).",
                          status=201, redirect=back)
