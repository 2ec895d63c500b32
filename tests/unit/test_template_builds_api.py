"""E2B's template API through the ASGI app, with the node side mocked and a test double of
the builder reporting through ``template_builds.progress``: registration (names, tags,
limits, rebuild in place), the COPY upload flow, start (what the node gets, second start,
failures found at start), status and logs paging, resolution at create, tags, exists,
lists, publish, delete, other teams, stale builds."""
import asyncio
import gzip
import io
import tarfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from nodes.models import Node
from sandboxes.models import Sandbox, Template
from snapshots.models import Snapshot
from template_builds import progress
from template_builds.models import BuildLogEntry, TemplateBuild, TemplateFile, TemplateTag
from tests.unit.template_builder_double import FakeBuilder, fail_at_last_step

pytestmark = pytest.mark.django_db(transaction=True)

HASH = "a" * 64
HASH2 = "b" * 64


@pytest.fixture
def home(settings, tmp_path):
    settings.AENV_HOME = tmp_path
    return tmp_path


@pytest.fixture
def builder(nodes_mock, home):
    fake = FakeBuilder(nodes_mock.node.id)
    nodes_mock.client.build_template = fake
    yield fake
    fake.join()


@pytest.fixture
async def other_api(asgi_app, other_key):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}, timeout=30) as client:
        yield client


def tar_bytes(files: dict[str, bytes], compress: bool = True, extra=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    raw = buf.getvalue()
    return gzip.compress(raw) if compress else raw


async def register(api, name="my-app", **body) -> dict:
    resp = await api.post("/v3/templates", json={"name": name, **body})
    assert resp.status_code == 202, resp.text
    return resp.json()


async def start(api, reg, **body) -> httpx.Response:
    body.setdefault("fromImage", "debian:bookworm")
    body.setdefault("steps", [{"type": "RUN", "args": ["echo hi"], "force": False}])
    return await api.post(f"/v2/templates/{reg['templateID']}/builds/{reg['buildID']}", json=body)


async def status(api, reg, offset=0, **params) -> dict:
    resp = await api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/status",
                         params={"logsOffset": offset, **params})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def wait_for(api, reg, wanted=("ready", "error")) -> dict:
    for _ in range(400):
        info = await status(api, reg)
        if info["status"] in wanted:
            return info
        await __import__("asyncio").sleep(0.02)
    raise AssertionError(f"build never reached {wanted}: {info}")


async def build(api, builder, name="my-app", **body) -> dict:
    reg = await register(api, name, **{k: v for k, v in body.items() if k in ("tags", "cpuCount", "memoryMB")})
    resp = await start(api, reg, **{k: v for k, v in body.items() if k not in ("tags", "cpuCount", "memoryMB")})
    assert resp.status_code == 202, resp.text
    info = await wait_for(api, reg)
    assert info["status"] == "ready", info
    return reg


# --------------------------------------------------------------------------- register


async def test_register_answers_all_six_fields_and_rebuilds_in_place(api, team):
    first = await register(api, "My-App:V1", tags=["Extra", "v1", "stable"])
    assert set(first) == {"templateID", "buildID", "public", "names", "tags", "aliases"}
    assert uuid.UUID(first["buildID"]) and first["public"] is False
    assert first["names"] == ["team-a/my-app"] and first["aliases"] == ["my-app"]
    assert first["tags"] == ["v1", "extra", "stable"]
    again = await register(api, "team-a/my-app")
    assert again["templateID"] == first["templateID"] and again["buildID"] != first["buildID"]
    assert again["tags"] == ["default"]
    template = await Template.objects.aget(pk=first["templateID"])
    assert template.team_id == team.pk and template.alias == "my-app" and template.public is False
    builds = [b async for b in TemplateBuild.objects.filter(template=template)]
    assert {b.status for b in builds} == {"waiting"} and len(builds) == 2


async def test_default_tag_and_alias_field(api):
    resp = await api.post("/v3/templates", json={"alias": "legacy:default"})
    assert resp.status_code == 202 and resp.json()["tags"] == ["default"]


async def test_a_new_build_supersedes_older_never_started_ones_sharing_a_tag(api):
    old = await register(api, "x:v1")
    other = await register(api, "x:v2")
    await register(api, "x:v1")
    superseded = await status(api, old)
    assert superseded["status"] == "error" and "superseded" in superseded["reason"]["message"]
    assert (await status(api, other))["status"] == "waiting"


