"""The dashboard's template pages and the live build log socket: team scoping (another
team's template or build is a 404 / a refused socket), builds with and without layers,
an error build's reason and step, hostile text escaped; the socket sends the log from an
offset, then entries appended the way a node's builder appends them
(``template_builds.progress``), a status message and a normal close at the end, and
stops polling when the browser leaves."""
import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from dashboard import build_logs
from dashboard.template_pages import describe_step, layer_rows, short_key, step_prefix
from sandboxes.models import Template
from template_builds import progress
from template_builds.models import BuildLogEntry, TemplateBuild, TemplateTag
from template_builds.transitions import transition_sync
from tests.unit.test_dashboard_terminal import expect_close, headers_for

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sha256:" + "ab12cd34" * 8
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'
STEPS = [
    {"type": "RUN", "args": ["apt-get update && apt-get install -y curl", "root"], "force": False},
    {"type": "COPY", "args": ["app/", "/home/user/app", "user", "0755"], "force": False, "files_hash": "f" * 64},
    {"type": "ENV", "args": ["MODE", "prod", "DEBUG", "0"], "force": False},
    {"type": "RUN", "args": ["false"], "force": True},
]
LAYERS = [
    {"step": "base", "type": "FROM", "key": KEY, "size_bytes": 73_400_320, "cached": True},
    {"step": "1", "type": "RUN", "key": "c0ffee" * 10 + "beef", "size_bytes": 12345, "cached": False},
    {"step": "finalize", "type": "SNAPSHOT", "key": "", "size_bytes": None},
]


def make_template(team, template_id="tmine", alias="py", public=False):
    return Template.objects.create(id=template_id, team=team, alias=alias, public=public, image="",
                                   cpu_count=2, memory_mb=1024, disk_size_mb=4096)


def started_build(template, node, *, steps=STEPS, accepted=True, **fields):
    """A build handed to ``node`` (through the transition table) and, with ``accepted``,
    picked up by its builder: what ``progress.report`` needs."""
    build = TemplateBuild.objects.create(template=template, from_image="python:3.11", steps=steps,
                                         start_cmd="python -m http.server 8000", ready_cmd="curl -fs :8000",
                                         **fields)
    assert transition_sync(build.pk, "start", node_id=node.id, started_at=timezone.now())
    if accepted:
        assert progress.accept(build.pk, node.id)
    TemplateTag.objects.create(template=template, build=build, tag="default")
    return build


def ready_build(template, node, *, layers=LAYERS, lines=("[base] FROM python:3.11", "[1] RUN apt-get update")):
    build = started_build(template, node)
    for i, line in enumerate(lines):
        assert progress.report(build.pk, "info", line, step="base" if i == 0 else "1")
    details = {"user": "user", "workdir": "/home/user", "manifest": {"os": "linux"}}
    if layers is not None:
        details["layers"] = layers
    assert progress.finish(build.pk, progress.BuildResult(image="tmine-img", details=details))
    return TemplateBuild.objects.get(pk=build.pk)


def failed_build(template, node):
    build = started_build(template, node)
    assert progress.report(build.pk, "info", "[4] RUN false", step="4")
    assert progress.finish(build.pk, error="failed to run command 'false': exit status 1", step="4")
    return TemplateBuild.objects.get(pk=build.pk)


@pytest.fixture
def mine(team):
    return make_template(team)


@pytest.fixture
def theirs(other_team):
    return make_template(other_team, "ttheirs", alias="secret-thing", public=True)


# --------------------------------------------------------------------------- pages


