"""A real aenv stack (daphne + uvicorn + node worker + lifecycle sweeper + QEMU VMs) for
the whole session, and `running_stack` for modules that need their own settings; a local
OCI registry with one test image for the template-build tests (Python and TypeScript SDK)."""
import os
import shutil
import uuid
from contextlib import contextmanager

import pytest

from harness import oci_images, oci_registry

from harness.stack import ROOT, Stack
from .tls_ingress import TlsIngress


@contextmanager
def running_stack(prefix: str = "e2e", **kwargs):
    """A started Stack under a fresh home; stopped, its VMs killed and its home removed after."""
    home = ROOT / "var" / "test-runs" / f"{prefix}-{uuid.uuid4().hex[:8]}"
    s = Stack(home=home, **kwargs)
    try:
        s.start()
        yield s
    finally:
        s.shutdown()
        if not os.environ.get("AENV_KEEP_TEST_HOME"):
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def stack():
    with running_stack() as s:
        yield s


@pytest.fixture
def sdk_env(stack, monkeypatch):
    """Points the official E2B SDK at the stack through its environment variables."""
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return stack


@pytest.fixture(scope="session")
def tls_ingress(stack, tmp_path_factory):
    """Host routing's TLS terminator in front of the session's data plane, as the SDKs'
    ``proxy`` (tls_ingress.py): no VM, no DNS name, no port 443."""
    host, port = stack.sandbox_url.removeprefix("http://").rsplit(":", 1)
    ingress = TlsIngress((host, int(port)), tmp_path_factory.mktemp("ingress")).start()
    yield ingress
    ingress.stop()


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """Debian's docker-registry on 127.0.0.1 for the session (skips where it cannot run)."""
    reason = oci_registry.available() or oci_images.available()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("registry")
    reg = oci_registry.start(root / "registry")
    yield reg
    oci_registry.stop(root / "registry")


@pytest.fixture(scope="session")
def app_image(registry):
    """debian (small) + an app layer, pushed once per session as <registry>/aenv-test/app:v1."""
    token = f"tpl-{uuid.uuid4().hex[:8]}"
    return oci_images.make_test_image(registry.host, "aenv-test/app", "v1", token,
                                      base_layer=oci_images.debootstrap_layer(oci_images.debian_rootfs()))
