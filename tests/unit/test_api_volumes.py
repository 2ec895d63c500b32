"""E2B's ``/volumes`` and ``/volumecontent`` on the real ASGI app: the wire models, names,
team scoping (another team's volume is unknown), the content API's per-volume token (and
nothing else) as its only key, bounded bodies, every refusal as ``{code, message}``, the 409
for deleting a volume a live sandbox or a snapshot mounts, and ``volumeMounts`` at create
(E2B's 400s; refused while the nodes have no transport)."""
import uuid

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from sandboxes.models import Sandbox
from snapshots.models import Snapshot
from volumes import store
from volumes.models import SandboxVolume, SnapshotVolume, Volume

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _volumes_dir(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"


async def make(api, name="data") -> dict:
    resp = await api.post("/volumes", json={"name": name})
    assert resp.status_code == 201, resp.text
    return resp.json()


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}", "X-API-Key": ""}


async def test_create_list_get_delete(api, team):
    made = await make(api, "my-data_1")
    assert set(made) == {"volumeID", "name", "token"} and made["name"] == "my-data_1"
    assert str(uuid.UUID(made["volumeID"])) == made["volumeID"] and len(made["token"]) >= 32
    volume = await Volume.objects.aget(pk=made["volumeID"])
    assert volume.team_id == team.pk
    assert store.volume_root(team.pk, volume.id).is_dir()
    assert (await api.get("/volumes")).json() == [{"volumeID": made["volumeID"], "name": "my-data_1"}]
    assert (await api.get(f"/volumes/{made['volumeID']}")).json() == made
    resp = await api.delete(f"/volumes/{made['volumeID']}")
    assert resp.status_code == 204
    assert not store.volume_root(team.pk, volume.id).exists()
    assert (await api.get("/volumes")).json() == []


@pytest.mark.parametrize("body", [{"name": ""}, {"name": "a b"}, {"name": "a/b"}, {"name": "../x"}, {"name": "é"},
                                  {"name": "x" * 129}, {"name": 5}, {}, {"name": None}])
async def test_bad_names_are_400(api, assert_error, body):
    assert_error(await api.post("/volumes", json=body), 400)
    assert await Volume.objects.acount() == 0


async def test_a_name_is_unique_per_team(api, assert_error, asgi_app, other_key):
    await make(api, "shared")
    assert_error(await api.post("/volumes", json={"name": "shared"}), 400, "already exists")
    resp = await api.post("/volumes", json={"name": "shared"}, headers={"X-API-Key": other_key})
    assert resp.status_code == 201  # another team's namespace


async def test_another_teams_volume_is_unknown(api, assert_error, other_key):
    made = await make(api)
    other = {"X-API-Key": other_key}
    assert (await api.get("/volumes", headers=other)).json() == []
    assert_error(await api.get(f"/volumes/{made['volumeID']}", headers=other), 404)
    assert_error(await api.delete(f"/volumes/{made['volumeID']}", headers=other), 404)
    assert_error(await api.get("/volumes/no-such-volume"), 404)
    assert await Volume.objects.acount() == 1


async def test_volumes_need_an_api_key(anon, assert_error):
    assert_error(await anon.get("/volumes"), 401)
    assert_error(await anon.post("/volumes", json={"name": "x"}), 401)


def _sandbox(team, base_template, state):
    now = timezone.now()
    return Sandbox.objects.create(team=team, template=base_template, state=state, end_at=now)


@pytest.mark.parametrize("state", ["running", "paused", "creating", "pausing"])
async def test_delete_while_mounted_is_409(api, assert_error, team, base_template, state):
    made = await make(api)
    sandbox = await sync_to_async(_sandbox)(team, base_template, state)
    await SandboxVolume.objects.acreate(sandbox=sandbox, volume_id=made["volumeID"], path="/data")
    assert_error(await api.delete(f"/volumes/{made['volumeID']}"), 409, sandbox.id)
    assert await Volume.objects.acount() == 1
    await Sandbox.objects.filter(pk=sandbox.pk).aupdate(state="killed")
    assert (await api.delete(f"/volumes/{made['volumeID']}")).status_code == 204


async def test_delete_while_a_snapshot_mounts_it_is_409(api, assert_error, team, base_template):
    made = await make(api)
    snap = await Snapshot.objects.acreate(team=team, template=base_template, state="ready")
    await SnapshotVolume.objects.acreate(snapshot=snap, volume_id=made["volumeID"], path="/data")
    assert_error(await api.delete(f"/volumes/{made['volumeID']}"), 409, snap.id)
    await Snapshot.objects.filter(pk=snap.pk).aupdate(state="error")  # never restorable: no longer a user
    assert (await api.delete(f"/volumes/{made['volumeID']}")).status_code == 204


