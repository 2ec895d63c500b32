"""The dashboard's volume pages: sign-in required, the team's volumes with the live sandboxes
and snapshots that mount them, create (the API's name rules), delete (the 409 while mounted,
its message shown; the files kept), the file browser through the content layer (a guest's
symlink listed, never followed; ``..`` refused), downloads as attachments, uploads, the
bounded size figure, and another team's volume a 404 everywhere."""
import html
import os
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from dashboard.volume_pages import volume_size
from sandboxes.models import Sandbox
from snapshots.models import Snapshot
from volumes import store
from volumes.models import SandboxVolume, SnapshotVolume, Volume

JSON = {"HTTP_ACCEPT": "application/json"}


@pytest.fixture(autouse=True)
def _volumes_dir(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"


def make(team, name="data") -> Volume:
    volume = Volume.objects.create(team=team, name=name, export_id=Volume.objects.filter(team=team).count() + 1)
    store.create_files(volume)
    return volume


def sandbox(team, template, state="running") -> Sandbox:
    return Sandbox.objects.create(team=team, template=template, state=state,
                                  end_at=timezone.now() + timedelta(minutes=5))


@pytest.mark.parametrize("path", ["/dashboard/volumes/", "/dashboard/volumes/x/",
                                  "/dashboard/volumes/x/download?path=/a"])
def test_pages_require_login(client, db, path):
    resp = client.get(path)
    assert resp.status_code == 302 and resp["Location"].startswith("/dashboard/login/")


def test_list_shows_the_teams_volumes_and_who_mounts_them(dash, team, other_team, base_template):
    vol, idle = make(team, "datasets"), make(team, "idle")
    make(other_team, "their-volume")
    live, dead = sandbox(team, base_template), sandbox(team, base_template, state="killed")
    SandboxVolume.objects.create(sandbox=live, volume=vol, path="/mnt/data")
    SandboxVolume.objects.create(sandbox=dead, volume=vol, path="/mnt/old")
    snap = Snapshot.objects.create(team=team, template=base_template, state="ready")
    SnapshotVolume.objects.create(snapshot=snap, volume=vol, path="/mnt/data")
    page = dash.get("/dashboard/volumes/").content.decode()
    assert "datasets" in page and "idle" in page and "their-volume" not in page
    assert vol.id in page and f"/dashboard/volumes/{vol.id}/" in page
    row = page[page.index(f'data-volume="{vol.id}"'):page.index(f'data-volume="{idle.id}"')]
    assert live.id in row and "/mnt/data" in row and dead.id not in row and "/mnt/old" not in row
    assert snap.id in row
    assert 'href="/dashboard/volumes/"' in dash.get("/dashboard/").content.decode()  # in the navigation


def test_create_checks_the_name_and_makes_the_directory(dash, team):
    resp = dash.post("/dashboard/volumes/create", {"name": "my-data_1"}, **JSON)
    assert resp.status_code == 201, resp.content
    volume = Volume.objects.get(team=team)
    assert volume.name == "my-data_1" and resp.json()["redirect"] == f"/dashboard/volumes/{volume.id}/"
    assert store.volume_root(team.pk, volume.id).is_dir()
    for name, why in (("my-data_1", "already exists"), ("a b", "letters, digits"), ("", "letters, digits")):
        resp = dash.post("/dashboard/volumes/create", {"name": name}, **JSON)
        assert resp.status_code == 400 and why in resp.json()["message"] and not resp.json()["ok"]
    assert Volume.objects.count() == 1
    page = dash.post("/dashboard/volumes/create", {"name": "plain-form"}, follow=True).content.decode()
    assert "Volume plain-form created." in page  # without JS: a message after the redirect


def test_delete_is_refused_while_mounted_and_keeps_the_files(dash, team, base_template):
    vol = make(team)
    store.files_of(vol).write("/keep.txt", [b"kept"], max_bytes=100)
    live = sandbox(team, base_template)
    SandboxVolume.objects.create(sandbox=live, volume=vol, path="/mnt/data")
    resp = dash.post(f"/dashboard/volumes/{vol.id}/delete", **JSON)
    assert resp.status_code == 409
    assert resp.json()["message"] == (f"Delete failed: volume 'data' is mounted by sandbox(es) {live.id}; "
                                      "kill them first")
    assert Volume.objects.filter(pk=vol.pk).exists()
    assert (store.volume_root(team.pk, vol.id) / "keep.txt").read_bytes() == b"kept"

    Sandbox.objects.filter(pk=live.pk).update(state="killed")
    resp = dash.post(f"/dashboard/volumes/{vol.id}/delete", **JSON)
    assert resp.status_code == 200 and resp.json()["ok"]
    assert not Volume.objects.filter(pk=vol.pk).exists() and not store.volume_root(team.pk, vol.id).exists()


def test_another_teams_volume_is_404_everywhere(dash, other_team):
    theirs = make(other_team, "theirs")
    store.files_of(theirs).write("/secret.txt", [b"theirs"], max_bytes=100)
    assert dash.get(f"/dashboard/volumes/{theirs.id}/").status_code == 404
    assert dash.get(f"/dashboard/volumes/{theirs.id}/download", {"path": "/secret.txt"}).status_code == 404
    resp = dash.post(f"/dashboard/volumes/{theirs.id}/delete", **JSON)
    assert resp.status_code == 404 and "not found" in resp.json()["message"]
    upload = _file("x.txt", b"mine")
    assert dash.post(f"/dashboard/volumes/{theirs.id}/upload", {"file": upload, "dir": "/"}, **JSON).status_code == 404
    assert Volume.objects.filter(pk=theirs.pk).exists()
    assert sorted(os.listdir(store.volume_root(other_team.pk, theirs.id))) == ["secret.txt"]


def test_switching_team_shows_the_other_teams_volumes(dash, user, team, other_team):
    mine, theirs = make(team, "mine"), make(other_team, "theirs")
    other_team.members.add(user)
    resp = dash.post("/dashboard/team/", {"team": "team-b", "next": f"/dashboard/volumes/{mine.id}/"})
    assert resp.status_code == 302 and resp["Location"] == "/dashboard/volumes/"  # not the old team's 404
    page = dash.get("/dashboard/volumes/").content.decode()
    assert theirs.id in page and mine.id not in page
    assert dash.get(f"/dashboard/volumes/{mine.id}/").status_code == 404
    assert dash.get(f"/dashboard/volumes/{theirs.id}/").status_code == 200


def test_browse_lists_directories_and_never_follows_a_symlink(dash, team, tmp_path):
    vol = make(team)
    files = store.files_of(vol)
    files.write("/docs/readme.md", [b"# hi"], max_bytes=100)
    files.write("/top.bin", [b"\x00" * 2048], max_bytes=4096)
    root = store.volume_root(team.pk, vol.id)
    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "inner" / "host-file").write_text("host")
    os.symlink(outside, root / "escape")  # what a guest can plant through its mount

    page = dash.get(f"/dashboard/volumes/{vol.id}/").content.decode()
    assert page.index('data-entry="docs"') < page.index('data-entry="escape"') < page.index('data-entry="top.bin"')
    assert 'data-type="symlink"' in page and f"→ {outside}" in page and "2.0\xa0KB" in page
    assert "host-file" not in page and "inner" not in page

    page = dash.get(f"/dashboard/volumes/{vol.id}/", {"path": "/docs"}).content.decode()
    assert 'data-entry="readme.md"' in page and "top.bin" not in page
    assert "/dashboard/volumes/%s/download?path=%%2Fdocs%%2Freadme.md" % vol.id in page

    page = dash.get(f"/dashboard/volumes/{vol.id}/", {"path": "/escape/inner"}).content.decode()
    assert "data-volume-error" in page and "symlink" in page and "host-file" not in page
    page = dash.get(f"/dashboard/volumes/{vol.id}/", {"path": "/docs/../.."}).content.decode()
    assert "data-volume-error" in page and "must not contain '.' or '..' components" in html.unescape(page)
    page = dash.get(f"/dashboard/volumes/{vol.id}/", {"path": "/nope"}).content.decode()
    assert "path /nope not found" in page


