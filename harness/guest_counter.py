"""The background process the end-to-end tests watch: a Python counter in the guest that
rewrites /home/user/counter.txt ("<pid> <n>") every 0.2 s. Its pid shows whether a
process survived (pause, snapshot, fork, worker restart); its count, that it still runs."""
import time

COUNTER_FILE = "/home/user/counter.txt"
COUNTER = """\
import os, time
n = 0
while True:
    n += 1
    with open("/home/user/counter.tmp", "w") as f:
        f.write(f"{os.getpid()} {n}")
    os.replace("/home/user/counter.tmp", "/home/user/counter.txt")
    time.sleep(0.2)
"""


def read_counter(sbx) -> tuple[int, int]:
    pid, n = sbx.files.read(COUNTER_FILE).split()
    return int(pid), int(n)


def start_counter(sbx) -> tuple[int, int]:
    """Starts the counter detached from envd, waits until it has counted for a second."""
    sbx.files.write("/home/user/counter.py", COUNTER)
    sbx.commands.run("setsid python3 /home/user/counter.py >/dev/null 2>&1 </dev/null &")
    deadline = time.monotonic() + 30
    while not sbx.files.exists(COUNTER_FILE) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    return read_counter(sbx)