@pytest.mark.parametrize("body, text", [
    ({"name": "Bad Name"}, "invalid alias"),
    ({"name": "a/b/c"}, "invalid alias"),
    ({"name": "other-team/app"}, "namespace"),
    ({"name": "app:"}, "invalid tag"),
    ({"name": "app:" + str(uuid.uuid4())}, "build id"),
    ({"name": "app", "tags": [":x"]}, "invalid tag"),
    ({"name": "app", "tags": [str(uuid.uuid4())]}, "build id"),
    ({"name": "x" * 129}, "at most 128"),
    ({}, "name is required"),
    ({"name": 5}, "name"),
    ({"name": "app", "cpuCount": 3}, "1 or an even"),
    ({"name": "app", "cpuCount": 0}, "1 or an even"),
    ({"name": "app", "cpuCount": 64}, "exceeds the maximum"),
    ({"name": "app", "cpuCount": "2"}, "cpuCount"),
    ({"name": "app", "memoryMB": 127}, "at least 128"),
    ({"name": "app", "memoryMB": 1025}, "even"),
    ({"name": "app", "memoryMB": 1 << 20}, "exceeds the maximum"),
    ({"name": "app", "minFreeDiskMb": -1}, "minFreeDiskMb"),
])
async def test_bad_names_tags_and_limits_are_400(api, assert_error, body, text):
    assert_error(await api.post("/v3/templates", json=body), 400, text)
    assert not await Template.objects.filter(team__isnull=False).aexists()


async def test_global_aliases_are_reserved(api, assert_error):
    assert_error(await api.post("/v3/templates", json={"name": "base"}), 409, "public template")


async def test_concurrent_build_limit_is_429(api, builder, settings, assert_error):
    settings.AENV_TEMPLATE_MAX_CONCURRENT_BUILDS = 1
    builder.release.clear()
    reg = await register(api, "one")
    assert (await start(api, reg)).status_code == 202
    assert_error(await api.post("/v3/templates", json={"name": "two"}), 429, "at once")
    builder.release.set()
    await wait_for(api, reg)
    assert (await api.post("/v3/templates", json={"name": "two"})).status_code == 202


# --------------------------------------------------------------------------- files


async def test_upload_flow_is_per_team_and_hash_without_api_key(api, anon, team, home, assert_error):
    reg = await register(api)
    link = await api.get(f"/templates/{reg['templateID']}/files/{HASH}")
    assert link.status_code == 201, link.text
    assert link.json()["present"] is False
    url = link.json()["url"]
    assert url.startswith("http://testserver/template-files/" + HASH + "?token=")
    archive = tar_bytes({"app/server.py": b"print('hi')\n"})
    put = await anon.put(url, content=archive)  # no X-API-Key, no Content-Type
    assert put.status_code == 200 and put.content == b"", put.text
    row = await TemplateFile.objects.aget(team=team, hash=HASH)
    assert row.size_bytes == len(archive) and row.gzip is True and row.template_id == reg["templateID"]
    stored = home / "template-files" / str(team.pk) / f"{HASH}.tar"
    assert stored.read_bytes() == archive
    again = await api.get(f"/templates/{reg['templateID']}/files/{HASH}")
    assert again.status_code == 201 and again.json()["present"] is True and again.json()["url"]
    # the same team's other template sees it too (archives are per team, not per template)
    other = await register(api, "other-app")
    assert (await api.get(f"/templates/{other['templateID']}/files/{HASH}")).json()["present"] is True
    # a plain tar (gzip=False in the SDK) is taken too, and a repeated PUT just replaces it
    put = await anon.put(url, content=tar_bytes({"a.txt": b"a"}, compress=False))
    assert put.status_code == 200
    assert (await TemplateFile.objects.aget(team=team, hash=HASH)).gzip is False


async def test_upload_url_is_checked(api, anon, assert_error, settings):
    reg = await register(api)
    url = (await api.get(f"/templates/{reg['templateID']}/files/{HASH}")).json()["url"]
    path = urlsplit(url)
    archive = tar_bytes({"a": b"1"})
    assert_error(await anon.put(f"/template-files/{HASH}?token=forged", content=archive), 403, "invalid upload")
    assert_error(await anon.put(f"/template-files/{HASH2}?{path.query}", content=archive), 403)
    assert_error(await anon.put(f"{path.path}", content=archive), 403)
    assert_error(await anon.get(f"{path.path}?{path.query}"), 405)
    settings.AENV_TEMPLATE_UPLOAD_URL_TTL = -1
    assert_error(await anon.put(url, content=archive), 403, "expired")


@pytest.mark.parametrize("body, text", [
    (b"not a tar at all", "not a tar"),
    (gzip.compress(b"garbage" * 100), "not a gzipped tar"),
    (tar_bytes({"../escape": b"x"}), "outside"),
    (tar_bytes({"/etc/passwd": b"x"}), "outside"),
], ids=["plain bytes", "gzip not tar", "dot-dot path", "absolute path"])  # stable ids: gzip bytes hold a time
async def test_bad_archives_are_400_and_not_kept(api, anon, team, home, assert_error, body, text):
    reg = await register(api)
    url = (await api.get(f"/templates/{reg['templateID']}/files/{HASH}")).json()["url"]
    assert_error(await anon.put(url, content=body), 400, text)
    assert not await TemplateFile.objects.aexists()
    assert not (home / "template-files" / str(team.pk)).exists()
    assert list((home / "template-files" / ".incoming").iterdir()) == []


