"""TTL, retention and autoResume end to end, with real VMs, the lifecycle sweeper
process and the official SDK plus raw HTTP, on the conftest's second stack (its sweeper with a tiny
retention).

- no autoPause field: the sandbox is paused (QEMU process gone, files kept) within a
  few seconds of its end, then deleted with its files when the retention runs out;
- autoPause: false: it is killed (process and files gone);
- autoResume: a command on a TTL-paused sandbox resumes it and succeeds."""
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from envd import ENVD_PORT

pytestmark = pytest.mark.vm

RETENTION = 20


@pytest.fixture(scope="module")
def ttl_stack(node_kill_stack):
    """The conftest's second stack, its lifecycle sweeper restarted with a tiny retention and a
    short period for this module (only the sweeper reads them), then with the stack's own."""
    s = node_kill_stack
    before = dict(s.extra_env)
    s.extra_env.update(AENV_PAUSED_RETENTION=str(RETENTION), AENV_LIFECYCLE_PERIOD="0.5")
    try:
        s.restart_lifecycle()
        yield s
    finally:
        s.extra_env.clear()
        s.extra_env.update(before)
        s.restart_lifecycle()


def _create(stack, body: dict) -> dict:
    resp = httpx.post(f"{stack.api_url}/v2/sandboxes", json={"templateID": "base", **body},
                      headers=stack.headers(), timeout=600)
    assert resp.status_code == 201, resp.text
    return resp.json()


def _detail(stack, sandbox_id: str) -> httpx.Response:
    return httpx.get(f"{stack.api_url}/sandboxes/{sandbox_id}", headers=stack.headers(), timeout=30)


def _end_at(stack, sandbox_id: str) -> float:
    return datetime.fromisoformat(_detail(stack, sandbox_id).json()["endAt"].replace("Z", "+00:00")).timestamp()


def _ram(sandbox_id: str) -> Path:
    return Path(f"/dev/shm/aenv-{sandbox_id}.ram")


def _ram_kept(stack, sandbox_id: str) -> bool:
    """A paused sandbox's guest RAM: still in tmpfs, or already moved to its state dir on disk."""
    return _ram(sandbox_id).exists() or (stack.home / "sandboxes" / sandbox_id / "memory.ram").exists()


