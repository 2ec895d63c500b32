"""A paused secured sandbox with autoResume wakes only for its credentials (issue 21 item 6),
with a real VM: through the data plane, requests without its X-Access-Token or a signature
its token made are refused as envd would refuse them and the VM stays paused; the SDK's
genuine signed URL (``E2B_SANDBOX_URL``: it names no sandbox) then resumes it."""
import httpx
import pytest
from e2b import Sandbox

pytestmark = pytest.mark.vm

UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"


def _state(stack, sandbox_id: str) -> str:
    r = httpx.get(f"{stack.api_url}/sandboxes/{sandbox_id}", headers=stack.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["state"]


def test_a_paused_secured_sandbox_wakes_only_for_its_credentials(stack, sdk_env):
    sbx = Sandbox.create(timeout=600, request_timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/home/user/kept.txt", "kept across the pause")
        url = sbx.download_url("/home/user/kept.txt")
        assert sbx.pause() is True
        base, route = stack.sandbox_url, {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        forged = f"{base}/files?path=%2Fhome%2Fuser%2Fkept.txt&signature=v1_forged"
        for method, target, headers, status, message in [
            ("GET", f"{base}/health", route, 502, "The sandbox was not found"),
            ("GET", forged, {}, 401, "invalid signature"),
            ("GET", forged, route, 401, "invalid signature"),
            ("POST", f"{base}/process.Process/List", route, 401, UNAUTHORIZED),
        ]:
            r = httpx.request(method, target, headers=headers, timeout=30)
            assert (r.status_code, r.json()["message"]) == (status, message), (method, target, r.text)
        assert _state(stack, sbx.sandbox_id) == "paused" and not stack.qemu_pids(sbx.sandbox_id)
        r = httpx.get(url, timeout=300)  # the genuine URL: resumed, then served
        assert r.status_code == 200 and r.text == "kept across the pause", r.text
        assert _state(stack, sbx.sandbox_id) == "running"
    finally:
        sbx.kill()
