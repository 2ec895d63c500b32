"""``aenv template build | ls | rm | logs`` against the real API served by uvicorn on
127.0.0.1, with the node side mocked and the builder test double reporting through
``template_builds.progress`` (the fixtures of ``test_template_builds_sdk``). The CLI is
synchronous: ``main(argv)`` runs in a thread while the server runs in the test's event
loop; one test runs the installed ``aenv`` as a subprocess."""
import asyncio
import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from aenv_cli import templates
from aenv_cli.main import main
from sandboxes.models import Template as TemplateRow
from template_builds import files
from template_builds.models import TemplateBuild, TemplateFile
from tests.unit.template_builder_double import fail_at_last_step
from tests.unit.test_template_builds_sdk import builder, context, server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

AENV = Path(sys.executable).parent / "aenv"
DOCKERFILE = """\
FROM debian:bookworm
ARG VERSION=1.2
ENV A=1
COPY app/ /app
COPY --chown=root --chmod=755 a.txt /app/
EXPOSE 8000
RUN cat /app/a.txt
WORKDIR /app
CMD ["python3", "-m", "http.server", "8000"]
"""
STEPS = [("USER", ["root"]), ("WORKDIR", ["/"]), ("ENV", ["VERSION", "1.2"]), ("ENV", ["A", "1"]),
         ("COPY", ["app/", "/app", "", ""]), ("COPY", ["a.txt", "/app/", "root", "0755"]),
         ("RUN", ["cat /app/a.txt"]), ("WORKDIR", ["/app"]), ("USER", ["user"])]
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO |WARN |ERROR) (.*)$")


