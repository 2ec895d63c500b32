"""The unchanged E2B Python SDK 2.63's async snapshot calls (``AsyncSandbox.list_snapshots``,
``AsyncSandbox.delete_snapshot``) against the real API under uvicorn, no VM (the node is a
mock); the sync ones are tests/unit/test_api_keys_sdk.py's and the VM tests'. AgentENV's
``GET /snapshots/{id}`` agrees with what the SDK sees."""
from datetime import timedelta
from unittest import mock

import httpx
import pytest
from django.utils import timezone
from e2b import AsyncSandbox
from e2b.exceptions import SandboxException

from sandboxes.models import Sandbox as SandboxRow
from snapshots.models import Snapshot
from tests.unit.asgi_server import served_to_sdk

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


async def test_async_list_and_delete_snapshot(asgi_app, raw_key, team, base_template, node, nodes_mock, monkeypatch):
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    kept = await Snapshot.objects.acreate(team=team, template=base_template, node=node, name="kept", state="ready")
    used = await Snapshot.objects.acreate(team=team, template=base_template, node=node, name="used", state="ready")
    await SandboxRow.objects.acreate(team=team, template=base_template, node=node, state="running",
                                     source_snapshot=used, end_at=timezone.now() + timedelta(hours=1))
    async with served_to_sdk(asgi_app, monkeypatch, raw_key) as url:
        listed = await AsyncSandbox.list_snapshots().next_items()
        assert sorted(s.snapshot_id for s in listed) == sorted([kept.id, used.id])
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": raw_key}) as api:
            got = (await api.get(f"/snapshots/{kept.id}")).json()
            assert (got["snapshotID"], got["names"]) == (kept.id, [s.names for s in listed
                                                                   if s.snapshot_id == kept.id][0])
            with pytest.raises(SandboxException) as err:
                await AsyncSandbox.delete_snapshot(used.id)  # a live sandbox restored from it
            assert err.value.status_code == 409
            assert await AsyncSandbox.delete_snapshot(kept.id) is True
            assert (await api.get(f"/snapshots/{kept.id}")).status_code == 404
            assert await AsyncSandbox.delete_snapshot(kept.id) is False
    assert [s.id async for s in Snapshot.objects.all()] == [used.id]
