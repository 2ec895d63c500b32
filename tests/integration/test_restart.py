"""Node worker restart with real VMs: SIGKILL the worker (as a crash would) and start it
again. Running and paused sandboxes are served as before: a background counter process
and a file survive in both, and the paused one resumes through the restarted worker."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import Sandbox

from harness.guest_counter import read_counter, start_counter

pytestmark = pytest.mark.vm


def _db(stack, sandbox_id: str) -> str:
    return stack.db("from sandboxes.models import Sandbox\n"
                    f"print(Sandbox.objects.get(pk='{sandbox_id}').state)").strip()


def test_worker_restart_keeps_running_and_paused_sandboxes(stack, sdk_env):
    with ThreadPoolExecutor(2) as pool:
        running, paused = pool.map(lambda _: Sandbox.create(timeout=900, request_timeout=600), range(2))
    try:
        for sbx in (running, paused):
            sbx.files.write("/home/user/keep.txt", f"file of {sbx.sandbox_id}")
        pid_r, n_r = start_counter(running)
        pid_p, n_p = start_counter(paused)
        assert paused.pause() is True
        assert stack.qemu_pids(paused.sandbox_id) == []

        stack.kill_node()
        # the VMs outlive the worker; the running one keeps serving envd traffic meanwhile
        assert stack.qemu_pids(running.sandbox_id)
        assert running.commands.run("echo while-down").stdout == "while-down\n"
        stack.start_node()
        assert "reattached" in stack.new_log("node")

        assert _db(stack, running.sandbox_id) == "running" and _db(stack, paused.sandbox_id) == "paused"
        time.sleep(1)
        pid_after, n_after = read_counter(running)
        assert pid_after == pid_r and n_after > n_r, "the running sandbox's process did not keep running"
        assert running.files.read("/home/user/keep.txt") == f"file of {running.sandbox_id}"
        # the restarted worker drives the running VM: pause and connect it through it
        assert running.pause() is True
        again = Sandbox.connect(running.sandbox_id, timeout=600)
        assert read_counter(again)[0] == pid_r

        resumed = Sandbox.connect(paused.sandbox_id, timeout=600)
        assert resumed.is_running()
        assert resumed.files.read("/home/user/keep.txt") == f"file of {paused.sandbox_id}"
        pid_after, n_after = read_counter(resumed)
        assert pid_after == pid_p and n_after >= n_p
        time.sleep(1.5)
        pid_later, n_later = read_counter(resumed)  # one read: the counter ticks every 0.2 s
        assert pid_later == pid_p and n_later > n_after, "the paused sandbox's process does not run after resume"
    finally:
        if "node" not in stack.procs:
            stack.start_node()
        for sbx in (running, paused):
            Sandbox.kill(sbx.sandbox_id)
    for sbx in (running, paused):
        assert stack.qemu_pids(sbx.sandbox_id) == []
        assert sbx.sandbox_id not in stack.vm_leftovers()["state_dirs"]
