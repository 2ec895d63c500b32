"""A real control plane over an in-memory node: daphne (API), uvicorn (data plane) and a node
worker on the fake driver (bench/control_plane_node.py: no VM, guest calls answered at once).

Why: the fuzz tests (tests/unit/test_fuzz_*.py) send thousands of requests through the real
HTTP servers, Celery and the node's task code; with QEMU each create would cost seconds. What
only a guest can answer (envd's files and commands) is fuzzed against real VMs instead
(tests/integration/test_fuzz_envd.py)."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

from harness.stack import PY, ROOT, running_stack


@contextmanager
def fake_stack(prefix: str = "fake", **env):
    """A started stack whose node runs the fake driver; everything stopped and its home removed after."""
    with running_stack(prefix, with_node=False, with_lifecycle=False,
                       extra_env={"AENV_DRIVER": "fake", "AENV_NETWORK": "slirp", **env}) as stack:
        stack.with_node = True  # started here, not by Stack: the stand-in's entry point
        stack._spawn("node", [PY, str(ROOT / "bench" / "control_plane_node.py")])
        stack._wait_node()
        yield stack


def files_under(root: Path) -> set[str]:
    """Every path under ``root`` (relative), for "nothing written outside where it belongs"
    (find(1): a tree thousands of levels deep is within a volume's rights, and beyond pathlib's
    recursion)."""
    root = Path(root)
    if not root.exists():
        return set()
    out = subprocess.run(["find", ".", "-mindepth", "1", "-printf", "%P\\0"], cwd=root, capture_output=True,
                         timeout=300)
    return {p.decode(errors="replace") for p in out.stdout.split(b"\0") if p}
