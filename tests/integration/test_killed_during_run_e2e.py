"""E2B's ``test_sandbox_killed_during_run`` with the unchanged Python SDK, sync and async,
behind ``E2B_SANDBOX_URL`` and with host routing (``https://49983-<id>.<domain>`` through a
TLS terminator, ``tls_ingress.py``): a background command, the sandbox killed while nothing
reads the command's stream, then ``wait()`` raises "sandbox was killed or reached its end
of life".

The data plane must reset the stream (RST), not end it with a FIN: to pyqwest a FIN in the
middle of a chunked body is a protocol error, which E2B's SDK re-raises as "error reading a
body from connection…" without probing ``/health`` (2.63 still probes it, as an ambiguous
``unavailable``); a reset is a dropped connection, which every pyqwest-based SDK probes
for. So besides the message, the SDK must have seen a transport failure
(``e2b.envd.rpc.is_transport_failure``)."""
import time

import pytest
from e2b import AsyncSandbox, Sandbox, SandboxException
from e2b.envd.rpc import is_transport_failure

pytestmark = pytest.mark.vm

GONE = "sandbox was killed or reached its end of life"
WAIT_BOUND = 20.0  # s from the kill: the data plane notices within ~1 s, the probe takes at most 5 s


@pytest.fixture
def host_routed(sdk_env, tls_ingress, monkeypatch):
    """The SDK without ``E2B_SANDBOX_URL``, trusting the terminator's CA; its ``proxy``."""
    monkeypatch.delenv("E2B_SANDBOX_URL")
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_ingress.ca_file))  # pyqwest's root store
    return {"proxy": tls_ingress.socks_url}


def _check(error: SandboxException, sbx, host_routed: bool) -> None:
    url = sbx.envd_api_url
    if host_routed:
        assert url.startswith(f"https://49983-{sbx.sandbox_id}."), url
    else:
        assert not url.startswith("https://"), url
    assert GONE in str(error), repr(error)
    assert is_transport_failure(error.__cause__), (
        f"the stream ended without a reset: {error.__cause__!r} from {error.__cause__.__cause__!r}")


def _killed_during_run(**opts):
    sbx = Sandbox.create(timeout=120, **opts)
    try:
        cmd = sbx.commands.run("sleep 60", background=True)
        sbx.kill()
        started = time.monotonic()
        with pytest.raises(SandboxException) as exc_info:
            cmd.wait()
        assert time.monotonic() - started < WAIT_BOUND, "wait() took too long after the kill"
        return sbx, exc_info.value
    finally:
        Sandbox.kill(sbx.sandbox_id)


async def _akilled_during_run(**opts):
    sbx = await AsyncSandbox.create(timeout=120, **opts)
    try:
        cmd = await sbx.commands.run("sleep 60", background=True)
        await sbx.kill()
        started = time.monotonic()
        with pytest.raises(SandboxException) as exc_info:
            await cmd.wait()
        assert time.monotonic() - started < WAIT_BOUND, "wait() took too long after the kill"
        return sbx, exc_info.value
    finally:
        await AsyncSandbox.kill(sbx.sandbox_id)


def test_behind_sandbox_url(sdk_env):
    sbx, error = _killed_during_run()
    _check(error, sbx, host_routed=False)


async def test_behind_sandbox_url_async(sdk_env):
    sbx, error = await _akilled_during_run()
    _check(error, sbx, host_routed=False)


def test_with_host_routing(host_routed):
    sbx, error = _killed_during_run(**host_routed)
    _check(error, sbx, host_routed=True)


async def test_with_host_routing_async(host_routed):
    sbx, error = await _akilled_during_run(**host_routed)
    _check(error, sbx, host_routed=True)
