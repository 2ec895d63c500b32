"""Real QEMU microVM playing the guest that replaced envd (issue 21 item 2): the node's
metrics round asks a real guest and hostile loopback envds at once and stores the real
guest's sample within the round's deadline; then root in the guest kills envd and serves
its port with a server that drips its answer a byte a second, and the round still ends by
its deadline with the other guest's sample, that guest's dropped."""
import time

import pytest

from tests.hostile_envd import HostileEnvd
from tests.vmm.test_lifecycle_vm import real_driver, sh, start_vm
from vmm.driver import BootSpec

pytestmark = pytest.mark.vm

ENVD_PORT = 49983
# Run as root in the guest, detached: once the command that started it has returned, kill
# envd (the command's parent) and hold its port with a server that drips (the guest init
# restarts envd a second later; that envd finds the port taken and exits, again and again).
HOSTILE_GUEST = r'''
import os, signal, socket, sys, threading, time
sys.stdout = sys.stderr = open("/dev/console", "w", buffering=1)
envd = int(sys.argv[1])
time.sleep(1.5)
os.kill(envd, signal.SIGKILL)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
for _ in range(100):
    try:
        s.bind(("0.0.0.0", PORT)); break
    except OSError:
        time.sleep(0.05)
s.listen(16)
print("hostile-guest: listening on", PORT)
def drip(c):
    try:
        c.recv(65536)
        for b in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b" " * 100000:
            c.sendall(bytes([b])); time.sleep(1)
    except OSError:
        pass
while True:
    threading.Thread(target=drip, args=(s.accept()[0],), daemon=True).start()
'''.replace("PORT", str(ENVD_PORT))


@pytest.fixture()
def driver(tmp_path):
    with real_driver(tmp_path / "home") as d:
        yield d


def guest_row(info) -> dict:
    return {"id": "real-guest", "envd_host": info.envd_host, "envd_port": info.envd_port, "envd_access_token": ""}


def timed_round(rows, deadline):
    from agent.metrics import collect  # noqa: PLC0415

    started = time.monotonic()
    samples = collect(rows, deadline)
    return {s.sandbox_id: s for s in samples}, time.monotonic() - started


def test_a_round_with_a_hostile_guest_ends_by_its_deadline_with_the_others_samples(driver):
    info = start_vm(driver, BootSpec("hostile-metrics-1"))
    real = guest_row(info)
    deadline = 2.0
    timed_round([real], 10.0)  # envd's first /metrics measures a CPU window: not this test's subject
    with HostileEnvd("drip") as drip, HostileEnvd("endless") as endless, HostileEnvd("good") as good:
        # a real guest and hostile ones in the same round
        samples, took = timed_round([real, drip.row("drip"), endless.row("endless")], deadline)
        assert took < deadline + 1.0, took
        assert set(samples) == {"real-guest"}, samples
        assert samples["real-guest"].cpu_count == 2 and samples["real-guest"].mem_total > 0

        # the guest turns hostile: root kills envd and serves its port, dripping
        sh(info, f"cat > /tmp/h.py <<'EOF'\n{HOSTILE_GUEST}\nEOF\n"
                 "setsid python3 /tmp/h.py $PPID >/dev/null 2>&1 < /dev/null &\necho started", user="root")
        time.sleep(3)  # envd killed, the port held
        console = driver.console_path(info.sandbox_id).read_text(errors="replace")
        assert f"hostile-guest: listening on {ENVD_PORT}" in console, console[-3000:]
        samples, took = timed_round([real, good.row("good")], deadline)
        assert deadline - 0.3 < took < deadline + 1.0, took  # the guest held its connection: it dripped
        assert set(samples) == {"good"}, samples
        print(f"\nround with the hostile guest: {took:.2f} s (deadline {deadline} s)")
