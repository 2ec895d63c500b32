"""The API's side of a pause refused for a full node disk (vmm.errors.HostDiskFull, see
test_pause_disk_full.py): a clean 503 with Retry-After, not a 500, and the sandbox running again
with the pause's error event (the node continued the VM)."""
import pytest

from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_pause_refused_for_a_full_node_disk_is_503_and_the_sandbox_runs(api, create, nodes_mock,
                                                                               assert_error):
    sb = await create()
    nodes_mock.client.pause_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "sandbox x: not paused, no room on the node's disk for its saved state ([Errno 28] No space left on "
        "device); it runs on", kind="HostDiskFull")
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})
    assert_error(resp, 503, "has no room for this pause now")
    assert resp.headers["Retry-After"]
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "running"
    events = [(e.outcome, e.to_state) async for e in
              SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], operation="pause").order_by("id")]
    assert events[-1] == ("error", "running")
