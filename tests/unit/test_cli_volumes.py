"""``aenv volume`` against the real API on a port (the volume and content APIs need no VM):
create, list (JSON piped, a table asked), a volume by name or id, files in and out (a file, a
tree, where they land, nothing replaced without --force, symlinks refused both ways), mkdir,
the 409 of a delete while a sandbox mounts the volume (exit 5, its message), unknown volumes
(exit 4), and ``start -v NAME:/path`` sending E2B's ``volumeMounts``."""
import json
import os

import pytest

from sandboxes.models import Sandbox
from volumes import store
from volumes.models import SandboxVolume, Volume
from tests.unit.test_cli_sandboxes import _cells, cli  # noqa: F401 - fixture
from tests.unit.test_template_builds_sdk import server  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _volumes_dir(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"


async def _create(cli, name: str) -> Volume:  # noqa: F811
    code, out, err = await cli("volume", "create", name)
    assert code == 0, err
    return await Volume.objects.aget(pk=out.strip())


async def test_create_list_and_delete(cli, team):  # noqa: F811
    data = await _create(cli, "data")
    await _create(cli, "more_2")
    assert data.team_id == team.pk and store.volume_root(team.pk, data.id).is_dir()
    code, out, err = await cli("volume", "ls")
    assert code == 0, err
    assert sorted(v["name"] for v in json.loads(out)) == ["data", "more_2"]  # piped: JSON
    code, out, _ = await cli("volume", "list", "-o", "table")
    header, *rows = _cells(out)
    assert header == ["NAME", "VOLUME ID"] and ["data", data.id] in rows
    code, out, _ = await cli("volume", "create", "-o", "json", "third")
    assert code == 0 and set(json.loads(out)) == {"volumeID", "name"}  # the content token is not printed

    code, _, err = await cli("volume", "create", "data")
    assert code == 2 and "already exists" in err
    code, _, err = await cli("volume", "create", "no spaces")
    assert code == 2 and "letters, digits" in err

    assert await cli("volume", "rm", "data", "third") == (0, f"Deleted volume data ({data.id})\n" + (
        f"Deleted volume third ({json.loads(out)['volumeID']})\n"), "")
    assert not store.volume_root(team.pk, data.id).exists()
    code, out, err = await cli("vol", "rm", "-o", "json", "nope", "more_2")
    assert code == 4 and err == "aenv: nope: 404: volume 'nope' not found\n"
    assert [r["ok"] for r in json.loads(out)] == [False, True]
    assert await Volume.objects.acount() == 0


async def test_a_mounted_volume_is_not_deleted(cli, team, base_template):  # noqa: F811
    vol = await _create(cli, "busy")
    code, out, err = await cli("start", "-d", "-v", "busy:/home/user/data", "--volume", "busy:/mnt/b")
    assert code == 0, err
    sid = out.strip()
    mounts = [m async for m in SandboxVolume.objects.filter(sandbox_id=sid).order_by("path").values_list(
        "volume__name", "path")]
    assert mounts == [("busy", "/home/user/data"), ("busy", "/mnt/b")]
    code, _, err = await cli("volume", "rm", vol.id)
    assert code == 5 and f"is mounted by sandbox(es) {sid}; kill them first" in err
    assert await Volume.objects.filter(pk=vol.pk).aexists()
    await Sandbox.objects.filter(pk=sid).aupdate(state="killed")
    assert (await cli("volume", "rm", vol.id))[0] == 0
    code, _, err = await cli("start", "-d", "-v", "busy")
    assert code == 2 and "VOLUME:/absolute/path" in err


async def test_files_in_and_out(cli, team, tmp_path):  # noqa: F811
    vol = await _create(cli, "files")
    root = store.volume_root(team.pk, vol.id)
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.bin").write_bytes(os.urandom(3 << 20))  # more than one chunk
    (src / "sub" / "deeper" / "c").write_text("c")

    assert await cli("volume", "put", "files", str(src / "a.txt")) == (0, f"Uploaded {src / 'a.txt'} to files:/a.txt\n",
                                                                       "")
    assert (root / "a.txt").read_text() == "alpha"
    code, out, err = await cli("volume", "put", vol.id, str(src), "/trees/")
    assert code == 0 and "Uploaded directory" in out and "3 files" in out, err
    assert (root / "trees" / "src" / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    code, _, err = await cli("volume", "put", "files", str(src), "/a.txt")
    assert code == 5 and "not a directory" in err

    code, out, _ = await cli("volume", "ls", "files", "/trees/src", "--depth", "3")
    assert sorted(e["path"] for e in json.loads(out)) == ["/trees/src/a.txt", "/trees/src/sub", "/trees/src/sub/b.bin",
                                                          "/trees/src/sub/deeper", "/trees/src/sub/deeper/c"]
    os.symlink("/etc", root / "link")  # as a guest could make one
    code, out, _ = await cli("volume", "ls", "files", "-o", "table")
    rows = {r[-1]: r for r in _cells(out)[1:]}
    assert rows["/a.txt"][:2] == ["file", "5 B"] and rows["/trees/"][0] == "dir" and rows["/link -> /etc"][0] == "link"

    dest = tmp_path / "dest"
    dest.mkdir()
    assert (await cli("volume", "get", "files", "/a.txt", str(dest)))[0] == 0
    assert (dest / "a.txt").read_text() == "alpha"
    code, _, err = await cli("volume", "get", "files", "/a.txt", str(dest))
    assert code == 5 and "--force" in err
    (root / "a.txt").write_text("changed")
    assert (await cli("volume", "get", "files", "a.txt", str(dest), "--force"))[0] == 0
    assert (dest / "a.txt").read_text() == "changed"
    code, out, err = await cli("volume", "get", "files", "/trees/src", str(dest))
    assert code == 0 and "3 files" in out, err
    assert (dest / "src" / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    assert (dest / "src" / "sub" / "deeper" / "c").read_text() == "c"
    assert not [p for p in dest.rglob(".*")]  # no temporary file left

    code, _, err = await cli("volume", "get", "files", "/link", str(dest))
    assert code == 2 and "symbolic links are not supported: /link" in err
    code, _, err = await cli("volume", "get", "files", "/", str(tmp_path / "all"))
    assert code == 2 and "symbolic links" in err and not (tmp_path / "all").exists()  # refused before anything moved
    code, _, err = await cli("volume", "get", "files", "/missing", str(dest))
    assert code == 4 and "does not exist" in err
    code, _, err = await cli("volume", "ls", "nope")
    assert code == 4 and "volume 'nope' not found" in err

    assert await cli("volume", "mkdir", "files", "/x/y", "-p") == (0, "Made files:/x/y\n", "")
    assert (root / "x" / "y").is_dir()
    code, _, err = await cli("volume", "mkdir", "files", "/q/r")
    assert code == 4, err
    code, _, err = await cli("volume", "put", "files", str(src / "a.txt"), "/link/escape.txt")
    assert code == 2 and "not a directory" in err and not os.path.exists("/etc/escape.txt")