# --------------------------------------------------------------------------- content API


async def test_content_roundtrip(api):
    made = await make(api)
    v, auth = made["volumeID"], bearer(made["token"])
    resp = await api.put(f"/volumecontent/{v}/file", params={"path": "/dir/a.txt", "mode": 0o640},
                         content=b"hello", headers={**auth, "Content-Type": "application/octet-stream"})
    assert resp.status_code == 201, resp.text
    entry = resp.json()
    assert entry["path"] == "/dir/a.txt" and entry["size"] == 5 and entry["type"] == "file" and entry["mode"] == 0o640
    assert set(entry) == {"name", "type", "path", "size", "mode", "uid", "gid", "atime", "mtime", "ctime"}
    got = await api.get(f"/volumecontent/{v}/file", params={"path": "/dir/a.txt"}, headers=auth)
    assert got.status_code == 200 and got.content == b"hello"
    assert got.headers["content-type"] == "application/octet-stream"
    assert (await api.get(f"/volumecontent/{v}/path", params={"path": "/dir"}, headers=auth)).json()["type"] == \
        "directory"
    listed = await api.get(f"/volumecontent/{v}/dir", params={"path": "/", "depth": 2}, headers=auth)
    assert [e["path"] for e in listed.json()] == ["/dir", "/dir/a.txt"]
    made_dir = await api.post(f"/volumecontent/{v}/dir", params={"path": "/x/y", "force": "true"}, headers=auth)
    assert made_dir.status_code == 201 and made_dir.json()["type"] == "directory"
    patched = await api.patch(f"/volumecontent/{v}/path", params={"path": "/dir/a.txt"}, json={"mode": 0o600},
                              headers=auth)
    assert patched.status_code == 200 and patched.json()["mode"] == 0o600
    assert (await api.delete(f"/volumecontent/{v}/path", params={"path": "/dir"}, headers=auth)).status_code == 204
    assert (await api.get(f"/volumecontent/{v}/path", params={"path": "/dir"}, headers=auth)).status_code == 404


async def test_content_refusals(api, assert_error, settings):
    made = await make(api)
    v, auth = made["volumeID"], bearer(made["token"])
    assert_error(await api.get(f"/volumecontent/{v}/file", params={"path": "/missing"}, headers=auth), 404)
    assert_error(await api.get(f"/volumecontent/{v}/file", headers=auth), 400)  # no path
    assert_error(await api.get(f"/volumecontent/{v}/path", params={"path": "/../etc/passwd"}, headers=auth), 400)
    assert_error(await api.post(f"/volumecontent/{v}/dir", params={"path": "/a/b"}, headers=auth), 404)
    assert_error(await api.get(f"/volumecontent/{v}/dir", params={"path": "/", "depth": 0}, headers=auth), 400)
    assert_error(await api.post(f"/volumecontent/{v}/dir", params={"path": "/m", "mode": 0o10000}, headers=auth), 400)
    assert_error(await api.delete(f"/volumecontent/{v}/path", params={"path": "/"}, headers=auth), 400)
    assert_error(await api.patch(f"/volumecontent/{v}/path", params={"path": "/"}, json=[1], headers=auth), 400)
    settings.AENV_VOLUME_MAX_FILE_BYTES = 8
    big = await api.put(f"/volumecontent/{v}/file", params={"path": "/big"}, content=b"123456789",
                        headers={**auth, "Content-Type": "application/octet-stream"})
    assert_error(big, 413)

    def chunked(*parts):
        async def gen():
            for part in parts:
                yield part
        return gen()

    # the TypeScript SDK streams its uploads without a length: spooled, within the same limit
    ok = await api.put(f"/volumecontent/{v}/file", params={"path": "/c"}, content=chunked(b"abc", b"de"),
                       headers={**auth, "Content-Type": "application/octet-stream"})
    assert ok.status_code == 201 and ok.json()["size"] == 5
    assert (await api.get(f"/volumecontent/{v}/file", params={"path": "/c"}, headers=auth)).content == b"abcde"
    assert_error(await api.put(f"/volumecontent/{v}/file", params={"path": "/c"}, content=chunked(b"12345", b"6789"),
                               headers={**auth, "Content-Type": "application/octet-stream"}), 413)
    assert (await api.get(f"/volumecontent/{v}/file", params={"path": "/c"}, headers=auth)).content == b"abcde"
    assert_error(await api.get(f"/volumecontent/{v}/path", params={"path": "/big"}, headers=auth), 404)