async def test_device_files_and_oversized_uploads_are_refused(api, anon, assert_error, settings):
    reg = await register(api)
    url = (await api.get(f"/templates/{reg['templateID']}/files/{HASH}")).json()["url"]
    dev = tarfile.TarInfo("dev/sda")
    dev.type = tarfile.BLKTYPE
    assert_error(await anon.put(url, content=tar_bytes({}, extra=[dev])), 400, "not a file")
    settings.AENV_TEMPLATE_FILE_MAX_BYTES = 100
    assert_error(await anon.put(url, content=b"x" * 101), 413)
    settings.AENV_TEMPLATE_FILE_MAX_BYTES = 10 << 20
    settings.AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES = 10
    assert_error(await anon.put(url, content=tar_bytes({"big": b"x" * 100})), 400, "unpacks to more")


async def test_uploads_larger_than_the_api_body_limit_pass(api, anon, settings, team):
    settings.AENV_API_MAX_BODY_BYTES = 1000
    reg = await register(api)
    url = (await api.get(f"/templates/{reg['templateID']}/files/{HASH}")).json()["url"]
    archive = tar_bytes({"blob": bytes(range(256)) * 40}, compress=False)
    assert len(archive) > 1000
    assert (await anon.put(url, content=archive)).status_code == 200


async def test_the_upload_calls_off_the_request_thread_give_their_connection_back(api, anon, home, monkeypatch):
    """The files link (is the archive stored?) and the PUT run their ORM calls on the event
    loop's default executor, a thread that outlives the request: Django closes a request's
    connection on the request's own thread only, so each call must close (with PostgreSQL:
    give back to the pool) what it opened there, or the thread keeps it for its life (a pool
    slot gone, never checked again, dead after a database restart)."""
    # The API's setting: a connection lives for one call (the data plane's entry point, if a
    # test imported it, makes SQLite connections persistent for its own process).
    monkeypatch.setitem(connections["default"].settings_dict, "CONN_MAX_AGE", 0)
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-default-executor")
    loop.set_default_executor(worker)  # every thread_sensitive=False call on one thread we can look at

    def worker_holds_a_connection() -> bool:
        return any(conn.connection is not None for conn in connections.all(initialized_only=True))

    try:
        reg = await register(api)
        link = await api.get(f"/templates/{reg['templateID']}/files/{HASH}")
        assert link.status_code == 201, link.text
        assert not await loop.run_in_executor(None, worker_holds_a_connection), "after the files link"
        assert (await anon.put(link.json()["url"], content=tar_bytes({"a": b"1"}))).status_code == 200
        assert not await loop.run_in_executor(None, worker_holds_a_connection), "after the upload"
        assert (await api.get(f"/templates/{reg['templateID']}/files/{HASH}")).json()["present"] is True
        assert not await loop.run_in_executor(None, worker_holds_a_connection), "after the files link (present)"
    finally:
        await loop.run_in_executor(None, connections.close_all)  # the test's own leftovers, pass or fail


async def test_files_link_errors(api, other_api, assert_error):
    reg = await register(api)
    assert_error(await api.get(f"/templates/{reg['templateID']}/files/ABC"), 400, "64")
    assert_error(await api.get(f"/templates/nope/files/{HASH}"), 404)
    assert_error(await other_api.get(f"/templates/{reg['templateID']}/files/{HASH}"), 404)


# --------------------------------------------------------------------------- start and status


