"""The official Node SDK (npm ``@e2b/code-interpreter``, installed by
scripts/setup_ts_code_interpreter.sh) against the server, in debug mode: the ESM suite
js_sdk.test.mjs under Node's own test runner; node must report passes and no failures."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from .conftest import ROOT

TS_DIR = ROOT / "var" / "node" / "code-interpreter-ts"
SUMMARY = re.compile(r"^\s*(?:ℹ|#)\s*(pass|fail)\s+(\d+)\s*$", re.MULTILINE)


def test_the_node_sdk(server):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < (20, 18):
        pytest.skip(f"the Node SDK needs Node.js >= 20.18 (found {version.strip()})")
    setup = subprocess.run([str(ROOT / "scripts" / "setup_ts_code_interpreter.sh")], capture_output=True, text=True,
                           env={**os.environ, "AENV_TS_CODE_INTERPRETER_DIR": str(TS_DIR)}, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_DEBUG="true", E2B_SANDBOX_URL=server.url, E2B_USER_AGENT_SOURCE="aenv-tests",
               AENV_CI_TS_DIR=str(TS_DIR), NO_COLOR="1")
    out = subprocess.run([node, "--test", "--test-reporter=spec", str(ROOT / "tests" / "code_interpreter" /
                                                                       "js_sdk.test.mjs")],
                         capture_output=True, text=True, env=env, timeout=300)
    counts = {k: int(v) for k, v in SUMMARY.findall(out.stdout)}
    assert out.returncode == 0 and counts.get("fail") == 0 and counts.get("pass", 0) >= 6, out.stdout + out.stderr