def test_list_shows_own_global_and_public_but_not_private_of_others(dash, team, other_team, base_template,
                                                                   node, mine, theirs):
    ready_build(mine, node)
    make_template(other_team, "tprivate", alias="their-private-alias", public=False)
    html = dash.get("/dashboard/templates/").content.decode()
    assert 'href="/dashboard/templates/tmine/"' in html and "team-a/py" in html
    assert 'href="/dashboard/templates/base/"' in html
    assert "tprivate" not in html and "their-private-alias" not in html
    # another team's public template is listed read-only: no link, none of its builds
    assert "ttheirs" in html and 'href="/dashboard/templates/ttheirs/"' not in html
    row = html.split('data-template-id="tmine"')[1].split("</tr>")[0]
    assert "badge-ready" in row and '<span class="tag">default</span>' in row


def test_template_detail_lists_builds_newest_first_with_tags(dash, mine, node):
    old = ready_build(mine, node)
    new = failed_build(mine, node)
    waiting = TemplateBuild.objects.create(template=mine)
    html = dash.get("/dashboard/templates/tmine/").content.decode()
    table = html.split("data-build-table")[1]
    order = [table.index(f'data-build-id="{b.pk}"') for b in (waiting, new, old)]
    assert order == sorted(order)
    new_row = table.split(f'data-build-id="{new.pk}"')[1].split("</tr>")[0]
    assert "badge-error" in new_row and "exit status 1" in new_row and "(step 4)" in new_row
    assert "python:3.11" in new_row and ">4<" in new_row and "n1" in new_row
    waiting_row = table.split(f'data-build-id="{waiting.pk}"')[1].split("</tr>")[0]
    assert "not started" in waiting_row and "badge-waiting" in waiting_row
    # the default tag's newest assignment is the failed build; a create still uses the ready one
    tags = html.split("data-tag-table")[1].split("</table>")[0]
    assert f'/builds/{new.pk}/">{str(new.pk)[:8]}' in tags and f'/builds/{old.pk}/">{str(old.pk)[:8]}' in tags


def test_global_template_page_is_read_only(dash, base_template):
    html = dash.get("/dashboard/templates/base/").content.decode()
    assert "A global template" in html and "data-build-table" not in html


def test_other_teams_templates_and_builds_are_404(dash, theirs, mine, node):
    build = ready_build(theirs, node)
    assert dash.get("/dashboard/templates/ttheirs/").status_code == 404  # public, but its builds are theirs
    assert dash.get(f"/dashboard/templates/ttheirs/builds/{build.pk}/").status_code == 404
    # nor through one of our templates' ids
    assert dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").status_code == 404
    assert dash.get("/dashboard/templates/nope/").status_code == 404
    assert dash.get("/dashboard/templates/tmine/builds/not-a-uuid/").status_code == 404


def test_deleted_template_is_404(dash, mine, node):
    build = ready_build(mine, node)
    Template.objects.filter(pk=mine.pk).update(deleted_at=timezone.now())
    assert dash.get("/dashboard/templates/tmine/").status_code == 404
    assert dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").status_code == 404
    assert "tmine" not in dash.get("/dashboard/templates/").content.decode()


def test_build_page_with_layers(dash, mine, node):
    build = ready_build(mine, node)
    html = dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").content.decode()
    layers = html.split("data-layer-table")[1].split("</table>")[0]
    assert f'title="{KEY}">ab12cd34ab12<' in layers           # shortened, whole key in the title
    assert "70.0\xa0MB" in layers and "12.1\xa0KB" in layers  # human sizes
    assert layers.count(">cached<") == 1 and layers.count(">built<") == 2
    assert "finalize" in layers and "no layers recorded" not in html
    # the other result keys as facts; steps as sent; the commands
    assert ">workdir<" in html and "/home/user" in html and "&quot;os&quot;: &quot;linux&quot;" in html
    steps = html.split("data-step-table")[1].split("</table>")[0]
    assert "<code>app/</code> → <code>/home/user/app</code>" in steps and "mode 0755" in steps
    assert "apt-get update &amp;&amp; apt-get install -y curl" in steps and "as root" in steps
    assert "MODE=prod DEBUG=0" in steps
    assert "python -m http.server 8000" in html and "curl -fs :8000" in html
    # the log, rendered up to where the socket takes over
    assert "[1] RUN apt-get update" in html and "Build finished" in html
    assert 'class="log-step"' not in html  # the builder's lines already start with their step
    assert f'data-next-index="{build.log_count}"' in html and build.log_count == 3
    assert f'data-ws-path="/ws/templates/tmine/builds/{build.pk}/logs"' in html