async def test_start_hands_the_normalised_body_to_a_placed_node(api, builder, nodes_mock, team):
    reg = await register(api, "app:v1", cpuCount=4, memoryMB=2048)
    await TemplateFile.objects.acreate(team=team, hash=HASH, gzip=False)
    resp = await start(api, reg, fromImage="python:3.11", fromImageRegistry={
        "type": "registry", "username": "u", "password": "secret"}, force=True, startCmd="python -m http.server",
        readyCmd="curl -s localhost:8000", steps=[
            {"type": "copy", "args": ["app/", "/app", "", ""], "filesHash": HASH, "force": True, "forceUpload": True,
             "resolveSymlinks": False},
            {"type": "RUN", "args": ["a && b", "root"], "force": False},
            {"type": "ENV", "args": ["A", "1"], "force": False},
            {"type": "WORKDIR", "args": ["/app"]}, {"type": "USER", "args": ["user"]}])
    assert resp.status_code == 202 and resp.content == b"" and resp.headers["content-length"] == "0"
    assert nodes_mock.placement.place.await_args.args == (4, 2048)
    call = builder.calls[0]
    assert call["node"] == "n1" and call["build_id"] == reg["buildID"] and call["template_id"] == reg["templateID"]
    assert (call["cpu_count"], call["memory_mb"]) == (4, 2048)
    spec = call["spec"]
    assert spec["team_id"] == str(team.pk) and spec["from_image"] == "python:3.11" and spec["force"] is True
    assert spec["from_image_registry"] == {"type": "registry", "username": "u", "password": "secret"}
    assert spec["start_cmd"] == "python -m http.server" and spec["ready_cmd"] == "curl -s localhost:8000"
    assert spec["steps"][0] == {"type": "COPY", "args": ["app/", "/app", "", ""], "force": True, "files_hash": HASH,
                                "force_upload": True}
    assert spec["files"] == {HASH: {"gzip": False}} and spec["from_template"] is None
    row = await TemplateBuild.objects.aget(pk=reg["buildID"])
    assert row.node_id == "n1" and row.started_at and row.from_image_registry_type == "registry"
    assert "secret" not in str(row.steps) and row.steps == spec["steps"]
    info = await wait_for(api, reg)
    assert info["status"] == "ready" and info["logs"] == []


async def test_status_pages_by_offset_and_limit_until_empty(api, builder):
    builder.extra_lines = 150
    reg = await build(api, builder)
    entries, offset = [], 0
    for _ in range(10):  # the SDK's loop: until an empty page (which must come)
        page = await status(api, reg, offset, limit=100)
        assert len(page["logEntries"]) <= 100
        if not page["logEntries"]:
            break
        entries += page["logEntries"]
        offset += len(page["logEntries"])
    else:
        raise AssertionError("logsOffset is not honoured: the pages never end")
    count = await BuildLogEntry.objects.filter(build_id=reg["buildID"]).acount()
    assert len(entries) == count > 150
    assert entries[0]["message"] == "Build started on node n1" and entries[0]["step"] == "base"
    assert entries[-1]["message"].startswith("Build finished") and entries[-1]["level"] == "info"
    assert all(e["timestamp"].endswith("Z") and e["level"] in ("debug", "info", "warn", "error") for e in entries)
    assert (await status(api, reg, 0, limit=500))["logEntries"].__len__() == 100  # capped
    assert [e["level"] for e in (await status(api, reg, 0, level="info"))["logEntries"]].count("debug") == 0
    default = await api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/status")
    assert default.status_code == 200 and len(default.json()["logEntries"]) == 100


async def test_logs_endpoint(api, builder):
    reg = await build(api, builder)
    resp = await api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/logs")
    assert resp.status_code == 200
    logs = resp.json()["logs"]
    assert logs[0]["message"] == "Build started on node n1" and logs[-1]["message"].startswith("Build finished")
    back = (await api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/logs",
                          params={"direction": "backward", "limit": 1})).json()["logs"]
    assert back == [logs[-1]]
    future = int((timezone.now() + timedelta(hours=1)).timestamp() * 1000)
    assert (await api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/logs",
                          params={"cursor": future})).json()["logs"] == []


async def test_second_start_and_bad_ids(api, builder, assert_error, other_api):
    reg = await register(api)
    assert (await start(api, reg)).status_code == 202
    assert_error(await start(api, reg), 400, "cannot be started")
    assert_error(await api.post(f"/v2/templates/{reg['templateID']}/builds/not-a-uuid", json={"fromImage": "x"}),
                 400, "not a uuid")
    assert_error(await api.post(f"/v2/templates/{reg['templateID']}/builds/{uuid.uuid4()}",
                                json={"fromImage": "x"}), 404)
    assert_error(await api.post(f"/v2/templates/nope/builds/{reg['buildID']}", json={"fromImage": "x"}), 404)
    assert_error(await other_api.post(f"/v2/templates/{reg['templateID']}/builds/{reg['buildID']}",
                                      json={"fromImage": "x"}), 403)
    assert_error(await api.get(f"/templates/{reg['templateID']}/builds/{uuid.uuid4()}/status"), 400, "not found")
    assert_error(await other_api.get(f"/templates/{reg['templateID']}/builds/{reg['buildID']}/status"), 403)