def test_download_streams_a_regular_file_as_an_attachment(dash, team):
    vol = make(team)
    files = store.files_of(vol)
    body = os.urandom(3 * (1 << 20) + 5)  # more than one chunk
    files.write("/out/data é.bin", [body], max_bytes=len(body))
    os.symlink("/etc/passwd", store.volume_root(team.pk, vol.id) / "passwd")
    resp = dash.get(f"/dashboard/volumes/{vol.id}/download", {"path": "/out/data é.bin"})
    assert resp.status_code == 200 and resp.streaming
    assert async_to_sync(_read)(resp) == body
    assert resp["Content-Type"] == "application/octet-stream" and resp["Content-Length"] == str(len(body))
    assert resp["Content-Disposition"].startswith("attachment;") and "data%20%C3%A9.bin" in resp["Content-Disposition"]
    files.write("/two\nlines\r.txt", [b"odd"], max_bytes=10)  # a name a guest may choose
    resp = dash.get(f"/dashboard/volumes/{vol.id}/download", {"path": "/two\nlines\r.txt"})
    assert resp.status_code == 200 and resp["Content-Disposition"] == 'attachment; filename="two_lines_.txt"'
    assert async_to_sync(_read)(resp) == b"odd"
    for path in ("/passwd", "/out", "/missing", "/../etc/passwd"):
        assert dash.get(f"/dashboard/volumes/{vol.id}/download", {"path": path}).status_code == 404, path


