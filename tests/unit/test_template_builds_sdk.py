"""The unchanged E2B Python SDK 2.63 (``Template.build``, ``build_in_background``,
``get_build_status``, ``exists`` / ``alias_exists``, tags, the COPY upload flow) against
the real API served by uvicorn on 127.0.0.1, with the node side mocked and a test double
of the builder reporting through ``template_builds.progress``. The SDK is synchronous: it
runs in a thread while the server runs in the test's event loop."""
import asyncio
import socket
import uuid

import pytest
from django.db import connections
from e2b import Template, wait_for_port
from e2b.exceptions import BuildException, FileUploadException, RateLimitException, TemplateException

from sandboxes.models import Sandbox, Template as TemplateRow
from template_builds.models import TemplateBuild, TemplateFile
from tests.unit.template_builder_double import FakeBuilder, fail_at_last_step
from tests.unit.asgi_server import served_to_sdk

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
async def server(asgi_app, base_template, raw_key, monkeypatch):
    """The API on a free port; the SDK pointed at it with team A's key."""
    async with served_to_sdk(asgi_app, monkeypatch, raw_key) as url:
        yield url


@pytest.fixture
def builder(nodes_mock, settings, tmp_path):
    settings.AENV_HOME = tmp_path
    fake = FakeBuilder(nodes_mock.node.id)
    nodes_mock.client.build_template = fake
    yield fake
    fake.join()


@pytest.fixture
def context(tmp_path):
    """A build context: app/ with two files, a.txt."""
    root = tmp_path / "ctx"
    (root / "app").mkdir(parents=True)
    (root / "app" / "server.py").write_text("print('hi')\n")
    (root / "app" / "requirements.txt").write_text("flask\n")
    (root / "a.txt").write_text("a\n")
    return root