@pytest.mark.parametrize("body, text", [
    ({"steps": []}, "exactly one"),
    ({"fromImage": "a", "fromTemplate": "b"}, "exactly one"),
    ({"fromImage": "", "fromTemplate": ""}, "exactly one"),
    ({"fromImage": "a", "steps": [{"args": ["x"]}]}, "type"),
    ({"fromImage": "a", "steps": [{"type": "RUN", "args": "x"}]}, "args"),
    ({"fromImage": "a", "force": "yes"}, "force"),
    ({"fromTemplate": "base", "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}},
     "needs fromImage"),
    ({"fromImage": "a", "fromImageRegistry": {"type": "docker"}}, "type must be"),
    ({"fromImage": "a", "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "k"}}, "awsSecretAccessKey"),
])
async def test_bad_start_bodies_are_400_and_leave_the_build_waiting(api, builder, assert_error, body, text):
    reg = await register(api)
    assert_error(await api.post(f"/v2/templates/{reg['templateID']}/builds/{reg['buildID']}", json=body), 400, text)
    assert (await status(api, reg))["status"] == "waiting" and not builder.calls


@pytest.mark.parametrize("steps, step, text", [
    ([{"type": "RUN", "args": ["ok"]}, {"type": "EXPOSE", "args": ["80"]}], "2", "EXPOSE is not implemented"),
    ([{"type": "ENV", "args": ["A"]}], "1", "key and value"),
    ([{"type": "COPY", "args": ["a", "/a", "", ""]}], "1", "no filesHash"),
    ([{"type": "COPY", "args": ["a", "/a", "", ""], "filesHash": HASH2}], "1", "were not uploaded"),
])
async def test_impossible_steps_end_the_build_at_start(api, builder, steps, step, text):
    reg = await register(api)
    resp = await start(api, reg, steps=steps)
    assert resp.status_code == 202
    info = await status(api, reg)
    assert info["status"] == "error" and info["reason"]["step"] == step and text in info["reason"]["message"]
    assert info["logEntries"][-1]["level"] == "error" and not builder.calls


async def test_from_template_resolves_a_ready_build_or_fails_at_base(api, builder):
    base = await build(api, builder, "base-app:v1")
    reg = await register(api, "child")
    assert (await start(api, reg, fromImage=None, fromTemplate="base-app:v1")).status_code == 202
    child = builder.calls[-1]["spec"]["from_template"]
    assert child == {"ref": "base-app:v1", "template_id": base["templateID"], "build_id": base["buildID"],
                     "snapshot_id": None, "image": "tpl-image"}
    assert (await wait_for(api, reg))["status"] == "ready"
    assert (await TemplateBuild.objects.aget(pk=reg["buildID"])).base_build_id == uuid.UUID(base["buildID"])
    # the global base template (no builds) works as fromTemplate too
    legacy = await register(api, "on-base")
    assert (await start(api, legacy, fromImage=None, fromTemplate="base")).status_code == 202
    assert builder.calls[-1]["spec"]["from_template"]["image"] == "base"
    await wait_for(api, legacy)
    bad = await register(api, "orphan")
    assert (await start(api, bad, fromImage=None, fromTemplate="base-app:nope")).status_code == 202
    info = await status(api, bad)
    assert info["status"] == "error" and info["reason"]["step"] == "base"
    assert "tag 'nope' does not exist" in info["reason"]["message"]


async def test_no_node_is_503_and_the_build_can_be_started_later(api, builder, nodes_mock, assert_error):
    reg = await register(api)
    placed = nodes_mock.placement.place.side_effect
    nodes_mock.placement.place.side_effect = nodes_mock.placement.NoNodeAvailable("no node has room")
    assert_error(await start(api, reg), 503, "no node")
    assert (await status(api, reg))["status"] == "waiting"
    nodes_mock.placement.place.side_effect = placed
    assert (await start(api, reg)).status_code == 202


async def test_unreachable_node_puts_the_build_back_to_waiting(api, nodes_mock, home, assert_error):
    async def broken(*args, **kwargs):
        raise nodes_mock.client.NodeUnavailable("node n1: cannot reach the broker")

    nodes_mock.client.build_template = broken
    reg = await register(api)
    assert_error(await start(api, reg), 503, "cannot reach the broker")
    info = await status(api, reg)
    assert info["status"] == "waiting" and "start the build again" in info["logEntries"][-1]["message"]
    row = await TemplateBuild.objects.aget(pk=reg["buildID"])
    assert row.node_id is None and row.started_at is None


async def test_builds_whose_node_or_builder_went_away_fail_when_polled(api, builder, settings):
    builder.script = lambda *args: None  # never picks it up
    reg = await register(api)
    assert (await start(api, reg)).status_code == 202
    assert (await status(api, reg))["status"] == "building"
    await Node.objects.filter(pk="n1").aupdate(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    info = await status(api, reg)
    assert info["status"] == "error" and "node n1 stopped" in info["reason"]["message"]
    await Node.objects.filter(pk="n1").aupdate(last_heartbeat_at=timezone.now())
    settings.AENV_TEMPLATE_PICKUP_TIMEOUT = 0
    reg2 = await register(api, "two")
    assert (await start(api, reg2)).status_code == 202
    info = await status(api, reg2)
    assert info["status"] == "error" and "picked the build up" in info["reason"]["message"]


async def test_progress_api_is_the_only_way_a_builder_changes_a_build(api, builder):
    builder.release.clear()
    reg = await register(api)
    assert (await start(api, reg)).status_code == 202
    bid = reg["buildID"]
    assert await sync_to_async(progress.is_building)(bid)
    assert not await sync_to_async(progress.accept)(bid, "another-node")
    with pytest.raises(ValueError):
        await sync_to_async(progress.finish)(bid)
    with pytest.raises(ValueError):
        await sync_to_async(progress.finish)(bid, progress.BuildResult())
    with pytest.raises(ValueError):
        await sync_to_async(progress.report)(bid, "loud", "x")
    builder.release.set()
    await wait_for(api, reg)
    # once finished, nothing more is written
    assert not await sync_to_async(progress.report)(bid, "info", "late")
    assert not await sync_to_async(progress.finish)(bid, error="late")
    row = await TemplateBuild.objects.aget(pk=bid)
    assert row.status == "ready" and row.image == "tpl-image" and row.finished_at and row.accepted_at
    assert row.result == {"user": "user", "workdir": "/home/user"}


async def test_failed_build_reports_reason_and_step(api, builder):
    builder.script = fail_at_last_step
    reg = await register(api)
    assert (await start(api, reg, steps=[{"type": "RUN", "args": ["ok"]}, {"type": "RUN", "args": ["exit 3"]}])
            ).status_code == 202
    info = await wait_for(api, reg)
    assert info["status"] == "error"
    assert info["reason"] == {"message": "failed to run command 'exit 3': exit status 3", "step": "2"}
    assert info["logEntries"][-1]["message"] == "Build failed: failed to run command 'exit 3': exit status 3"


# --------------------------------------------------------------------------- resolution at create


async def test_create_resolves_names_tags_and_build_ids_to_ready_builds(api, builder, nodes_mock, assert_error):
    first = await build(api, builder, "web:v1", cpuCount=4, memoryMB=2048)
    resp = await api.post("/v2/sandboxes", json={"templateID": "web:v1"})
    assert resp.status_code == 201, resp.text
    assert resp.json()["templateID"] == first["templateID"] and resp.json()["alias"] == "web"
    kwargs = nodes_mock.client.boot_sandbox.await_args.kwargs
    assert kwargs["image"] == "tpl-image" and (kwargs["cpu_count"], kwargs["memory_mb"]) == (4, 2048)
    for ref in ("team-a/web:v1", f"web:{first['buildID']}", "WEB:V1"):
        assert (await api.post("/v2/sandboxes", json={"templateID": ref})).status_code == 201, ref
    # no "default" tag: E2B's 404, and a failed rebuild leaves v1 in service
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "web"}), 404, "tag 'default' does not exist")
    builder.script = fail_at_last_step
    await register(api, "web:v1")
    failed = await register(api, "web:v1")
    assert (await start(api, failed)).status_code == 202
    assert (await wait_for(api, failed))["status"] == "error"
    resp = await api.post("/v2/sandboxes", json={"templateID": "web:v1"})
    assert resp.status_code == 201
    created = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    assert created.template_id == first["templateID"]
    # a build still running is not used
    builder.script = FakeBuilder(nodes_mock.node.id).script
    builder.release.clear()
    pending = await register(api, "web:next")
    assert (await start(api, pending)).status_code == 202
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "web:next"}), 404, "no ready build yet")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "Bad Name!"}), 400, "invalid template reference")
    builder.release.set()
    await wait_for(api, pending)
    assert (await api.post("/v2/sandboxes", json={"templateID": "web:next"})).status_code == 201