@pytest.mark.parametrize("layers", [None, []])
def test_build_page_without_layers(dash, mine, node, layers):
    build = ready_build(mine, node, layers=layers)
    html = dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").content.decode()
    assert "no layers recorded" in html and "data-layer-table" not in html


def test_error_build_shows_reason_and_step(dash, mine, node):
    build = failed_build(mine, node)
    html = dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").content.decode()
    reason = html.split("data-build-reason>")[1].split("</dd>")[0]
    assert "failed to run command &#x27;false&#x27;: exit status 1" in reason and 'href="#step-4"' in reason
    failed_row = html.split('id="step-4"')[1].split("</tr>")[0]
    assert 'class="step-failed"' in failed_row and "failed here" in failed_row
    assert "failed here" not in html.split('id="step-3"')[1].split("</tr>")[0]
    assert "Build failed: failed to run command" in html.split("data-log-lines")[1]


def test_hostile_text_is_escaped(dash, mine, node):
    build = started_build(mine, node, steps=[{"type": "RUN", "args": [HOSTILE], "force": False},
                                             {"type": "COPY", "args": [HOSTILE, "/x"], "files_hash": "a"}])
    assert progress.report(build.pk, "error", HOSTILE, step="1")
    assert progress.finish(build.pk, error=HOSTILE, step="1")
    html = dash.get(f"/dashboard/templates/tmine/builds/{build.pk}/").content.decode()
    assert HOSTILE not in html and "<img src=x" not in html
    escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
    assert html.count(escaped) >= 5  # step RUN, step COPY, the log line, the failure line, the reason
    assert html.count("<script>") == 0  # none inline: the page's own is static/dashboard/build_log.js (CSP)
    assert "dashboard/build_log.js" in html
    assert f'<span class="log-step">[1]</span><span class="log-message">{escaped}</span>' in html


def test_step_and_layer_formatting():
    assert describe_step(2, STEPS[1])["copy"] == {"src": "app/", "dest": "/home/user/app", "user": "user",
                                                  "mode": "0755"}
    assert describe_step(1, {"type": "WORKDIR", "args": ["/app"]})["text"] == "/app"
    assert describe_step(1, {"type": "ENV", "args": ["A", "1", "B"]})["text"] == "A=1 B="
    assert short_key(KEY) == "ab12cd34ab12" and short_key("deadbeef" * 8) == "deadbeefdead"
    rows = layer_rows({"layers": ["junk", {"step": 1, "key": KEY, "size_bytes": "big", "cached": "yes"}]})
    assert rows == [{"step": "1", "type": "", "key": KEY, "short_key": "ab12cd34ab12", "size_bytes": None,
                     "cached": False}]
    assert layer_rows({"layers": "nope"}) == [] and layer_rows([]) == []
    assert step_prefix("2", "[2] RUN make") == "" and step_prefix("2", "make: done") == "[2]"
    assert step_prefix("", "anything") == ""


# --------------------------------------------------------------------------- the log socket


def communicator(template_id, build_id, headers, query=""):
    from config.asgi import application  # noqa: PLC0415

    path = f"/ws/templates/{template_id}/builds/{build_id}/logs" + (f"?{query}" if query else "")
    return WebsocketCommunicator(application, path, headers=headers)


async def read_until_close(comm, timeout=10.0):
    """Every JSON frame until the server closes, and the close."""
    frames = []
    while True:
        msg = await comm.receive_output(timeout=timeout)
        if msg["type"] == "websocket.close":
            await comm.disconnect(code=msg.get("code", 1000), timeout=timeout)
            return frames, msg
        frames.append(json.loads(msg["text"]))


