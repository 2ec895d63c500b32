"""Real QEMU microVMs: an idle guest's settings (issue 26) are in force in a template-restored
sandbox, and what they slow down still works: the clock stays on the TSC and right after
/init, a pause / resume keeps the guest running, and a service that listens only on loopback
is still forwarded once the sandbox is used again after a quiet minute.
What they save is measured by bench/idle.py, not here."""

import time
from datetime import datetime, timezone

import httpx
import pytest

from harness.polling import until
from tests.vmm.test_lifecycle_vm import start_vm as start
from tests.vmm.test_template_snapshot_vm import driver, init, run, template  # noqa: F401 (fixtures)
from vmm.driver import BootSpec

pytestmark = pytest.mark.vm


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_idle_settings_in_a_restored_guest(driver):  # noqa: F811 (the imported fixture)
    vm = start(driver, BootSpec("idle-a"))
    assert vm.timings["from_template_snapshot"] == 1
    init(vm.envd_url, "tok")
    got = run(vm.envd_url, "cat /proc/sys/vm/compaction_proactiveness /proc/sys/kernel/watchdog "
                           "/proc/sys/vm/stat_interval; test -e /proc/pressure && echo psi || echo no-psi; "
                           "cat /sys/devices/system/clocksource/clocksource0/current_clocksource", token="tok")
    assert got.split() == ["0", "0", "10", "no-psi", "tsc"]

    driver.pause(vm.sandbox_id)
    time.sleep(2)
    resumed = driver.resume(vm.sandbox_id)
    # the node's resume sets the clock, as after a restore (the token is in force by now)
    now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    r = httpx.post(f"{resumed.envd_url}/init", json={"timestamp": now}, headers={"X-Access-Token": "tok"}, timeout=30)
    assert r.status_code == 204, r.text
    skew = time.time() - float(run(resumed.envd_url, "date +%s.%N", token="tok"))
    assert abs(skew) < 2.0, f"guest clock off by {skew:.2f}s after pause / resume"

    if not resumed.guest_host:  # restricted slirp forwards envd's port only
        return
    # A loopback-only server started through envd is forwarded (envd scans every second while
    # the sandbox is in use) and reachable at the guest's address.
    run(resumed.envd_url, "mkdir -p /tmp/w && echo hi > /tmp/w/x && cd /tmp/w && "
                          "(setsid python3 -m http.server 8099 --bind 127.0.0.1 >/dev/null 2>&1 &)", token="tok")
    until(lambda: _answers(f"http://{resumed.guest_host}:8099/x"), "the loopback server forwarded", 60, interval=0.5,
          tolerate=())