async def test_create_restores_a_build_snapshot(api, builder, nodes_mock, team):
    await sync_to_async(Snapshot.objects.create)(
        id="sbuildsnapshot000001", team=team, template_id="base", node_id="n1", state="ready", cpu_count=2,
        memory_mb=1024, disk_size_mb=4096)
    builder.result = progress.BuildResult(snapshot_id="sbuildsnapshot000001")
    reg = await build(api, builder, "snappy")
    restore = nodes_mock.client.restore_sandbox = __import__("unittest.mock").mock.AsyncMock(
        return_value={"envd_host": "127.0.0.1", "envd_port": 40009, "pid": 1, "accel": "tcg", "timings": {}})
    resp = await api.post("/v2/sandboxes", json={"templateID": "snappy"})
    assert resp.status_code == 201, resp.text
    assert restore.await_args.kwargs["snapshot_id"] == "sbuildsnapshot000001"
    sandbox = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    assert sandbox.template_id == reg["templateID"] and sandbox.source_snapshot_id == "sbuildsnapshot000001"


async def test_other_teams_templates(api, other_api, builder, assert_error):
    reg = await build(api, builder, "private-app")
    assert_error(await other_api.post("/v2/sandboxes", json={"templateID": reg["templateID"]}), 400, "not found")
    assert_error(await other_api.post("/v2/sandboxes", json={"templateID": "team-a/private-app"}), 400)
    assert_error(await other_api.get("/templates/aliases/team-a%2Fprivate-app"), 403)
    assert_error(await other_api.get(f"/templates/{reg['templateID']}"), 403)
    assert_error(await other_api.delete(f"/templates/{reg['templateID']}"), 404)
    assert_error(await other_api.get(f"/templates/{reg['templateID']}/tags"), 404)
    # other_api's own "private-app" is a different template in its namespace
    assert (await other_api.post("/v3/templates", json={"name": "private-app"})).json()["templateID"] \
        != reg["templateID"]
    # published: every team can start it by id or namespaced name
    assert (await api.patch(f"/v2/templates/{reg['templateID']}", json={"public": True})).json() == {
        "names": ["team-a/private-app"]}
    assert (await other_api.post("/v2/sandboxes", json={"templateID": "team-a/private-app"})).status_code == 201
    assert (await other_api.get(f"/templates/{reg['templateID']}/tags")).status_code == 200