def leaked_log_tasks():
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(build_logs.TASK_PREFIX) and not t.done()]


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(build_logs, "POLL_SECONDS", 0.05)


async def test_existing_entries_from_an_offset_then_a_normal_close(dash, mine, node, fast_poll):
    build = await sync_to_async(ready_build)(mine, node)
    comm = communicator("tmine", build.pk, headers_for(dash), "offset=1")
    assert (await comm.connect(timeout=5))[0]
    frames, close = await read_until_close(comm)
    logs = [f for f in frames if f["type"] == "log"]
    assert [f["index"] for f in logs] == [1, 2]
    assert logs[0]["message"] == "[1] RUN apt-get update" and logs[0]["step"] == "1" and logs[0]["level"] == "info"
    assert logs[1]["message"].startswith("Build finished")
    entry = await BuildLogEntry.objects.aget(build=build, index=1)
    assert logs[0]["timestamp"] == entry.timestamp.isoformat()
    assert frames[-2] == {"type": "status", "status": "ready", "reason": "", "step": ""}
    assert frames[-1] == {"type": "close", "code": 1000, "reason": "build ready"}
    assert close["code"] == 1000
    assert leaked_log_tasks() == []


async def test_offset_past_the_end_of_a_finished_build_just_closes(dash, mine, node, fast_poll):
    build = await sync_to_async(failed_build)(mine, node)
    comm = communicator("tmine", build.pk, headers_for(dash), f"offset={build.log_count}")
    assert (await comm.connect(timeout=5))[0]
    frames, close = await read_until_close(comm)
    assert frames == [{"type": "status", "status": "error", "step": "4",
                       "reason": "failed to run command 'false': exit status 1"},
                      {"type": "close", "code": 1000, "reason": "build error"}]
    assert close["code"] == 1000


async def test_entries_appended_while_connected_then_status_and_close(dash, mine, node, fast_poll):
    build = await sync_to_async(started_build)(mine, node)
    assert await sync_to_async(progress.report)(build.pk, "info", "[base] FROM python:3.11", step="base")
    comm = communicator("tmine", build.pk, headers_for(dash))
    assert (await comm.connect(timeout=5))[0]
    first = await comm.receive_json_from(timeout=5)
    assert first["type"] == "log" and first["index"] == 0
    assert await comm.receive_json_from(timeout=5) == {"type": "status", "status": "building", "reason": "",
                                                       "step": ""}
    # the builder, as a node worker does it (another thread, straight to the database)
    for i in range(3):
        assert await sync_to_async(progress.report)(build.pk, "warn" if i == 1 else "info", f"line {i}", step="1")
        got = await comm.receive_json_from(timeout=5)
        assert (got["index"], got["message"], got["level"]) == (i + 1, f"line {i}", "warn" if i == 1 else "info")
    assert await sync_to_async(progress.finish)(build.pk, error="boom", step="1")
    frames, close = await read_until_close(comm)
    assert [f["type"] for f in frames] == ["log", "status", "close"]
    assert frames[0]["index"] == 4 and frames[0]["message"] == "Build failed: boom" and frames[0]["level"] == "error"
    assert frames[1] == {"type": "status", "status": "error", "reason": "boom", "step": "1"}
    assert close["code"] == 1000
    assert leaked_log_tasks() == []


async def test_a_long_backlog_comes_in_order_without_gaps(dash, mine, node, fast_poll, monkeypatch):
    monkeypatch.setattr(build_logs, "BATCH", 7)
    build = await sync_to_async(started_build)(mine, node)
    for i in range(30):
        await sync_to_async(progress.report)(build.pk, "debug", f"n{i}")
    await sync_to_async(progress.finish)(build.pk, progress.BuildResult(image="img"))
    comm = communicator("tmine", build.pk, headers_for(dash), "offset=3")
    assert (await comm.connect(timeout=5))[0]
    frames, _ = await read_until_close(comm)
    assert [f["index"] for f in frames if f["type"] == "log"] == list(range(3, 31))


