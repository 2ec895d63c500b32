"""Runs under e2b==2.45.1 in its own venv (see scripts/test.sh): the network options of that
SDK generation against the external test host given in argv; prints one JSON line."""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

from e2b import Sandbox

ext_a, ext_b = sys.argv[1], sys.argv[2]


def reach(sbx, address):
    cmd = f"timeout 6 bash -c 'exec 3<>/dev/tcp/{address}/80' && echo open || echo closed"
    return sbx.commands.run(cmd, timeout=60).stdout.strip() == "open"


def reach_both(sbx):
    """[A, B] probed at once: a denied probe waits out its timeout, two at once wait one."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda address: reach(sbx, address), [ext_a, ext_b]))


result = {"version": version("e2b")}
closed = Sandbox.create(allow_internet_access=False)
result["closed"] = reach_both(closed)
closed.update_network({})
time.sleep(0.2)
result["opened"] = reach_both(closed)
closed.kill()
deny_b = Sandbox.create(network={"deny_out": [ext_b]})
result["deny_b"] = reach_both(deny_b)
deny_b.commands.run("cd /tmp && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
result["host"] = deny_b.get_host(8080)
deny_b.kill()
print(json.dumps(result))