def sdk(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def definition(context, *extra_steps):
    t = (Template(file_context_path=str(context)).from_image("debian:bookworm").copy("app/", "/app")
         .copy("a.txt", "/app/", user="root", mode=0o755).run_cmd("cat /app/a.txt"))
    for step in extra_steps:
        t = step(t)
    return t.set_workdir("/app").set_envs({"A": "1"}).set_start_cmd("python3 -m http.server 8000",
                                                                     wait_for_port(8000))


async def test_build_with_logs_uploads_then_reuses_files(server, builder, context, team):
    name = f"compat-{uuid.uuid4().hex[:8]}"
    assert await sdk(Template.exists, name) is False
    assert await sdk(Template.exists, "base") is True  # the global template: "exists, not yours" (403)
    logs = []
    info = await sdk(Template.build, definition(context), f"{name}:v1", tags=["extra"], cpu_count=2,
                     memory_mb=1024, on_build_logs=logs.append)
    assert info.name == f"{name}:v1" and set(info.tags) == {"v1", "extra"}
    assert uuid.UUID(info.build_id)
    messages = [entry.message for entry in logs]
    assert f"Template created with ID: {info.template_id}, Build ID: {info.build_id}" in messages
    assert "Uploaded 'app/'" in messages and "Uploaded 'a.txt'" in messages
    # the server's entries, in order, each once (logsOffset honoured)
    server_lines = [m for m in messages if m.startswith(("Build started on", "[base]", "[builder", "Build finished,"))]
    assert server_lines[0] == "Build started on node n1" and server_lines[1] == "[base] FROM debian:bookworm"
    assert server_lines[2:5] == ["[builder 1/5] COPY app/ /app  ", "[builder 2/5] COPY a.txt /app/ root 0755",
                                 "[builder 3/5] RUN cat /app/a.txt"]
    assert server_lines[-1].startswith("Build finished") and len(server_lines) == len(set(server_lines))
    row = await TemplateBuild.objects.aget(pk=info.build_id)
    assert row.status == "ready" and row.start_cmd == "python3 -m http.server 8000"
    assert row.ready_cmd == '[ -n "$(ss -Htuln sport = :8000)" ]'
    spec = builder.calls[0]["spec"]
    assert [s["type"] for s in spec["steps"]] == ["COPY", "COPY", "RUN", "WORKDIR", "ENV"]
    hashes = [s["files_hash"] for s in spec["steps"] if s["type"] == "COPY"]
    assert set(spec["files"]) == set(hashes) and all(f["gzip"] for f in spec["files"].values())
    assert await TemplateFile.objects.filter(team=team, hash__in=hashes).acount() == 2

    # the same definition again: archives present, nothing uploaded; a forced upload still goes
    logs.clear()
    again = await sdk(Template.build, definition(context), f"{name}:v1", on_build_logs=logs.append)
    assert again.template_id == info.template_id and again.build_id != info.build_id
    messages = [entry.message for entry in logs]
    assert "Skipping upload of 'app/', already cached" in messages and not any(m.startswith("Uploaded") for m in messages)
    logs.clear()
    forced = Template(file_context_path=str(context)).from_image("debian:bookworm").copy("a.txt", "/x",
                                                                                           force_upload=True)
    await sdk(Template.build, forced, f"{name}:forced", on_build_logs=logs.append)
    assert "Uploaded 'a.txt'" in [entry.message for entry in logs]

    assert await sdk(Template.exists, name) is True
    assert await sdk(Template.exists, f"{name}:v1") is True
    assert await sdk(Template.alias_exists, f"{name}:nope") is False
    assert await sdk(Template.exists, f"team-a/{name}:extra") is True


async def test_background_build_status_and_polling(server, builder, context):
    builder.release.clear()
    info = await sdk(Template.build_in_background, definition(context), "compat-bg", skip_cache=True)
    status = await sdk(Template.get_build_status, info)
    assert status.status.value == "building" and status.build_id == info.build_id
    assert builder.calls[0]["spec"]["force"] is True  # skip_cache
    builder.release.set()
    offset, seen = 0, []
    for _ in range(200):
        status = await sdk(Template.get_build_status, info, logs_offset=offset)
        seen += [entry.message for entry in status.log_entries]
        offset += len(status.log_entries)
        if status.status.value == "ready" and not status.log_entries:
            break
        await asyncio.sleep(0.05)
    assert status.status.value == "ready" and seen[0] == "Build started on node n1"
    assert seen[-1].startswith("Build finished") and len(seen) == len(set(seen))


async def test_failing_build_raises_build_exception_with_the_reason(server, builder, context):
    builder.script = fail_at_last_step
    with pytest.raises(BuildException) as raised:
        await sdk(Template.build, definition(context, lambda t: t.run_cmd("exit 3")), "compat-fail:v1")
    assert str(raised.value) == "failed to run command 'exit 3': exit status 3"


async def test_the_node_builder_reports_a_base_failure_through_the_sdk(server, nodes_mock, settings, tmp_path,
                                                                     context):
    """The real node task (the builder) runs for the mocked node: a registry that does not
    answer fails the build at ``base``, and the SDK raises the reason."""
    from agent.tasks import build_template

    settings.AENV_HOME = tmp_path
    settings.AENV_IMAGES_DIR = tmp_path / "images"
    settings.AENV_NODE_ID = nodes_mock.node.id
    settings.AENV_PRIVATE_REGISTRIES = ["127.0.0.1"]

    def as_the_worker(**kwargs):
        try:
            build_template(**kwargs)
        finally:
            connections.close_all()  # as Celery's Django fixup does after each task

    async def node_runs_the_task(node, **kwargs):
        await asyncio.to_thread(as_the_worker, **kwargs)
        return "task-id"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ref = f"127.0.0.1:{s.getsockname()[1]}/nothing:v1"
    nodes_mock.client.build_template = node_runs_the_task
    with pytest.raises(BuildException) as raised:
        await sdk(Template.build, Template().from_image(ref).run_cmd("true"), "compat-unreachable")
    assert str(raised.value).startswith(f"error pulling image {ref}: no registry answered")


async def test_tags_through_the_sdk(server, builder, context):
    info = await sdk(Template.build, definition(context), "compat-tags:v1", tags=["extra"])
    assigned = await sdk(Template.assign_tags, "compat-tags:v1", "prod")
    assert assigned.build_id == info.build_id and assigned.tags == ["prod"]
    tags = await sdk(Template.get_tags, "compat-tags")
    assert [t.tag for t in tags] == ["extra", "prod", "v1"] and {t.build_id for t in tags} == {info.build_id}
    await sdk(Template.remove_tags, "compat-tags", "prod")
    assert "prod" not in [t.tag for t in await sdk(Template.get_tags, info.template_id)]
    with pytest.raises(TemplateException):
        await sdk(Template.assign_tags, "compat-tags:v1", ":bad")
    with pytest.raises(TemplateException):
        await sdk(Template.remove_tags, "compat-tags", "default")


async def test_sdk_errors_for_names_limits_and_other_teams(server, builder, context, other_team):
    with pytest.raises(BuildException, match="400"):
        await sdk(Template.build, definition(context), "Bad Name!")
    with pytest.raises(BuildException, match="CPU count"):
        await sdk(Template.build, definition(context), "compat-cpu", cpu_count=3)
    with pytest.raises(BuildException, match="memory"):
        await sdk(Template.build, definition(context), "compat-mem", memory_mb=100)
    with pytest.raises(BuildException, match="namespace"):
        await sdk(Template.build, definition(context), "team-b/compat")
    # another team's template: exists (403 → True) and its files are not ours (404)
    await TemplateRow.objects.acreate(id="tteamb0000000000000x", team=other_team, alias="theirs", public=False)
    assert await sdk(Template.exists, "team-b/theirs") is True
    from e2b.api.client_sync import get_api_client  # noqa: PLC0415
    from e2b.connection_config import ConnectionConfig  # noqa: PLC0415
    from e2b.template_sync.build_api import get_file_upload_link  # noqa: PLC0415

    client = get_api_client(ConnectionConfig())
    with pytest.raises(FileUploadException, match="404"):
        await sdk(get_file_upload_link, client, "tteamb0000000000000x", "c" * 64)


async def test_concurrent_build_limit_is_a_rate_limit(server, builder, context, settings):
    settings.AENV_TEMPLATE_MAX_CONCURRENT_BUILDS = 1
    builder.release.clear()
    await sdk(Template.build_in_background, definition(context), "compat-one")
    with pytest.raises(RateLimitException):
        await sdk(Template.build_in_background, definition(context), "compat-two", retries=0)


async def test_delete_with_a_sandbox_then_without(server, builder, context, api, assert_error):
    info = await sdk(Template.build, definition(context), "compat-del:v1")
    created = await api.post("/v2/sandboxes", json={"templateID": "compat-del:v1"})
    assert created.status_code == 201, created.text
    sandbox = await Sandbox.objects.aget(pk=created.json()["sandboxID"])
    assert sandbox.template_id == info.template_id
    assert_error(await api.delete(f"/templates/{info.template_id}"), 409, sandbox.id)
    assert (await api.delete(f"/sandboxes/{sandbox.id}")).status_code == 204
    assert (await api.delete("/templates/compat-del")).status_code == 204
    assert await sdk(Template.exists, "compat-del") is False
