"""Real QEMU microVMs: a booted template (vmm.templates) makes create a restore.

The default template shape (2 vCPU, 512 MiB, 2 GiB disk) is captured once by
`python -m vmm.templates build` (setup.sh does it; here the fixture does, idempotently); the
node's create (agent.tasks._start_vm) restores it with `restore(..., template=True)`.
A restored sandbox must be indistinguishable from a cold-booted one: envd answers, /init sets
the clock (frozen at capture time) and the token, files written in one sandbox stay its own.
"""

import base64
import json
import os
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from envd import ENVD_PORT
from tests.vmm.test_lifecycle_vm import assert_gone
from tests.vmm.test_lifecycle_vm import start_vm as start
from tests.vmm.test_qemu_vm import IMAGES_DIR, fresh_sdk_connections
from vmm import templates
from vmm.driver import BootSpec, get_driver
from vmm.images import ensure_image

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def template():
    if not Path("/usr/bin/qemu-system-x86_64").exists():
        pytest.skip("qemu-system-x86_64 not installed")
    ensure_image(IMAGES_DIR, "base")
    manifest = templates.build(IMAGES_DIR, "base", cpu_count=2, memory_mb=512, disk_size_mb=2048)
    # The guest clock stands still from the capture on; make the lag measurable.
    built = json.loads((Path(manifest.dir) / "template.json").read_text())["built_at"]
    time.sleep(max(0.0, 4.0 - (time.time() - built)))
    return manifest


@pytest.fixture()
def driver(template, tmp_path):
    d = get_driver("qemu", tmp_path / "home", IMAGES_DIR)
    yield d
    for vm in d.list():
        d.kill(vm.sandbox_id)


def run(url: str, cmd: str, token: str | None = None) -> str:
    """Runs cmd as root through envd with the official SDK (debug mode: no API)."""
    from e2b import Sandbox
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version

    headers = {"E2b-Sandbox-Id": "debug_sandbox_id", "E2b-Sandbox-Port": str(ENVD_PORT)}
    if token:
        headers["X-Access-Token"] = token
    fresh_sdk_connections()  # a resumed VM may answer at an address another guest had
    cfg = ConnectionConfig(debug=True, sandbox_url=url, extra_sandbox_headers=headers)
    sbx = Sandbox(sandbox_id="debug_sandbox_id", sandbox_domain=None, envd_version=Version("0.6.4"),
                  envd_access_token=token, traffic_access_token=None, connection_config=cfg)
    return sbx.commands.run(cmd, user="root", timeout=60).stdout


def init(url: str, token: str) -> None:
    now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    body = {"timestamp": now,
            "entropySeed": base64.b64encode(os.urandom(64)).decode(), "envVars": {"FROM": "init"},
            "accessToken": token}
    r = httpx.post(f"{url}/init", json=body, timeout=30)
    assert r.status_code == 204, r.text