async def test_content_needs_that_volumes_token(api, assert_error, other_key):
    mine, theirs = await make(api, "mine"), await make(api, "theirs")
    url = f"/volumecontent/{mine['volumeID']}/dir"
    q = {"path": "/"}
    assert_error(await api.get(url, params=q), 401)  # an API key is not the volume's token
    assert_error(await api.get(url, params=q, headers={"Authorization": "Bearer "}), 401)
    assert_error(await api.get(url, params=q, headers=bearer(theirs["token"])), 401)  # another volume's
    assert_error(await api.get(url, params=q, headers={"Authorization": f"Basic {mine['token']}"}), 401)
    assert_error(await api.get("/volumecontent/no-such/dir", params=q, headers=bearer(mine["token"])), 401)
    assert (await api.get(url, params=q, headers=bearer(mine["token"]))).status_code == 200
    # a deleted volume's token opens nothing
    await api.delete(f"/volumes/{mine['volumeID']}")
    assert_error(await api.get(url, params=q, headers=bearer(mine["token"])), 401)


# --------------------------------------------------------------------------- volumeMounts at create


@pytest.mark.parametrize("mounts, text", [
    ([{"name": "nope", "path": "/data"}], "volume 'nope' not found"),
    ([{"name": "data", "path": "data"}], "path must be absolute"),
    ([{"name": "data", "path": "/a/../b"}], "'.' or '..'"),
    ([{"name": "data", "path": "/data/"}], "'.' or '..'"),
    ([{"name": "data", "path": ""}], "path cannot be empty"),
    ([{"name": "data", "path": "/usr/local"}], "system directory"),
    ([{"name": "data", "path": "/proc"}], "system directory"),
    ([{"name": "data", "path": "/opt/aenv/x"}], "system directory"),
    ([{"name": "data", "path": "/home"}], "hide a system directory"),
    ([{"name": "data", "path": "/"}], "hide a system directory"),
    ([{"name": "data", "path": "/d"}, {"name": "data", "path": "/d"}], "already used"),
    ([{"name": "data", "path": "/d"}, {"name": "data", "path": "/d/e"}], "overlaps"),
    ([{"name": "data", "path": "/d", "readOnly": True}], "must be an object with name and path"),
    ([{"name": "data"}], "path cannot be empty"),
    ("data", "must be a list"),
    ([{"name": "data", "path": f"/m{i}"} for i in range(9)], "at most 8"),
])
async def test_bad_volume_mounts_are_400(api, nodes_mock, assert_error, mounts, text):
    await make(api, "data")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": mounts})
    assert_error(resp, 400, text)
    nodes_mock.client.boot_sandbox.assert_not_awaited()
    assert await Sandbox.objects.acount() == 0


async def test_another_teams_volume_cannot_be_mounted(api, nodes_mock, assert_error, other_key):
    await api.post("/volumes", json={"name": "theirs"}, headers={"X-API-Key": other_key})
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base",
                                                       "volumeMounts": [{"name": "theirs", "path": "/d"}]}),
                 400, "volume 'theirs' not found")


async def test_mounts_are_refused_without_a_transport(api, nodes_mock, assert_error, settings):
    settings.AENV_VOLUME_TRANSPORT = "off"
    await make(api, "data")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [{"name": "data", "path": "/d"}]})
    assert_error(resp, 400, "AENV_VOLUME_TRANSPORT=off")
    assert await Sandbox.objects.acount() == 0
    assert (await api.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": []})).status_code == 201


async def test_mounts_are_recorded_shown_and_block_a_delete(api, nodes_mock, assert_error, team):
    """The control plane's half: rows, what the node is told (where the files are, the
    export id, what the guest must mount), E2B's ``volumeMounts`` in the detail and the
    lists, and the 409 until the sandbox is killed."""
    made = await make(api, "data")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
        {"name": "data", "path": "/home/user/data"}, {"name": "data", "path": "/mnt/again"}]})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["sandboxID"]
    told = nodes_mock.client.boot_sandbox.await_args.kwargs["volumes"]
    assert told == [{"dir": f"{team.pk}/{made['volumeID']}", "export_id": 1, "path": p, "mount": True}
                    for p in ("/home/user/data", "/mnt/again")]
    wire = [{"name": "data", "path": "/home/user/data"}, {"name": "data", "path": "/mnt/again"}]
    assert (await api.get(f"/sandboxes/{sid}")).json()["volumeMounts"] == wire
    assert next(s for s in (await api.get("/v2/sandboxes")).json() if s["sandboxID"] == sid)["volumeMounts"] == wire
    assert (await api.get("/sandboxes")).json()[0]["volumeMounts"] == wire
    assert_error(await api.delete(f"/volumes/{made['volumeID']}"), 409, sid)
    assert (await api.delete(f"/sandboxes/{sid}")).status_code == 204
    assert (await api.delete(f"/volumes/{made['volumeID']}")).status_code == 204
