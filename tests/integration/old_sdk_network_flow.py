"""Runs under e2b==2.45.1 in its own venv (see scripts/test.sh): the network options of that
SDK generation against the external test host given in argv; prints one JSON line. Its probe is
harness/networld.py's (stdlib only at import), loaded from its file: the repository on the path
would shadow the venv's packages (its packaging/ directory)."""
import importlib.util
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

from e2b import Sandbox

_spec = importlib.util.spec_from_file_location(
    "networld", Path(__file__).resolve().parents[2] / "harness" / "networld.py")
networld = sys.modules["networld"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(networld)
probe = networld.probe

ext_a, ext_b = sys.argv[1], sys.argv[2]


def reach_both(sbx):
    """[A, B] probed at once: a denied probe waits out the probe's one deadline, both together."""
    seen = probe(sbx, [(ext_a, 80), (ext_b, 80)])
    return [seen[(ext_a, 80)], seen[(ext_b, 80)]]


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