@pytest.fixture
def cli(server, capsys, monkeypatch):  # noqa: F811 - the imported fixture
    """``await cli(*argv)`` → (exit code, stdout, stderr) of ``aenv`` run in-process."""
    for name in ("AENV_API_URL", "AENV_API_KEY", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()

    async def run(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(main, list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def project(context):  # noqa: F811
    """The SDK tests' context (app/server.py, app/requirements.txt, a.txt) with a
    Dockerfile and a .dockerignore."""
    (context / "Dockerfile").write_text(DOCKERFILE)
    (context / "app" / "debug.log").write_text("not sent\n")
    (context / ".dockerignore").write_text("**/*.log\n")
    return context


@pytest.fixture
def uploads(monkeypatch):
    """The upload requests the CLI made (their headers), through the real ``httpx.put``."""
    real, seen = httpx.put, []

    def spy(url, **kwargs):
        resp = real(url, **kwargs)
        seen.append(resp.request)
        return resp

    monkeypatch.setattr(templates.httpx, "put", spy)
    return seen


def log_messages(out: str) -> list[str]:
    return [m.group(2) for line in out.splitlines() if (m := LOG_LINE.match(line))]


def stored_members(team, files_hash: str) -> list[str]:
    path = files.get_file_store().path(team.pk, files_hash)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(path.read_bytes()))) as tar:
        return sorted(tar.getnames())


async def test_build_sends_the_sdk_requests_prints_the_live_log_and_reuses_uploads(cli, builder, project, team,
                                                                                   uploads):
    code, out, err = await cli("template", "build", str(project), "-n", "cli-app:v1", "--tag", "extra",
                               "--cpu", "2", "--memory-mb", "1024")
    assert code == 0, err
    assert "warning" in err and "line 6: EXPOSE is ignored" in err
    messages = log_messages(out)
    build = await TemplateBuild.objects.select_related("template").aget()
    template_id, build_id = build.template_id, str(build.pk)
    assert messages[0] == f"Template created with ID: {template_id}, Build ID: {build_id}"
    assert messages[1].startswith("Uploaded 'app/' (") and messages[2].startswith("Uploaded 'a.txt' (")
    # the server's entries, in order, each once (logsOffset honoured), printed as they came
    assert messages[3:6] == ["Build started on node n1", "[base] FROM debian:bookworm", "[builder 1/9] USER root"]
    assert messages[6:13] == ["[builder 2/9] WORKDIR /", "[builder 3/9] ENV VERSION 1.2", "[builder 4/9] ENV A 1",
                              "[builder 5/9] COPY app/ /app  ", "[builder 6/9] COPY a.txt /app/ root 0755",
                              "[builder 7/9] RUN cat /app/a.txt", "[builder 8/9] WORKDIR /app"]
    assert messages[-1].startswith("Build finished") and len(messages) == len(set(messages))
    assert out.splitlines()[-1] == (f"Built cli-app:v1: template {template_id}, build {build_id}, "
                                    "names team-a/cli-app, tags extra, v1")

    # what the server got: the start body, normalised and stored; the shape; the uploads
    assert build.status == "ready" and build.from_image == "debian:bookworm" and build.force is False
    assert [(s["type"], s["args"]) for s in build.steps] == STEPS
    assert all(s["force"] is False for s in build.steps)
    assert build.start_cmd == "python3 -m http.server 8000" and build.ready_cmd == "sleep 20"
    assert (build.cpu_count, build.memory_mb) == (2, 1024) and build.template.alias == "cli-app"
    hashes = [s["files_hash"] for s in build.steps if s["type"] == "COPY"]
    assert len(set(hashes)) == 2 and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes)
    assert set(builder.calls[0]["spec"]["files"]) == set(hashes)
    rows = {r.hash: r async for r in TemplateFile.objects.filter(team=team)}
    assert set(rows) == set(hashes) and all(r.gzip for r in rows.values())
    assert stored_members(team, hashes[0]) == ["app", "app/requirements.txt", "app/server.py"]  # no debug.log
    assert stored_members(team, hashes[1]) == ["a.txt"]
    # the SDK's PUT: an exact length, no API key, not chunked
    assert len(uploads) == 2
    for request in uploads:
        assert request.method == "PUT" and "x-api-key" not in request.headers
        assert "transfer-encoding" not in request.headers and int(request.headers["content-length"]) > 0

    # the same tree again: same keys, the server has them, nothing is uploaded
    code, out, err = await cli("template", "build", str(project / "Dockerfile"), "-n", "cli-app:v1")
    assert code == 0, err
    messages = log_messages(out)
    assert "Skipping upload of 'app/', already cached" in messages
    assert "Skipping upload of 'a.txt', already cached" in messages
    assert not any(m.startswith("Uploaded") for m in messages) and len(uploads) == 2
    second = await TemplateBuild.objects.exclude(pk=build.pk).aget()
    assert second.template_id == template_id and [s.get("files_hash") for s in second.steps] == [
        s.get("files_hash") for s in build.steps]
    assert {r.hash: r.updated_at async for r in TemplateFile.objects.filter(team=team)} == {
        h: r.updated_at for h, r in rows.items()}

    # one file changed: only its COPY is sent again; an ignored file changing changes nothing
    (project / "a.txt").write_text("changed\n")
    (project / "app" / "debug.log").write_text("still not sent, a different size\n")
    code, out, err = await cli("template", "build", str(project), "-n", "cli-app:v2", "--no-cache")
    assert code == 0, err
    messages = log_messages(out)
    assert "Skipping upload of 'app/', already cached" in messages
    assert [m for m in messages if m.startswith("Uploaded")][0].startswith("Uploaded 'a.txt'")
    third = await TemplateBuild.objects.order_by("-created_at").afirst()
    assert third.force is True and await TemplateFile.objects.filter(team=team).acount() == 3


async def test_dockerfile_choice_context_start_and_ready_commands(cli, builder, project, tmp_path):
    (project / "e2b.Dockerfile").write_text("FROM alpine:3\nCOPY a.txt /x\nENTRYPOINT [\"/bin/sh\"]\n")
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    (elsewhere / "Dockerfile").write_text("FROM alpine:3\nCOPY app/server.py /srv/\n")
    code, _, err = await cli("template", "build", str(project), "-n", "cli-e2b", "--ready-cmd", "test -f /x")
    assert code == 0, err
    first = await TemplateBuild.objects.aget()
    assert first.from_image == "alpine:3" and (first.start_cmd, first.ready_cmd) == ("/bin/sh", "test -f /x")
    code, out, err = await cli("template", "build", str(elsewhere), "-n", "cli-ctx", "--context", str(project),
                               "--start-cmd", "sleep infinity", "--json")
    assert code == 0, err
    result = json.loads(out)  # the log went to stderr
    assert result["status"] == "ready" and result["names"] == ["team-a/cli-ctx"] and result["tags"] == ["default"]
    assert "[base] FROM alpine:3" in log_messages(err)
    second = await TemplateBuild.objects.aget(pk=result["buildID"])
    assert second.template_id == result["templateID"]
    assert (second.start_cmd, second.ready_cmd) == ("sleep infinity", "sleep 20")
    assert second.steps[2]["args"] == ["app/server.py", "/srv/", "", ""]