def _wait(predicate, timeout: float, what: str, poll: float = 0.2, stack=None) -> float:
    """Polls until predicate() is true; returns the wall-clock time it became true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return time.time()
        time.sleep(poll)
    logs = "".join(f"\n--- {n} ---\n{stack.log(n)}" for n in ("lifecycle", "node")) if stack else ""
    raise AssertionError(f"timed out waiting for {what}{logs}")


def _db_state(stack, sandbox_id: str) -> str:
    return stack.db(f"from sandboxes.models import Sandbox; print(Sandbox.objects.get(pk='{sandbox_id}').state)").strip()


def _done_at(stack, sandbox_id: str, operation: str) -> float:
    """When the sandbox's successful ``operation`` finished, from its event (epoch s): the
    sweeper's own timing, free of this test's polling lag."""
    out = stack.db("from sandboxes.models import SandboxEvent as E\n"
                   f"e = E.objects.get(sandbox_id='{sandbox_id}', operation='{operation}', outcome='ok')\n"
                   "print(e.started_at.timestamp() + (e.duration_ms or 0) / 1000)")
    return float(out.strip())


def _gone(stack, sandbox_id: str) -> bool:
    return (not stack.qemu_pids(sandbox_id) and sandbox_id not in stack.vm_leftovers()["state_dirs"]
            and not _ram(sandbox_id).exists())


def test_ttl_pause_kill_retention_and_auto_resume(ttl_stack, monkeypatch):
    stack = ttl_stack
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    # Boot the three VMs at once (cold boots dominate under TCG), with a long TTL at first.
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_create, stack, {"timeout": 600, "metadata": {"t": "pause"}}),
                   pool.submit(_create, stack, {"timeout": 600, "autoPause": False}),
                   pool.submit(Sandbox.create, timeout=600, request_timeout=600,
                               lifecycle={"on_timeout": "pause", "auto_resume": True})]
        paused_sb, killed_sb, resumable = [f.result() for f in futures]
    pid, kid, rid = paused_sb["sandboxID"], killed_sb["sandboxID"], resumable.sandbox_id
    try:
        assert _detail(stack, pid).json()["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
        assert _detail(stack, kid).json()["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
        assert _detail(stack, rid).json()["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
        resumable.files.write("/home/user/kept.txt", "kept across the auto-pause")
        envd = {"E2b-Sandbox-Id": pid, "E2b-Sandbox-Port": str(ENVD_PORT),
                "X-Access-Token": paused_sb["envdAccessToken"]}
        assert httpx.post(f"{stack.sandbox_url}/files?path=/home/user/a.txt&username=user", headers=envd,
                          files={"file": ("a.txt", b"file of A")}).status_code == 200

        # Now a 5 s TTL for each (set through the API, as the SDK's set_timeout does).
        for sid in (pid, kid, rid):
            resp = httpx.post(f"{stack.api_url}/sandboxes/{sid}/timeout", json={"timeout": 5},
                              headers=stack.headers())
            assert resp.status_code == 204, resp.text
        ends = {sid: _end_at(stack, sid) for sid in (pid, kid, rid)}

        # A: paused (to disk: its QEMU process exits, its files stay) within a few seconds of expiry
        _wait(lambda: not stack.qemu_pids(pid) and _db_state(stack, pid) == "paused", 60,
                         "A to be paused", stack=stack)
        paused_at = _done_at(stack, pid, "pause")
        assert 0 <= paused_at - ends[pid] < 5, f"paused {paused_at - ends[pid]:.1f} s after expiry"
        assert pid in stack.vm_leftovers()["state_dirs"] and _ram_kept(stack, pid)
        assert _detail(stack, pid).json()["state"] == "paused"

        # B (autoPause: false): killed, nothing left
        _wait(lambda: _detail(stack, kid).status_code == 404, 60, "B to be killed")
        killed_at = _done_at(stack, kid, "kill")
        assert 0 <= killed_at - ends[kid] < 5, f"killed {killed_at - ends[kid]:.1f} s after expiry"
        _wait(lambda: _gone(stack, kid), 15, "B's VM and files to be removed")

        # C (autoResume): paused by the TTL, then a command through the data plane resumes it
        _wait(lambda: not stack.qemu_pids(rid) and _db_state(stack, rid) == "paused", 60, "C to be paused")
        t0 = time.monotonic()
        result = resumable.commands.run("cat /home/user/kept.txt")
        print(f"\nauto-resume + command: {(time.monotonic() - t0) * 1000:.0f} ms")
        assert result.stdout == "kept across the auto-pause"
        assert _detail(stack, rid).json()["state"] == "running" and stack.qemu_pids(rid)
        assert _end_at(stack, rid) > time.time() + 200  # the auto-resume TTL, not the expired one
        assert resumable.commands.run("echo again").stdout == "again\n"

        events = stack.db(
            "from sandboxes.models import SandboxEvent as E\n"
            f"for e in E.objects.filter(sandbox_id__in=['{pid}','{kid}','{rid}']).order_by('id'):\n"
            "    print(e.sandbox_id, e.operation, e.outcome, e.to_state, e.actor)")
        assert f"{pid} pause ok paused lifecycle" in events
        assert f"{kid} kill ok killed lifecycle" in events
        assert f"{rid} pause ok paused lifecycle" in events
        assert f"{rid} resume ok running autoresume" in events

        # A again: deleted with its files once the retention has passed
        _wait(lambda: _detail(stack, pid).status_code == 404, RETENTION + 60, "A's retention")
        starts = stack.db("from sandboxes.models import SandboxEvent as E\n"
                          f"for op in ('pause', 'kill'):\n"
                          f"    print(E.objects.filter(sandbox_id='{pid}', operation=op).order_by('id')"
                          ".last().started_at.timestamp())").split()
        waited = float(starts[1]) - float(starts[0])  # retention counts from the pause
        assert RETENTION <= waited < RETENTION + 10, f"deleted {waited:.1f} s after the pause"
        _wait(lambda: _gone(stack, pid), 15, "A's files to be removed")
        assert f"{pid} kill ok killed lifecycle" in stack.db(
            "from sandboxes.models import SandboxEvent as E\n"
            f"for e in E.objects.filter(sandbox_id='{pid}', operation='kill'):\n"
            "    print(e.sandbox_id, e.operation, e.outcome, e.to_state, e.actor, e.details.get('reason'))")
    finally:
        for sid in (pid, kid, rid):
            httpx.delete(f"{stack.api_url}/sandboxes/{sid}", headers=stack.headers(), timeout=60)
    for sid in (pid, kid, rid):
        _wait(lambda sid=sid: _gone(stack, sid), 30, f"{sid} to leave nothing behind")
