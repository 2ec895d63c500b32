"""The data plane right after a pause or a resume, with real VMs and the official SDK:
no request may use a route or a pooled connection of the VM process from before.
- many pause → connect → read → run cycles without a single error;
- traffic within 100 ms of a pause resumes an autoResume sandbox and is served."""
import os
import time

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.vm

CYCLES = int(os.environ.get("AENV_TEST_PAUSE_CYCLES", "40"))


@pytest.mark.parametrize("cycles", [pytest.param(CYCLES, id="default"),
                                    pytest.param(200, id="200", marks=pytest.mark.slow)])
def test_pause_connect_read_run_cycles_without_errors(stack, sdk_env, cycles):
    """``cycles`` times in a row; the default run does 40 (``AENV_TEST_PAUSE_CYCLES``), the
    slow suite (``AENV_TEST_SLOW=1 scripts/test.sh``) the full 200."""
    sbx = Sandbox.create(timeout=600)
    errors, times = [], []
    try:
        sbx.files.write("/home/user/cycle.txt", "kept")
        sbx.commands.run("echo 0 > /home/user/n")
        for i in range(cycles):
            t0 = time.monotonic()
            try:
                assert sbx.pause() is True
                again = Sandbox.connect(sbx.sandbox_id, timeout=600)
                assert again.files.read("/home/user/cycle.txt") == "kept"
                out = again.commands.run("n=$(( $(cat /home/user/n) + 1 )); echo $n > /home/user/n; echo $n")
                assert out.stdout.strip() == str(i + 1), out.stdout
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                errors.append(f"cycle {i}: {type(exc).__name__}: {exc}")
                if len(errors) >= 5:
                    break
            times.append(time.monotonic() - t0)
        times.sort()
        print(f"{len(times)} cycles, median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s")
        assert errors == [], "\n".join(errors)
    finally:
        sbx.kill()


def test_traffic_within_100_ms_of_a_pause_auto_resumes(stack, sdk_env):
    sbx = Sandbox.create(timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/home/user/a.txt", "auto")
        for _ in range(5):
            assert sbx.commands.run("true").exit_code == 0  # the route is warm and pooled
            assert sbx.pause() is True
            paused_at = time.monotonic()
            content = sbx.files.read("/home/user/a.txt")  # sent at once after the pause returned
            assert content == "auto"
            assert sbx.get_info().state.value == "running"
            print(f"read answered {time.monotonic() - paused_at:.2f} s after the pause (resume included)")
    finally:
        sbx.kill()