async def test_a_dead_builder_fails_the_watched_build(dash, mine, node, fast_poll, monkeypatch):
    """Like the SDK's status poll: a build whose node stopped heartbeating ends, so the
    page's socket ends too."""
    monkeypatch.setattr(build_logs, "STALE_CHECK_SECONDS", 0.1)
    build = await sync_to_async(started_build)(mine, node)
    comm = communicator("tmine", build.pk, headers_for(dash))
    assert (await comm.connect(timeout=5))[0]
    assert (await comm.receive_json_from(timeout=5))["status"] == "building"
    await type(node).objects.filter(pk=node.pk).aupdate(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    frames, close = await read_until_close(comm)
    assert frames[0]["type"] == "log" and "stopped while building" in frames[0]["message"]
    assert frames[1]["status"] == "error" and "stopped while building" in frames[1]["reason"]
    assert close["code"] == 1000


async def test_leaving_stops_the_polling(dash, mine, node, fast_poll):
    build = await sync_to_async(started_build)(mine, node)
    comm = communicator("tmine", build.pk, headers_for(dash))
    assert (await comm.connect(timeout=5))[0]
    assert (await comm.receive_json_from(timeout=5))["type"] == "status"
    assert [t.get_name() for t in leaked_log_tasks()] == [f"{build_logs.TASK_PREFIX}{build.pk}"]
    await comm.disconnect()
    await asyncio.sleep(0.1)
    assert leaked_log_tasks() == []


async def test_anonymous_is_refused(db, mine, node):
    build = await sync_to_async(started_build)(mine, node)
    await expect_close(communicator("tmine", build.pk, headers_for()), build_logs.CLOSE_UNAUTHENTICATED, "sign in")


async def test_another_teams_build_looks_missing(dash, theirs, node):
    build = await sync_to_async(ready_build)(theirs, node)
    reason = await expect_close(communicator("ttheirs", build.pk, headers_for(dash)), build_logs.CLOSE_NOT_FOUND)
    assert reason == "build not found"
    for template_id, build_id in (("tmine", build.pk), ("ttheirs", "not-a-uuid"),
                                  ("ttheirs", "00000000-0000-0000-0000-000000000000")):
        again = await expect_close(communicator(template_id, build_id, headers_for(dash)), build_logs.CLOSE_NOT_FOUND)
        assert again == reason  # indistinguishable from an unknown build


async def test_another_teams_user_is_refused(client, other_team, mine, node):
    from django.contrib.auth import get_user_model  # noqa: PLC0415

    build = await sync_to_async(ready_build)(mine, node)
    bob = await sync_to_async(get_user_model().objects.create_user)("bob", password="pw-bob-1234")
    await sync_to_async(other_team.members.add)(bob)
    await sync_to_async(client.force_login)(bob)
    await expect_close(communicator("tmine", build.pk, headers_for(client)), build_logs.CLOSE_NOT_FOUND)


@pytest.mark.parametrize("query", ["offset=-1", "offset=abc", "offset=1.5"])
async def test_a_bad_offset_is_refused(dash, mine, node, query):
    build = await sync_to_async(ready_build)(mine, node)
    await expect_close(communicator("tmine", build.pk, headers_for(dash), query), build_logs.CLOSE_BAD_MESSAGE,
                       "offset")


async def test_a_cross_origin_handshake_is_refused(dash, mine, node):
    build = await sync_to_async(ready_build)(mine, node)
    comm = communicator("tmine", build.pk, headers_for(dash, origin=b"http://evil.example"))
    connected, _ = await comm.connect(timeout=5)
    assert not connected
    await comm.wait(timeout=5)
