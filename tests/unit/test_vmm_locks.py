"""vmm.locks: one holder per VM across processes and threads; kill() may delete the lock file."""
import subprocess
import sys
import threading
import time

import pytest

from vmm.locks import LockTimeout, vm_lock

HOLD = """
import sys, time
from pathlib import Path
from vmm.locks import vm_lock
with vm_lock(Path(sys.argv[1]), "vm1"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_other_process_waits(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "0.6"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout):
            with vm_lock(tmp_path, "vm1", timeout=0.1):
                pass
        t0 = time.monotonic()
        with vm_lock(tmp_path, "vm1", timeout=10):
            waited = time.monotonic() - t0
        assert 0.2 < waited < 5
        with vm_lock(tmp_path, "vm2", timeout=0.1):  # other VMs are independent
            pass
    finally:
        proc.wait(10)


def test_threads_exclude_each_other_and_discard_is_safe(tmp_path):
    inside, overlaps = [], []

    def worker(discard):
        with vm_lock(tmp_path, "vm1") as lock:
            if inside:
                overlaps.append(1)
            inside.append(1)
            time.sleep(0.02)
            inside.pop()
            if discard:
                lock.discard()

    threads = [threading.Thread(target=worker, args=(i % 3 == 0,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    with vm_lock(tmp_path, "vm1") as lock:
        lock.discard()
    assert list(tmp_path.iterdir()) == []