async def test_a_failed_build_exits_1_with_its_reason_and_step(cli, builder, project):
    builder.script = fail_at_last_step
    code, out, err = await cli("template", "build", str(project), "-n", "cli-fail")
    assert code == 1
    assert "ERROR [stderr]: exit 3" in out
    assert err.strip().endswith("failed: failed to run command 'exit 3': exit status 3 (step 9)")
    build = await TemplateBuild.objects.aget()
    assert build.status == "error" and build.reason_step == "9"


async def test_ctrl_c_while_polling_leaves_the_build_running(cli, builder, project, monkeypatch):
    builder.release.clear()

    def interrupt(_seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(templates, "_sleep", interrupt)
    code, out, err = await cli("template", "build", str(project), "-n", "cli-bg")
    build = await TemplateBuild.objects.aget()
    assert code == 130 and build.status == "building"
    assert f"build {build.pk} keeps running on the server (aenv template logs {build.template_id} {build.pk} -f)" \
        in err
    assert "Build started on node n1" in log_messages(out)  # it was polled before the interrupt


@pytest.mark.parametrize("dockerfile, words", [
    ("FROM a\nRUN true\nHEALTHCHECK CMD true\n", "Dockerfile: line 3: HEALTHCHECK is not supported"),
    ("FROM a\nCOPY missing.txt /x\n", "Dockerfile: line 2: COPY missing.txt: no such file or directory"),
    ("FROM a\nCOPY app/debug.log /x\n", "(all of it is in .dockerignore)"),
    ("FROM a AS one\nFROM b\n", "line 2: multi-stage Dockerfiles are not supported"),
])
async def test_a_dockerfile_it_cannot_build_registers_nothing(cli, builder, project, dockerfile, words):
    (project / "Dockerfile").write_text(dockerfile)
    code, out, err = await cli("template", "build", str(project), "-n", "cli-bad")
    assert code == 1 and words in err and err.startswith("aenv: ")
    assert await TemplateRow.objects.filter(alias="cli-bad").acount() == 0 and builder.calls == []


async def test_api_errors_are_status_and_message(cli, builder, project, tmp_path):
    code, _, err = await cli("template", "build", str(project), "-n", "cli-cpu", "--cpu", "3")
    assert code == 2 and err.splitlines()[-1] == "aenv: 400: CPU count must be 1 or an even number, got 3"
    code, _, err = await cli("template", "build", str(project), "-n", "base")
    assert code == 5 and err.splitlines()[-1] == "aenv: 409: template name 'base' is taken by a public template"
    code, _, err = await cli("template", "build", str(tmp_path), "-n", "x")
    assert code == 1 and "no e2b.Dockerfile or Dockerfile in" in err
    code, _, err = await cli("template", "logs", "nope")
    assert code == 4 and err.strip() == "aenv: 404: template 'nope' not found"


async def test_ls_lists_the_team_templates(cli, builder, project):
    assert (await cli("template", "build", str(project), "-n", "cli-ls"))[0] == 0
    template = await TemplateRow.objects.aget(alias="cli-ls")
    code, out, err = await cli("template", "ls", "-o", "table")
    assert code == 0, err
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│")]
    header, *rows = cells
    assert header == ["TEMPLATE ID", "NAMES", "STATUS", "CPU", "MEM (MiB)", "UPDATED"]
    assert len(rows) == 1 and rows[0][:5] == [template.pk, "team-a/cli-ls", "ready", "2", "1024"]
    for argv in (["template", "ls"], ["template", "ls", "--json"], ["templates", "list", "-o", "json"]):
        code, out, _ = await cli(*argv)  # JSON when piped, as asked, and the old flag
        listed = json.loads(out)
        assert [(t["templateID"], t["buildStatus"], t["names"]) for t in listed] == [
            (template.pk, "ready", ["team-a/cli-ls"])]


async def test_rm_deletes_and_reports_404_and_409(cli, builder, project, api, nodes_mock):
    assert (await cli("template", "build", str(project), "-n", "cli-rm"))[0] == 0
    assert (await cli("template", "build", str(project), "-n", "cli-used"))[0] == 0
    created = await api.post("/v2/sandboxes", json={"templateID": "cli-used"})
    assert created.status_code == 201, created.text
    code, out, err = await cli("template", "rm", "team-a/cli-rm", "nope-x", "cli-used")
    assert code == 4 and out == "deleted team-a/cli-rm\n"  # the first failure's status: not found
    lines = err.splitlines()
    assert lines[0].startswith("aenv: nope-x: 404: ")
    assert lines[1].startswith("aenv: cli-used: 409: template 'cli-used' is still used by live sandboxes (")
    assert created.json()["sandboxID"] in lines[1]
    assert await TemplateRow.objects.filter(alias="cli-rm", deleted_at__isnull=True).acount() == 0
    assert await TemplateRow.objects.filter(alias="cli-used", deleted_at__isnull=True).acount() == 1


async def test_logs_of_the_newest_or_a_given_build_and_by_level(cli, builder, project):
    assert (await cli("template", "build", str(project), "-n", "cli-logs"))[0] == 0
    builder.script = fail_at_last_step
    assert (await cli("template", "build", str(project), "-n", "cli-logs"))[0] == 1
    ok, failed = [b async for b in TemplateBuild.objects.order_by("created_at")]

    code, out, err = await cli("template", "logs", "cli-logs")  # the newest: the failed one
    assert code == 0 and log_messages(out) == ["Build started on node n1", "[stderr]: exit 3",
                                               "Build failed: failed to run command 'exit 3': exit status 3"]
    assert err.strip() == f"aenv: build {failed.pk}: error: failed to run command 'exit 3': exit status 3 (step 9)"
    code, out, err = await cli("template", "logs", ok.template_id, str(ok.pk))
    messages = log_messages(out)
    assert code == 0 and messages[0] == "Build started on node n1" and messages[-1].startswith("Build finished")
    assert err.strip() == f"aenv: build {ok.pk}: ready"
    code, out, _ = await cli("template", "logs", "team-a/cli-logs", str(ok.pk), "--level", "warn")
    assert code == 0 and log_messages(out) == []
    code, out, _ = await cli("template", "logs", "cli-logs", "--level", "error", "-f")
    assert code == 1 and all(line.split()[1] == "ERROR" for line in out.splitlines()) and len(out.splitlines()) == 2


async def test_logs_follow_a_running_build_to_its_end(cli, builder, project, capsys):
    builder.release.clear()
    building = asyncio.ensure_future(asyncio.to_thread(main, ["template", "build", str(project), "-n", "cli-follow",
                                                              "--json"]))
    for _ in range(200):
        if await TemplateBuild.objects.filter(status="building").aexists():
            break
        await asyncio.sleep(0.05)
    following = asyncio.ensure_future(asyncio.to_thread(main, ["template", "logs", "cli-follow", "-f"]))
    await asyncio.sleep(0.5)
    assert not following.done()  # still polling: the build waits for the release
    builder.release.set()
    assert await asyncio.gather(building, following) == [0, 0]
    out, err = capsys.readouterr()
    # stdout: the follower's log lines and the build's JSON; stderr: the build's log (--json)
    followed = log_messages(out)
    assert followed[0] == "Build started on node n1" and followed[-1].startswith("Build finished")
    assert json.loads("\n".join(line for line in out.splitlines() if not LOG_LINE.match(line)))["status"] == "ready"
    assert log_messages(err)[-1].startswith("Build finished")
    build = await TemplateBuild.objects.aget()
    assert f"aenv: build {build.pk}: ready" in err


async def test_the_installed_command_as_a_subprocess(server, builder, project, raw_key):  # noqa: F811
    env = {"E2B_API_URL": server, "E2B_API_KEY": raw_key, "PATH": "/usr/bin:/bin"}
    proc = await asyncio.create_subprocess_exec(str(AENV), "template", "build", str(project), "-n", "cli-sub",
                                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "[base] FROM debian:bookworm" in out.decode()
    proc = await asyncio.create_subprocess_exec(str(AENV), "template", "ls", env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0 and "team-a/cli-sub" in out.decode(), err.decode()


async def test_logs_of_a_template_without_builds(cli, team):
    await TemplateRow.objects.acreate(id="tclinobuilds00000000", team=team, alias="cli-empty")
    code, _, err = await cli("template", "logs", "cli-empty")
    assert code == 1 and err.strip() == "aenv: template cli-empty has no builds"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_are_coloured_by_level_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    entry = {"timestamp": "2026-01-02T03:04:05.123Z", "level": "error", "message": "boom"}
    tty, plain = _Terminal(), io.StringIO()
    templates.LogPrinter(tty).entry(entry)
    templates.LogPrinter(plain).entry(entry)
    assert tty.getvalue().startswith("\033[31m") and tty.getvalue().endswith("ERROR boom\033[0m\n")
    assert LOG_LINE.match(plain.getvalue().rstrip("\n")).group(2) == "boom"
    monkeypatch.setenv("NO_COLOR", "1")
    quiet = _Terminal()
    templates.LogPrinter(quiet).entry(entry)
    assert "\033" not in quiet.getvalue()


def test_help_on_every_command():
    for argv in (["template"], ["template", "build"], ["template", "ls"], ["template", "rm"], ["template", "logs"]):
        out = subprocess.run([str(AENV), *argv, "--help"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and out.stdout.startswith(f"usage: aenv {' '.join(argv)}"), out.stderr
    build_help = subprocess.run([str(AENV), "template", "build", "--help"], capture_output=True, text=True).stdout
    assert "HEALTHCHECK" in build_help and "ignored with a warning" in build_help


def test_the_cli_imports_no_django():
    code = ("import sys, aenv_cli.main, aenv_cli.templates, aenv_cli.dockerfile, aenv_cli.build_context; "
            "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_pull_makes_a_template_of_an_image_and_watch_follows_it(cli, builder, project):
    code, out, err = await cli("pull", "registry.example.com/tools/python:3.12-slim@sha256:" + "a" * 64,
                               "--start-cmd", "python3 -m http.server 8000", "--probe", "8000", "--memory", "1024")
    assert code == 0, err
    build = await TemplateBuild.objects.select_related("template").aget()
    assert build.template.alias == "python" and build.steps == [] and build.memory_mb == 1024
    assert build.from_image.startswith("registry.example.com/tools/python:3.12-slim@sha256:")
    assert (build.start_cmd, build.ready_cmd) == ("python3 -m http.server 8000", ": >/dev/tcp/127.0.0.1/8000")
    assert out.splitlines()[-1].startswith(f"Built python: template {build.template_id}, build {build.pk}")

    builder.release.clear()  # the next build waits until the test lets it go
    code, out, err = await cli("template", "pull", "debian:bookworm", "-n", "cli-pulled", "-d")
    assert code == 0 and out.splitlines()[-1].startswith("Build started: template "), err
    pulled = await TemplateBuild.objects.filter(template__alias="cli-pulled").aget()
    assert pulled.status != "ready" and not pulled.start_cmd and not pulled.ready_cmd
    builder.release.set()
    code, out, err = await cli("template", "watch", "cli-pulled")
    assert code == 0 and "[base] FROM debian:bookworm" in out and f"build {pulled.pk}: ready" in err
    with pytest.raises(SystemExit) as usage:  # the parser's error (exit 2)
        await cli("pull", "debian:bookworm", "--probe", "80", "--ready-cmd", "true")
    assert usage.value.code == 2


async def test_build_is_also_a_top_level_command(cli, builder, project):
    code, out, err = await cli("build", str(project), "-n", "cli-top:v1")
    assert code == 0, err
    assert out.splitlines()[-1].startswith("Built cli-top:v1: template ")