# --------------------------------------------------------------------------- exists, tags, lists


async def test_alias_exists_statuses(api, builder, assert_error):
    assert_error(await api.get("/templates/aliases/nothing-here"), 404)
    assert_error(await api.get("/templates/aliases/base"), 403)  # the global base: exists, not yours
    reg = await register(api, "soon:v1")
    body = (await api.get("/templates/aliases/soon")).json()
    assert body == {"templateID": reg["templateID"], "public": False}  # registered is enough without a tag
    assert_error(await api.get("/templates/aliases/soon%3Av1"), 404)  # the tag needs a ready build
    assert (await start(api, reg)).status_code == 202
    await wait_for(api, reg)
    assert (await api.get("/templates/aliases/team-a%2Fsoon%3Av1")).status_code == 200
    assert (await api.get(f"/templates/aliases/soon%3A{reg['buildID']}")).status_code == 200
    assert_error(await api.get("/templates/aliases/BAD%20NAME"), 400)


async def test_tags_assign_list_remove(api, builder, assert_error):
    reg = await build(api, builder, "tagged:v1", tags=["extra"])
    resp = await api.post("/templates/tags", json={"target": "tagged:v1", "tags": ["prod", "Prod", "stable"]})
    assert resp.status_code == 201, resp.text
    assert resp.json() == {"tags": ["prod", "stable"], "buildID": reg["buildID"]}
    listed = (await api.get(f"/templates/{reg['templateID']}/tags")).json()
    assert [t["tag"] for t in listed] == ["extra", "prod", "stable", "v1"]
    assert {t["buildID"] for t in listed} == {reg["buildID"]} and all(t["createdAt"] for t in listed)
    assert (await api.get("/templates/tagged%3Aignored/tags")).status_code == 200
    assert (await api.request("DELETE", "/templates/tags", json={"name": "tagged", "tags": ["prod"]})).status_code == 204
    assert "prod" not in [t["tag"] for t in (await api.get("/templates/tagged/tags")).json()]
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "tagged:prod"}), 404)
    assert_error(await api.post("/templates/tags", json={"target": "tagged:v1", "tags": [":x"]}), 400)
    assert_error(await api.post("/templates/tags", json={"target": "tagged:v1", "tags": ["a:"]}), 400)
    assert_error(await api.post("/templates/tags", json={"target": "tagged:v1", "tags": []}), 400)
    assert_error(await api.post("/templates/tags", json={"target": "tagged:nope", "tags": ["x"]}), 404)
    assert_error(await api.post("/templates/tags", json={"target": "base", "tags": ["x"]}), 403)
    assert_error(await api.request("DELETE", "/templates/tags", json={"name": "tagged:v1", "tags": ["v1"]}), 400, "without a tag")
    assert_error(await api.request("DELETE", "/templates/tags", json={"name": "tagged", "tags": []}), 400)
    assert_error(await api.request("DELETE", "/templates/tags", json={"name": "tagged", "tags": ["default"]}), 400, "default")


