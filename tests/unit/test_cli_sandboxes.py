"""The ``aenv`` sandbox, snapshot and node commands against the real API on a port (the
node side mocked as in the API tests): what each sends, prints and exits with —
pagination followed to the end, filters, create options, several ids with one failing,
``rm --all`` with a filter, snapshot pages, fork results, ``nodes``. The same commands
on real VMs: tests/integration/test_cli.py."""
import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from aenv_cli.main import main
from sandboxes.models import Sandbox
from snapshots.models import Snapshot, SnapshotState
from tests.unit.test_fork_api import fork_mock  # noqa: F401 - fixture
from tests.unit.test_snapshots_api import snap_mock  # noqa: F401 - fixture
from tests.unit.test_template_builds_sdk import server  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def cli(server, nodes_mock, capsys, monkeypatch, tmp_path):  # noqa: F811 - the imported fixture
    """``await cli(*argv)`` → (exit code, stdout, stderr) of ``aenv`` run in-process, with
    no credentials file (the environment names the server)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("AENV_API_URL", "AENV_API_KEY", "AENV_SANDBOX_URL", "E2B_SANDBOX_URL"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()

    def call(argv):
        try:
            return main(argv)
        except SystemExit as exc:  # the parser's usage errors
            return exc.code

    async def run(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(call, list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


async def _start(cli, *flags) -> str:
    code, out, err = await cli("create", *flags)
    assert code == 0, err
    return out.strip()


def _ids(out: str) -> list[str]:
    return [row["sandboxID"] for row in json.loads(out)]


def _cells(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│")]


async def test_ls_follows_every_page_and_filters(cli):
    a = [await _start(cli, "-m", "run=a", "-m", f"i={i}") for i in range(3)]
    b = [await _start(cli, "-m", "run=b") for _ in range(2)]
    code, out, err = await cli("ls", "--limit", "2")  # 5 sandboxes, 2 a page: 3 requests
    assert code == 0, err
    assert sorted(_ids(out)) == sorted(a + b)  # piped: JSON
    assert _ids((await cli("ls", "--limit", "2", "--max", "3"))[1]) == (b[::-1] + a[::-1])[:3]  # newest first
    assert sorted(_ids((await cli("list", "-m", "run=a", "--limit", "1"))[1])) == sorted(a)
    assert _ids((await cli("ls", "-m", "run=a", "-m", "i=1"))[1]) == [a[1]]
    assert (await cli("pause", b[0]))[0] == 0
    assert _ids((await cli("ls", "-s", "paused"))[1]) == [b[0]]
    assert sorted(_ids((await cli("ls", "--state", "running,paused", "--template", "base"))[1])) == sorted(a + b)
    code, out, _ = await cli("ls", "-o", "table", "-m", "run=b")
    header, *rows = _cells(out)
    assert header == ["SANDBOX ID", "TEMPLATE", "STATE", "CPU", "MEM (MiB)", "STARTED", "ENDS", "METADATA"]
    assert sorted((r[0], r[1], r[2], r[3], r[4], r[7]) for r in rows) == sorted(
        [(b[0], "base", "paused", "2", "512", "run=b"), (b[1], "base", "running", "2", "512", "run=b")])
    code, out, err = await cli("ls", "--limit", "101")
    assert code == 2 and "at most 100" in err


async def test_create_sends_the_options_and_prints_the_id(cli):
    sid = await _start(cli, "-m", "k=v=w", "-e", "A=1", "--timeout", "90", "--no-auto-pause", "--auto-resume",
                       "--deny-out", "10.0.0.0/8")
    row = await Sandbox.objects.aget(pk=sid)
    assert row.metadata == {"k": "v=w"} and row.env_vars == {"A": "1"}
    assert not row.auto_pause and row.auto_resume and row.secure
    assert timedelta(seconds=80) < row.end_at - timezone.now() <= timedelta(seconds=90)
    code, out, err = await cli("start", "-d", "-o", "json", "base", "--no-secure")
    assert code == 0, err
    created = json.loads(out)
    assert not (await Sandbox.objects.aget(pk=created["sandboxID"])).secure and created["templateID"] == "base"
    code, out, _ = await cli("info", sid)
    assert json.loads(out)["metadata"] == {"k": "v=w"} and json.loads(out)["state"] == "running"


async def test_cpu_and_memory_must_be_the_templates(cli):
    code, _, err = await cli("create", "--cpu", "4")
    assert code == 2 and "template base runs its sandboxes with 2 vCPU and 512 MiB" in err
    assert await Sandbox.objects.filter(state="running").acount() == 0  # refused: nothing left running
    code, _, err = await cli("create", "--memory", "1024")
    assert code == 2 and "cannot change that" in err
    assert (await cli("create", "--cpu", "2", "--memory", "512"))[0] == 0
    assert await Sandbox.objects.filter(state="running").acount() == 1
    code, _, err = await cli("create", "no-such-template", "--cpu", "2")
    assert code == 2 and "400: " in err and "no-such-template" in err  # the server refuses an unknown template


async def test_pause_resume_timeout_and_their_failures(cli):
    sid = await _start(cli)
    assert await cli("pause", sid) == (0, f"Paused {sid}\n", "")
    code, _, err = await cli("pause", sid)
    assert code == 5 and err.startswith(f"aenv: {sid}: 409: ")
    assert await cli("resume", sid, "--timeout", "120") == (0, f"Resumed {sid}\n", "")
    assert await cli("resume", sid) == (0, f"{sid} is running\n", "")
    assert await cli("timeout", sid, "30") == (0, f"Timeout for {sid} set to 30s\n", "")
    row = await Sandbox.objects.aget(pk=sid)
    assert timedelta(seconds=20) < row.end_at - timezone.now() <= timedelta(seconds=30)
    code, out, err = await cli("pause", "-o", "json", sid, "nope")
    assert code == 4 and json.loads(out) == [{"sandboxID": sid, "ok": True},
                                             {"sandboxID": "nope", "ok": False, "status": 404,
                                              "message": json.loads(out)[1]["message"]}]
    assert (await Sandbox.objects.aget(pk=sid)).state == "paused"


async def test_rm_several_ids_and_all_with_a_filter(cli):
    keep = [await _start(cli, "-m", "job=keep") for _ in range(2)]
    drop = [await _start(cli, "-m", "job=drop") for _ in range(3)]
    code, out, err = await cli("rm", "--all", "-m", "job=drop")
    assert code == 0, err
    assert sorted(out.split()) == sorted(w for sid in drop for w in ("Killed", sid))
    assert sorted(_ids((await cli("ls"))[1])) == sorted(keep)
    code, out, err = await cli("kill", keep[0], "nope", keep[1])
    assert code == 4 and out == f"Killed {keep[0]}\nKilled {keep[1]}\n" and "aenv: nope: 404: " in err
    assert _ids((await cli("ls"))[1]) == []
    assert (await cli("rm"))[0] == 2
    assert (await cli("rm", "-m", "job=keep"))[0] == 2  # a filter without --all would be a surprise
    assert (await cli("rm", "--all", "nope"))[0] == 2


async def test_rm_all_without_filter_kills_every_sandbox(cli):
    ids = [await _start(cli) for _ in range(2)]
    code, out, _ = await cli("delete", "--all", "-o", "json")
    assert code == 0 and sorted(r["sandboxID"] for r in json.loads(out)) == sorted(ids)
    assert await Sandbox.objects.filter(state="running").acount() == 0


async def test_snapshots_create_list_every_page_and_delete(cli, team, base_template, snap_mock):  # noqa: F811
    sid = await _start(cli)
    code, out, err = await cli("snapshot", "create", sid, "--name", "warm")
    assert code == 0, err
    snap_id = out.strip()
    assert (await Snapshot.objects.aget(pk=snap_id)).name == "warm"
    for i in range(4):  # more than a page of 2
        await Snapshot.objects.acreate(team=team, template=base_template, state=SnapshotState.READY, name=f"s{i}",
                                       created_at=timezone.now() - timedelta(minutes=i + 1))
    code, out, _ = await cli("snapshot", "ls", "--limit", "2")
    assert code == 0 and [s["names"] for s in json.loads(out)][0] == ["warm"] and len(json.loads(out)) == 5
    code, out, _ = await cli("snap", "list", "--sandbox", sid, "-o", "table")
    assert _cells(out) == [["SNAPSHOT ID", "NAMES"], [snap_id, "warm"]]
    assert json.loads((await cli("snapshot", "ls", "--name", "s2"))[1])[0]["names"] == ["s2"]
    code, out, err = await cli("snapshot", "rm", "warm", "no-such-snapshot")
    assert code == 4 and out == "Deleted snapshot warm\n" and "no-such-snapshot" in err
    assert len(json.loads((await cli("snapshot", "ls"))[1])) == 4


async def test_fork_prints_one_child_id_a_line_and_fails_on_a_failed_child(cli, fork_mock):  # noqa: F811
    from tests.unit.test_fork_api import _fork_result  # noqa: PLC0415

    sid = await _start(cli)
    code, out, err = await cli("fork", sid, "-n", "3", "--timeout", "60")
    assert code == 0, err
    kids = out.split()
    assert len(kids) == 3 and all(k != sid for k in kids)
    assert {r.forked_from_id async for r in Sandbox.objects.filter(pk__in=kids)} == {sid}
    fork_mock.client.fork_sandbox.side_effect = _fork_result(fail={0})
    code, out, err = await cli("fork", sid, "-n", "2")
    assert code == 1 and len(out.split()) == 1 and "a child failed: 500: " in err
    assert (await cli("fork", "nope"))[0] == 4


async def test_nodes_lists_and_shows_one(cli, node, settings, monkeypatch):
    # a team's key: the tenant's view (no address: issue 21, item 11)
    monkeypatch.delenv("AENV_ADMIN_TOKEN", raising=False)
    code, out, err = await cli("nodes")
    assert code == 0, err
    assert [(n["id"], n["status"], "address" in n) for n in json.loads(out)] == [("n1", "ready", False)]
    code, out, _ = await cli("nodes", "-o", "table")
    assert _cells(out)[0] == ["NODE ID", "STATUS", "RUNNING", "PAUSED", "STARTING"]
    assert _cells(out)[1] == ["n1", "ready", "0", "0", "0"]
    assert json.loads((await cli("nodes", "n1"))[1])["id"] == "n1"
    assert (await cli("nodes", "n9"))[0] == 4
    # the operators' token: every figure
    settings.AENV_ADMIN_TOKEN = token = "op-" + "y" * 40
    monkeypatch.setenv("AENV_ADMIN_TOKEN", token)
    code, out, err = await cli("nodes")
    assert code == 0, err
    assert [(n["id"], n["address"]) for n in json.loads(out)] == [("n1", "127.0.0.1")]
    code, out, _ = await cli("nodes", "-o", "table")
    assert _cells(out)[1][:3] == ["n1", "ready", "127.0.0.1"]
    assert json.loads((await cli("nodes", "n1"))[1])["address"] == "127.0.0.1"


async def test_metrics_table_and_json(cli, team, base_template):
    from tests.unit.test_api_sandbox_metrics import _samples  # noqa: PLC0415

    sid = await _start(cli)
    await sync_to_async(_samples)(await Sandbox.objects.aget(pk=sid), 3)  # the thread conftest closes after
    code, out, err = await cli("metrics", sid)
    assert code == 0, err
    assert [m["cpuUsedPct"] for m in json.loads(out)] == [10.0, 11.0, 12.0]
    header, *rows = _cells((await cli("metrics", sid, "-o", "table"))[1])
    assert header == ["TIME", "CPU", "MEMORY", "DISK"]
    assert rows[0][1:] == ["10.0 % of 2", "100.0 MiB / 512.0 MiB", "900.0 MiB / 2.0 GiB"]


async def test_a_wrong_key_says_to_run_auth(cli, monkeypatch):
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "0" * 40)
    code, _, err = await cli("ls")
    assert code == 3 and "authentication failed (401)" in err and "aenv auth" in err


async def test_sandbox_ids_complete_from_the_api_by_state(cli, server, raw_key, tmp_path):  # noqa: F811
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    running, paused = await _start(cli), await _start(cli)
    assert (await cli("pause", paused))[0] == 0

    def complete(line: str) -> list[str]:
        answer = tmp_path / "completions"
        env = {**os.environ, "E2B_API_URL": server, "E2B_API_KEY": raw_key, "_ARGCOMPLETE": "1",
               "_ARGCOMPLETE_IFS": "\n", "COMP_LINE": line, "COMP_POINT": str(len(line)),
               "_ARGCOMPLETE_STDOUT_FILENAME": str(answer)}
        subprocess.run([sys.executable, "-m", "aenv_cli"], env=env, check=True, timeout=60)
        return sorted(answer.read_text().split())

    assert await asyncio.to_thread(complete, "aenv resume ") == [paused]
    assert await asyncio.to_thread(complete, "aenv exec ") == [running]
    assert await asyncio.to_thread(complete, "aenv rm ") == sorted([running, paused])
    assert await asyncio.to_thread(complete, f"aenv connect {running[:4]}") == [running]
