"""The unchanged E2B Python SDK 2.63 with credentials from the new routes, against the real API
served by uvicorn on 127.0.0.1 (no VM: the calls used read the database only): a key made by
``POST /api-keys`` or handed out by ``GET /teams`` works in the SDK, and stops working the
moment it is deleted; ``Sandbox.delete_snapshot`` (``DELETE /templates/{id}``) and AgentENV's
``DELETE /snapshots/{id}`` agree. The SDK has no call of its own for ``/api-keys``,
``/access-tokens``, ``/teams`` or team metrics."""
import asyncio
from unittest import mock

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, SandboxException

from sandboxes.models import AccessToken, Template
from snapshots.models import Snapshot
from template_builds.models import TemplateBuild
from tests.unit.asgi_server import served

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
async def server(asgi_app, base_template):
    async with served(asgi_app) as url:
        yield url


def sdk(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


async def test_keys_from_the_api_work_in_the_sdk_until_deleted(server, raw_key):
    async with httpx.AsyncClient(base_url=server, headers={"X-API-Key": raw_key}) as api:
        made = (await api.post("/api-keys", json={"name": "sdk"})).json()
        assert await sdk(Sandbox.list(api_key=made["key"], api_url=server).next_items) == []
        assert (await api.delete(f"/api-keys/{made['id']}")).status_code == 204
    with pytest.raises(AuthenticationException):
        await sdk(Sandbox.list(api_key=made["key"], api_url=server).next_items)
    assert await sdk(Sandbox.list(api_key=raw_key, api_url=server).next_items) == []  # the team's other key


async def test_the_key_from_teams_is_the_e2b_cli_login(server, team):
    user = await sync_to_async(get_user_model().objects.create_user)("fay", password="pw-fay-12345")
    await sync_to_async(team.members.add)(user)
    _, token = await sync_to_async(AccessToken.generate)(user, "cli")
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {token}"}) as person:
        teams = (await person.get("/teams")).json()
    assert [t["teamID"] for t in teams] == [str(team.pk)]
    assert await sdk(Sandbox.list(api_key=teams[0]["apiKey"], api_url=server).next_items) == []


async def test_delete_snapshot_through_the_sdk_and_agentenvs_route(server, raw_key, team, base_template, node,
                                                                   nodes_mock):
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    one = await Snapshot.objects.acreate(team=team, template=base_template, node=node, name="one", state="ready")
    two = await Snapshot.objects.acreate(team=team, template=base_template, node=node, name="two", state="ready")
    template = await Template.objects.acreate(id="tpl-x", alias="x", team=team, image="base")
    await TemplateBuild.objects.acreate(template=template, status="building", from_template="one")
    with pytest.raises(SandboxException, match="template builds"):
        await sdk(Sandbox.delete_snapshot, one.id, api_key=raw_key, api_url=server)
    assert await sdk(Sandbox.delete_snapshot, two.id, api_key=raw_key, api_url=server) is True
    async with httpx.AsyncClient(base_url=server, headers={"X-API-Key": raw_key}) as api:
        assert (await api.get(f"/snapshots/{two.id}")).status_code == 404
        assert (await api.delete(f"/snapshots/{one.id}")).status_code == 409
    assert await sdk(Sandbox.delete_snapshot, two.id, api_key=raw_key, api_url=server) is False  # gone: 404
