"""Fork end to end with real VMs and the official SDK: four children each see the
parent's files and running process, their writes stay their own, the parent keeps
running; sixteen children fit one default node at their charge; bad forks are refused; a
kill during a fork leaves nothing behind."""
import os
import threading
import time

import httpx
import pytest
from e2b import Sandbox

from cluster.processes import qemu_pids

from harness.guest_counter import read_counter, start_counter
from .test_snapshot_e2e import _shm_files

pytestmark = pytest.mark.vm


def _fork_dirs(stack) -> list[str]:
    root = stack.home / "forks"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _assert_gone(stack, ids):
    left = stack.vm_leftovers()
    for sid in ids:
        assert sid not in left["state_dirs"], f"state dir of {sid} left behind"
        assert qemu_pids(sid) == [], f"QEMU of {sid} still runs"
        assert _shm_files(sid) == [], f"RAM file of {sid} left in /dev/shm"


def test_fork_into_four(stack, sdk_env):
    parent = Sandbox.create(timeout=600)
    children = []
    try:
        parent.files.write("/home/user/state.txt", "from parent")
        pid, _ = start_counter(parent)
        end_before = parent.get_info().end_at
        t0 = time.monotonic()
        results = parent.fork(count=4, timeout=300)
        fork_s = time.monotonic() - t0
        errors = [r for r in results if isinstance(r, Exception)]
        children = [r for r in results if not isinstance(r, Exception)]
        assert not errors, errors
        assert len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 5
        # the parent keeps its id, expiry and process
        info = parent.get_info()
        assert info.end_at == end_before and parent.is_running()
        time.sleep(0.6)
        assert read_counter(parent)[0] == pid
        for c in children:
            assert c.files.read("/home/user/state.txt") == "from parent"
            p1, n1 = read_counter(c)
            assert p1 == pid, "the child's counter was restarted, not forked"
            assert c.get_info().state.value == "running"
        time.sleep(0.6)
        assert all(read_counter(c)[1] > 0 for c in children)
        # a write in one child is invisible to its siblings and the parent
        children[0].files.write("/home/user/state.txt", "child 0 was here")
        children[0].files.write("/home/user/only0.txt", "x")
        assert children[0].files.read("/home/user/state.txt") == "child 0 was here"
        for other in children[1:] + [parent]:
            assert other.files.read("/home/user/state.txt") == "from parent"
            assert not other.files.exists("/home/user/only0.txt")
        # every child runs on its own fresh entropy-independent identity: own token, own clock sync
        for c in children:
            guest_now = float(c.commands.run("date +%s.%N").stdout)
            assert abs(guest_now - time.time()) < 10
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert {c.sandbox_id for c in children} <= listed
        print(f"\nFORK x4: {fork_s * 1000:.0f} ms until all four answered the API")
    finally:
        for c in children:
            c.kill()
        parent.kill()
    _assert_gone(stack, [parent.sandbox_id] + [c.sandbox_id for c in children])
    assert _fork_dirs(stack) == [], "the fork capture outlived its children"


def test_fork_refusals(stack, sdk_env):
    h = stack.headers()
    r = httpx.post(f"{stack.api_url}/sandboxes/inope/fork", json={"count": 1}, headers=h)
    assert r.status_code == 404 and r.json()["code"] == 404
    sbx = Sandbox.create(timeout=300)
    try:
        for count in (0, 101):
            r = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": count}, headers=h)
            assert r.status_code == 400 and "between 1 and 100" in r.json()["message"], r.text
        r = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 33}, headers=h)
        assert r.status_code == 400 and "AENV_FORK_MAX_PER_NODE" in r.json()["message"], r.text
        assert sbx.pause() is True
        r = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1}, headers=h)
        assert r.status_code == 409 and "not running" in r.json()["message"], r.text
        info = httpx.get(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}", headers=h).json()
        assert info["state"] == "paused"
        assert not [s for s in Sandbox.list().next_items() if s.sandbox_id != sbx.sandbox_id]
    finally:
        sbx.kill()
    _assert_gone(stack, [sbx.sandbox_id])
    assert _fork_dirs(stack) == []