def test_boot_restores_from_template_snapshot(driver, template):
    assert templates.TemplateCache(IMAGES_DIR).find(driver, BootSpec("tp-a")) == template
    a = start(driver, BootSpec("tp-a"))
    print(f"\nboot from template snapshot: {a.timings}")
    assert a.timings["from_template_snapshot"] == 1
    lag = time.time() - float(run(a.envd_url, "date +%s.%N"))
    assert lag > 2.0, f"the restored clock should lag (capture time), lag={lag:.1f}s"
    init(a.envd_url, "tok-a")
    skew = time.time() - float(run(a.envd_url, "date +%s.%N", token="tok-a"))
    print(f"clock lag before /init {lag:.1f}s, after {skew:.3f}s")
    assert abs(skew) < 2.0
    # With 2 vCPUs the guest keeps the TSC clocksource (tsc=reliable); on jiffies it would lose
    # time whenever the host is busy.
    assert run(a.envd_url, "cat /sys/devices/system/clocksource/clocksource0/current_clocksource",
               token="tok-a").strip() == "tsc"
    assert httpx.get(f"{a.envd_url}/envs", timeout=10).status_code == 401  # the token is in force
    run(a.envd_url, "echo only-a > /root/a.txt && sync", token="tok-a")

    b = start(driver, BootSpec("tp-b"))
    assert b.timings["from_template_snapshot"] == 1
    assert (b.envd_host, b.envd_port) != (a.envd_host, a.envd_port)  # an endpoint of its own
    init(b.envd_url, "tok-b")
    assert run(b.envd_url, "test -e /root/a.txt && echo yes || echo no", token="tok-b").strip() == "no"
    assert run(b.envd_url, "nproc; free -m | awk '/Mem:/{print $2}'", token="tok-b").split()[0] == "2"
    assert driver.info("tp-b").status == "running"
    # A template-restored sandbox owns its RAM (a sparse copy on /dev/shm), so its own pause to
    # disk saves only the device state (~100 KiB), not the whole RAM.
    assert Path(f"/dev/shm/aenv-{a.sandbox_id}.ram").exists()
    t = driver.pause_to_disk("tp-a")
    print(f"pause_to_disk of a template-restored sandbox: {t}")
    assert (a.state_dir / "device.state").stat().st_size < 1 << 20
    info = driver.resume("tp-a")
    assert info.status == "running" and driver.info("tp-a").envd_url == info.envd_url  # maybe moved (netns)
    assert run(info.envd_url, "cat /root/a.txt", token="tok-a").strip() == "only-a"
    for vm in (a, b):
        assert driver.kill(vm.sandbox_id)
        assert_gone(driver, vm)
    assert Path(template.memory_file).exists() and Path(template.layers[-1]).exists()  # shared, kept


def test_broken_template_snapshot_falls_back_to_cold_boot(driver, template, tmp_path, monkeypatch):
    broken = replace(template, device_state_file=str(tmp_path / "missing.state"))
    monkeypatch.setattr(templates.TemplateCache, "find", lambda *a, **k: broken)
    c = start(driver, BootSpec("tp-c"))
    print(f"\ncold boot after a failed template restore: {c.timings}")
    assert c.timings["from_template_snapshot"] == 0
    assert run(c.envd_url, "echo ok").strip() == "ok"
    assert driver.kill("tp-c")
    assert_gone(driver, c)


def test_shared_template_ram_maps_the_template_copy_on_write(driver, template, monkeypatch):
    """AENV_TEMPLATE_RAM=shared: a create from the template maps the template's RAM file
    copy-on-write instead of copying it (no RAM file of its own on /dev/shm); what it writes
    stays its own, a second sandbox from the same template does not see it, and its pause to
    disk carries its whole RAM (the copy-on-write path) and resumes with its memory. The
    template's file is left as it was."""
    monkeypatch.setattr(driver, "template_ram", "shared")
    before = Path(template.memory_file).stat()
    d = start(driver, BootSpec("tp-d"))
    e = start(driver, BootSpec("tp-e"))
    assert d.timings["from_template_snapshot"] == 1 == e.timings["from_template_snapshot"]
    assert not Path(f"/dev/shm/aenv-{d.sandbox_id}.ram").exists()
    init(d.envd_url, "tok-d")
    init(e.envd_url, "tok-e")
    run(d.envd_url, "echo only-d > /dev/shm/d.txt", token="tok-d")  # in the guest's RAM only
    assert run(e.envd_url, "cat /dev/shm/d.txt 2>/dev/null || echo none", token="tok-e").strip() == "none"
    driver.pause_to_disk("tp-d")
    assert (d.state_dir / "device.state").stat().st_size > 64 << 20  # its RAM went with it
    resumed = driver.resume("tp-d")
    assert run(resumed.envd_url, "cat /dev/shm/d.txt", token="tok-d").strip() == "only-d"
    for vm in (d, e):
        assert driver.kill(vm.sandbox_id)
        assert_gone(driver, vm)
    after = Path(template.memory_file).stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
