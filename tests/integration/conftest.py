"""A real aenv stack (daphne + uvicorn + node worker + QEMU VMs) for the whole session."""
import os
import shutil
import uuid

import pytest

from .stack import ROOT, Stack


@pytest.fixture(scope="session")
def stack():
    home = ROOT / "var" / "test-runs" / f"e2e-{uuid.uuid4().hex[:8]}"
    s = Stack(home=home)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        s.kill_vm_leftovers()
        if not os.environ.get("AENV_KEEP_TEST_HOME"):
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def sdk_env(stack, monkeypatch):
    """Points the official E2B SDK at the stack through its environment variables."""
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return stack