def test_kill_parent_during_fork_leaks_nothing(stack, sdk_env):
    parent = Sandbox.create(timeout=300)
    h = stack.headers()
    answer = {}

    def fork():
        answer["resp"] = httpx.post(f"{stack.api_url}/sandboxes/{parent.sandbox_id}/fork", json={"count": 2},
                                    headers=h, timeout=600)

    worker = threading.Thread(target=fork)
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # kill once the fork is under way
        state = httpx.get(f"{stack.api_url}/sandboxes/{parent.sandbox_id}", headers=h).json()
        if state.get("state") == "running" and _fork_dirs(stack):
            break
        time.sleep(0.05)
    assert Sandbox.kill(parent.sandbox_id) is True
    worker.join(600)
    resp = answer["resp"]
    assert resp.status_code in (201, 500, 504), resp.text
    child_ids = []
    if resp.status_code == 201:
        for r in resp.json():
            assert set(r) in ({"sandbox"}, {"error"})
            if "sandbox" in r:
                child_ids.append(r["sandbox"]["sandboxID"])
    # every child the API shows is really running; every other one has no VM
    for sid in child_ids:
        assert httpx.get(f"{stack.api_url}/sandboxes/{sid}", headers=h).json()["state"] == "running"
        assert Sandbox.kill(sid) is True
    assert httpx.get(f"{stack.api_url}/sandboxes/{parent.sandbox_id}", headers=h).status_code == 404
    listed = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert listed == [], f"sandboxes left after the kill: {listed}"
    time.sleep(1)
    left = stack.vm_leftovers()
    assert left["processes"] == [] and left["state_dirs"] == [], left
    assert _fork_dirs(stack) == [], "the fork capture was leaked"
    _assert_gone(stack, [parent.sandbox_id] + child_ids)


def _memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss and Anonymous (KiB) of a process, from /proc/<pid>/smaps_rollup."""
    out = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Anonymous"):
            out[name] = int(rest.split()[0])
    return out


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_fork_into_sixteen_on_one_node(stack, sdk_env):
    """AgentENV's "fork into up to 16 children on the same node" with the default template
    (2 vCPU / 512 MiB) on a default node: all sixteen run and answer, and the node's
    reservations (GET /nodes: what placement counts) are the parent plus sixteen fork
    children's charge, not seventeen whole VMs. Prints each child's measured host memory
    (PSS, anonymous) and idle CPU, the figures the charge is set from."""
    from django.conf import settings

    parent = Sandbox.create(timeout=600)
    children = []
    try:
        parent.files.write("/home/user/state.txt", "from parent")
        t0 = time.monotonic()
        results = parent.fork(count=16, timeout=300)
        fork_s = time.monotonic() - t0
        errors = [r for r in results if isinstance(r, Exception)]
        children = [r for r in results if not isinstance(r, Exception)]
        assert not errors, errors
        assert len(children) == 16
        for c in children:
            assert c.files.read("/home/user/state.txt") == "from parent"
        node = httpx.get(f"{stack.api_url}/nodes", headers=stack.admin_headers()).json()[0]
        charge_mb = min(512, settings.AENV_FORK_CHILD_MEMORY_MB)
        charge_cpu = -(-2 // int(settings.AENV_FORK_VCPU_OVERCOMMIT))
        assert node["metrics"]["allocatedMemoryBytes"] == (512 + 16 * charge_mb) << 20, node["metrics"]
        assert node["metrics"]["allocatedCPU"] == 2 + 16 * charge_cpu, node["metrics"]

        pids = {c.sandbox_id: qemu_pids(c.sandbox_id)[0] for c in children}
        time.sleep(5)  # settle after the children's first commands
        ticks0 = {sid: _cpu_ticks(pid) for sid, pid in pids.items()}
        t1 = time.monotonic()
        time.sleep(10)
        span = time.monotonic() - t1
        hz = os.sysconf("SC_CLK_TCK")
        cpu = sorted(100 * (_cpu_ticks(pid) - ticks0[sid]) / hz / span for sid, pid in pids.items())
        mem = [_memory_kib(pid) for pid in pids.values()]
        pss = sorted(m["Pss"] >> 10 for m in mem)
        anon = sorted(m["Anonymous"] >> 10 for m in mem)
        print(f"\nFORK x16 (2 vCPU / 512 MiB): {fork_s:.1f} s until all sixteen answered the API; per child: "
              f"PSS {pss[0]}-{pss[-1]} MiB (median {pss[8]}), anonymous {anon[0]}-{anon[-1]} MiB, idle CPU "
              f"{cpu[0]:.1f}-{cpu[-1]:.1f} % of a core (median {cpu[8]:.1f}); charged {charge_cpu} vCPU / "
              f"{charge_mb} MiB each")
        assert pss[8] < charge_mb, f"a child's measured PSS ({pss[8]} MiB) is above its charge ({charge_mb} MiB)"
    finally:
        for c in children:
            c.kill()
        parent.kill()
    _assert_gone(stack, [parent.sandbox_id] + [c.sandbox_id for c in children])