async def _read(resp) -> bytes:
    return b"".join([chunk async for chunk in resp.streaming_content])  # an async stream, as ASGI serves it


def _file(name: str, data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile  # noqa: PLC0415

    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def test_upload_writes_into_the_directory_shown(dash, team, tmp_path):
    vol = make(team)
    root = store.volume_root(team.pk, vol.id)
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"file": _file("a.txt", b"one"), "dir": "/sub/dir"}, **JSON)
    assert resp.status_code == 201 and resp.json()["redirect"] == f"/dashboard/volumes/{vol.id}/?path=%2Fsub%2Fdir"
    assert (root / "sub" / "dir" / "a.txt").read_bytes() == b"one"
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"file": _file("a.txt", b"two"), "dir": "/sub/dir"}, **JSON)
    assert resp.status_code == 201 and (root / "sub" / "dir" / "a.txt").read_bytes() == b"two"  # replaced
    # a client-side name with path parts lands in the directory under its last part only
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"file": _file("../../evil.txt", b"x"), "dir": "/"},
                     **JSON)
    assert resp.status_code == 201 and (root / "evil.txt").read_bytes() == b"x"
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"file": _file("b.txt", b"x"), "dir": "/../up"}, **JSON)
    assert resp.status_code == 400 and "'..'" in resp.json()["message"]
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"dir": "/"}, **JSON)
    assert resp.status_code == 400 and resp.json()["message"] == "Choose a file to upload."
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")  # a guest's symlink: never written through
    resp = dash.post(f"/dashboard/volumes/{vol.id}/upload", {"file": _file("c.txt", b"x"), "dir": "/link"}, **JSON)
    assert resp.status_code == 400 and resp.json()["message"] == "Upload failed: a component of /link is not a directory"
    assert list(outside.iterdir()) == []


def test_size_adds_up_regular_files_and_says_when_it_stopped(team, tmp_path):
    vol = make(team)
    files = store.files_of(vol)
    for i in range(5):
        files.write(f"/d/f{i}", [b"x" * 100], max_bytes=100)
    os.symlink(tmp_path, store.volume_root(team.pk, vol.id) / "d" / "loop")  # not entered, not counted
    root = store.volume_root(team.pk, vol.id)
    assert volume_size(root) == {"bytes": 500, "files": 5, "complete": True}
    partial = volume_size(root, limit=3)
    assert not partial["complete"] and partial["files"] < 5