async def test_template_lists_and_detail(api, builder, nodes_mock):
    reg = await build(api, builder, "listed:v1", cpuCount=2, memoryMB=512)
    waiting = await register(api, "listed-too")
    assert (await api.post("/v2/sandboxes", json={"templateID": "listed:v1"})).status_code == 201
    items = (await api.get("/templates")).json()
    assert [i["templateID"] for i in items] == [waiting["templateID"], reg["templateID"]]  # the team's only, newest first
    item = items[1]
    assert item["buildID"] == reg["buildID"] and item["buildStatus"] == "ready" and item["buildCount"] == 1
    assert (item["cpuCount"], item["memoryMB"]) == (2, 512) and item["spawnCount"] == 1 and item["lastSpawnedAt"]
    assert item["aliases"] == ["listed"] and item["names"] == ["team-a/listed"] and item["createdBy"] is None
    assert items[0]["buildStatus"] == "waiting" and items[0]["lastSpawnedAt"] is None
    from e2b.api.client.models.template import Template as SdkTemplate
    from e2b.api.client.models.template_with_builds import TemplateWithBuilds
    assert [SdkTemplate.from_dict(i).template_id for i in items] == [i["templateID"] for i in items]
    page = await api.get("/v2/templates", params={"limit": 1})
    assert len(page.json()) == 1 and page.headers["x-next-token"]
    rest = await api.get("/v2/templates", params={"limit": 1, "nextToken": page.headers["x-next-token"]})
    assert [i["templateID"] for i in rest.json()] == [reg["templateID"]] and "x-next-token" not in rest.headers
    detail = await api.get("/templates/team-a%2Flisted")
    assert detail.status_code == 200
    parsed = TemplateWithBuilds.from_dict(detail.json())
    assert [str(b.build_id) for b in parsed.builds] == [reg["buildID"]]
    assert (await api.get("/templates", params={"teamID": str(uuid.uuid4())})).status_code == 400


async def test_publish(api, builder):
    reg = await register(api, "pub")
    assert (await api.patch(f"/templates/{reg['templateID']}", json={"public": True})).status_code == 200
    assert (await Template.objects.aget(pk=reg["templateID"])).public is True
    assert (await api.patch(f"/v2/templates/{reg['templateID']}", json={"public": "no"})).status_code == 400


# --------------------------------------------------------------------------- delete


async def test_delete_refused_while_used_then_soft_deleted(api, builder, nodes_mock, assert_error):
    reg = await build(api, builder, "doomed:v1")
    sandbox = (await api.post("/v2/sandboxes", json={"templateID": "doomed:v1"})).json()
    body = assert_error(await api.delete("/templates/doomed"), 409, "still used")
    assert sandbox["sandboxID"] in body["message"]
    assert (await api.delete(f"/sandboxes/{sandbox['sandboxID']}")).status_code == 204
    resp = await api.delete(f"/templates/{reg['templateID']}")
    assert resp.status_code == 204 and resp.content == b""
    row = await Template.objects.aget(pk=reg["templateID"])
    assert row.deleted_at is not None  # kept for its sandboxes' history
    assert_error(await api.get("/templates/aliases/doomed"), 404)
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "doomed:v1"}), 400)
    assert_error(await api.post(f"/v2/templates/{reg['templateID']}/builds/{uuid.uuid4()}",
                                json={"fromImage": "x"}), 404)
    assert_error(await api.delete(f"/templates/{reg['templateID']}"), 404)
    assert (await api.get("/templates")).json() == []
    again = await register(api, "doomed")  # the name is free again: a new template
    assert again["templateID"] != reg["templateID"]


async def test_delete_cancels_builds_in_progress(api, builder):
    builder.release.clear()
    reg = await register(api, "busy")
    waiting = await register(api, "busy:other")
    assert (await start(api, reg)).status_code == 202
    # the builder must be on it (accepted) before the delete, or there is nothing in progress
    assert await asyncio.to_thread(builder.accepted.wait, 20)
    assert (await api.delete("/templates/busy")).status_code == 204
    for r in (reg, waiting):
        info = (await api.get(f"/templates/{r['templateID']}/builds/{r['buildID']}/status")).json()
        assert info["status"] == "error" and info["reason"]["message"] == "the template was deleted"
    builder.release.set()
    builder.join()
    assert builder.cancelled == [reg["buildID"]]  # its next report told the builder to stop
    assert (await TemplateBuild.objects.aget(pk=reg["buildID"])).status == "error"


async def test_delete_still_deletes_snapshots_by_id_and_name(api, team, nodes_mock, assert_error):
    from unittest import mock
    await sync_to_async(Snapshot.objects.create)(id="s" + "1" * 19, team=team, template_id="base", node_id="n1",
                                                 name="golden", state="ready")
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    assert (await api.delete("/templates/golden")).status_code == 204
    assert not await Snapshot.objects.aexists()
    assert_error(await api.delete("/templates/base"), 404, "names a template, not a snapshot")


async def test_tag_rows_follow_builds(api, builder):
    reg = await build(api, builder, "hist:v1")
    await build(api, builder, "hist:v1")
    assert await TemplateTag.objects.filter(template_id=reg["templateID"], tag="v1").acount() == 2
