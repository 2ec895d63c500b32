"""``GET /templates/{id}/builds/{buildID}`` (the build as E2B's ``TemplateBuild``) and
AgentENV's ``GET`` / ``DELETE /snapshots/{id}`` on stored rows (the node side mocked):
shapes, names, team scoping (another team's: 404), bad ids, and what a delete refuses with a
409 (a live sandbox restored from the snapshot, a template build running on it)."""
import uuid
from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone
from e2b.api.client.models import TemplateBuild as SdkTemplateBuild

from sandboxes.models import Sandbox, Template
from snapshots.models import Snapshot
from template_builds.models import TemplateBuild

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def built(team, other_team):
    """Team A's template "web" with a ready and a running build; team B's "web" with one."""
    mine = Template.objects.create(id="tpl-a", alias="web", team=team, image="base")
    ready = TemplateBuild.objects.create(template=mine, status="ready", cpu_count=4, memory_mb=2048,
                                         disk_size_mb=4096, finished_at=timezone.now())
    running = TemplateBuild.objects.create(template=mine, status="waiting")
    theirs = Template.objects.create(id="tpl-b", alias="web", team=other_team, image="base")
    their_build = TemplateBuild.objects.create(template=theirs, status="ready")
    return mine, ready, running, their_build


async def test_a_build_as_e2b_template_build(api, built):
    mine, ready, running, _ = built
    for ref in ("tpl-a", "web", mine.names[0]):
        resp = await api.get(f"/templates/{ref}/builds/{ready.pk}")
        assert resp.status_code == 200, (ref, resp.text)
        body = resp.json()
        parsed = SdkTemplateBuild.from_dict(body)  # the SDK's model of one build
        assert (str(parsed.build_id), parsed.status.value, parsed.cpu_count, parsed.memory_mb,
                parsed.disk_size_mb) == (str(ready.pk), "ready", 4, 2048, 4096)
        assert "finishedAt" in body
    waiting = (await api.get(f"/templates/web/builds/{running.pk}")).json()
    assert waiting["status"] == "waiting" and "finishedAt" not in waiting


async def test_build_errors(api, built, assert_error):
    mine, ready, _, their_build = built
    assert_error(await api.get(f"/templates/web/builds/{their_build.pk}"), 404, "not found")
    assert_error(await api.get(f"/templates/tpl-b/builds/{their_build.pk}"), 404, "not found")
    assert_error(await api.get(f"/templates/other/builds/{ready.pk}"), 404, "not found")
    assert_error(await api.get(f"/templates/web/builds/{uuid.uuid4()}"), 404, "not found")
    assert_error(await api.get("/templates/web/builds/not-a-uuid"), 400, "not a UUID")
    assert_error(await api.post(f"/templates/web/builds/{ready.pk}", json={}), 405)  # E2B's deprecated start
    mine.deleted_at = timezone.now()
    await mine.asave()
    assert_error(await api.get(f"/templates/tpl-a/builds/{ready.pk}"), 404, "not found")


@pytest.fixture
def snaps(team, other_team, base_template, node):
    golden = Snapshot.objects.create(team=team, template=base_template, node=node, name="golden", state="ready",
                                     cpu_count=4, memory_mb=1024, disk_size_mb=4096)
    creating = Snapshot.objects.create(team=team, template=base_template, node=node, name="wip", state="creating")
    theirs = Snapshot.objects.create(team=other_team, template=base_template, node=node, name="secret",
                                     state="ready")
    build_result = Snapshot.objects.create(team=team, template=base_template, node=node, state="ready",
                                           build_result=True)
    return golden, creating, theirs, build_result


async def test_get_by_id_or_name(api, team, snaps):
    golden = snaps[0]
    for ref in (golden.id, "golden", f"{team.slug}/golden", f"{team.slug}%2Fgolden", "golden:default"):
        resp = await api.get(f"/snapshots/{ref}")
        assert resp.status_code == 200, (ref, resp.text)
        body = resp.json()
        assert set(body) == {"snapshotID", "names", "cpuCount", "memoryMB", "diskSizeMB", "createdAt", "updatedAt"}
        assert (body["snapshotID"], body["names"], body["cpuCount"], body["memoryMB"], body["diskSizeMB"]) == \
            (golden.id, ["golden"], 4, 1024, 4096)


async def test_get_what_is_not_the_teams_ready_snapshot_is_404(api, snaps, assert_error):
    _, creating, theirs, build_result = snaps
    for ref in (creating.id, "wip", theirs.id, "secret", build_result.id, "base", "nope"):
        assert_error(await api.get(f"/snapshots/{ref}"), 404, "not found")


async def test_delete(api, snaps, nodes_mock, assert_error):
    golden, _, theirs, build_result = snaps
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    assert_error(await api.delete(f"/snapshots/{theirs.id}"), 404, "not found")
    assert_error(await api.delete(f"/snapshots/{build_result.id}"), 404, "not found")
    assert_error(await api.delete("/snapshots/nope"), 404, "not found")
    assert await Snapshot.objects.filter(pk__in=[theirs.pk, build_result.pk]).acount() == 2
    resp = await api.delete("/snapshots/golden")
    assert resp.status_code == 204, resp.text
    assert not await Snapshot.objects.filter(pk=golden.pk).aexists()
    nodes_mock.client.delete_snapshot_files.assert_awaited_once()
    assert_error(await api.get(f"/snapshots/{golden.id}"), 404, "not found")
    assert_error(await api.delete(f"/snapshots/{golden.id}"), 404, "not found")


async def test_delete_refused_while_a_live_sandbox_restored_from_it(api, team, base_template, snaps, nodes_mock,
                                                                    assert_error):
    golden = snaps[0]
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    user = await Sandbox.objects.acreate(team=team, template=base_template, state="paused", source_snapshot=golden,
                                         end_at=timezone.now() + timedelta(hours=1))
    assert_error(await api.delete(f"/snapshots/{golden.id}"), 409, user.id)
    assert (await Snapshot.objects.aget(pk=golden.pk)).state == "ready"
    user.state = "killed"
    await user.asave()
    assert (await api.delete(f"/snapshots/{golden.id}")).status_code == 204


async def test_delete_refused_while_a_template_build_runs_on_it(api, team, snaps, nodes_mock, assert_error):
    golden = snaps[0]
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    template = await Template.objects.acreate(id="tpl-c", alias="from-golden", team=team, image="base")
    build = await TemplateBuild.objects.acreate(template=template, status="building", from_template=f"{team.slug}/golden")
    other = await TemplateBuild.objects.acreate(template=template, status="building", from_template="base")
    body = assert_error(await api.delete("/snapshots/golden"), 409, "template builds")
    assert str(build.pk) in body["message"] and str(other.pk) not in body["message"]
    assert (await Snapshot.objects.aget(pk=golden.pk)).state == "ready"
    # the same refusal through E2B's path for it (Sandbox.delete_snapshot: DELETE /templates/{id})
    assert_error(await api.delete(f"/templates/{golden.id}"), 409, "template builds")
    build.status = "ready"
    await build.asave()
    assert (await api.delete(f"/snapshots/{golden.id}")).status_code == 204
    nodes_mock.client.delete_snapshot_files.assert_awaited_once()


async def test_other_verbs_and_no_key(api, anon, snaps, assert_error):
    assert_error(await anon.get(f"/snapshots/{snaps[0].id}"), 401)
    assert_error(await anon.delete(f"/snapshots/{snaps[0].id}"), 401)
    assert_error(await api.post(f"/snapshots/{snaps[0].id}", json={}), 405)
