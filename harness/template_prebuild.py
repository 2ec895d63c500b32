"""``python -m harness.template_prebuild``: the steps of the system templates' recipes
(``code-interpreter-v1``: the venv's COPY and the server's) built into the node layer cache of
this machine's images dir, by a throwaway stack of their own, so that a later build of the
recipe (the VM pass's session stack, ``tests/integration/test_code_interpreter_e2e.py``) finds
every step cached and only finalizes.

Why: a fresh clone (CI) has an empty layer cache, and the venv's COPY alone took ~49 s of the
VM pass under TCG. ``scripts/test.sh`` runs this in the background of the installs and the
docs, and waits for it before the VM pass: the VM tests never share the cores with it. Nothing depends on it: if it fails or is
not run, the session's build runs every step as before.

The layer cache is keyed by the system team (the same id in every database), the base image's
recipe and the steps (``agent.builder.plan``), never by the stack, so another stack's build of the
same steps is a hit. The start and ready commands are left out here: they only make the template
snapshot, which stays with this stack (each stack's build makes its own), so the server is not
started for nothing. The stack is its own network instance (``AENV_NET_PREFIX`` ``atpb``, a
pool of ``10.98.0.0/16`` no test session takes: theirs are ``10.100``–``10.199``) with one warm
slot; it is stopped and its home removed after."""
from __future__ import annotations

import os
import sys
import time

CODE = """
import dataclasses
from asgiref.sync import async_to_sync
from template_builds.system import code_interpreter
from lifecycle.templates.system import ensure
recipe = dataclasses.replace(code_interpreter.recipe(), start_cmd="", ready_cmd="")
build = async_to_sync(ensure)(recipe, wait=True, timeout={timeout})
print("timings:", (build.result or {{}}).get("timings"))
"""


def prebuild(timeout: float = 600) -> str:
    """The recipe's steps built (or found cached); the build's log. Raises RuntimeError.
    ``timeout`` bounds what a stuck build can add to a CI run (84 s when it works)."""
    os.environ.setdefault("AENV_NET_PREFIX", "atpb")
    os.environ.setdefault("AENV_NET_POOL", "10.98.0.0/20")
    from harness.stack import running_stack  # noqa: PLC0415 - after the network instance is chosen

    with running_stack("prebuild", with_lifecycle=False, extra_env={"AENV_NET_WARM_SLOTS": "1"}) as stack:
        return stack.manage("shell", "-v", "0", "-c", CODE.format(timeout=timeout), timeout=timeout + 60)


def main() -> int:
    t0 = time.monotonic()
    try:
        out = prebuild()
    except Exception as exc:  # noqa: BLE001 - said, and the session's build does every step instead
        print(f"system template steps: not prebuilt ({time.monotonic() - t0:.0f} s): {exc}", flush=True)
        return 1
    print(out, flush=True)
    cached = sum("CACHED" in line for line in out.splitlines())
    print(f"system template steps: prebuilt into the layer cache in {time.monotonic() - t0:.0f} s"
          f" ({cached} step(s) were cached already)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
