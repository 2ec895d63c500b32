"""E2B's sandbox metrics endpoints on stored samples (the node side mocked: rows are what
its sampler writes): the shape the SDK's models read, the start/end window, the newest
sample per sandbox, team scoping and bad input."""
from datetime import datetime, timedelta, timezone

import pytest
from django.utils import timezone as dj_timezone
from e2b.api.client.models import SandboxesWithMetrics, SandboxMetric as SdkMetric

from sandboxes.models import Sandbox, SandboxMetric

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


def _sandbox(team, template, state="running"):
    return Sandbox.objects.create(team=team, template=template, state=state, end_at=dj_timezone.now() + timedelta(hours=1))


def _samples(sandbox, count, start=T0, step=5):
    return [SandboxMetric.objects.create(sandbox=sandbox, timestamp=start + timedelta(seconds=step * i), cpu_count=2,
                                         cpu_used_pct=10.0 + i, mem_used=(100 + i) * 2**20, mem_total=512 * 2**20,
                                         mem_cache=7 * 2**20, disk_used=(900 + i) * 2**20, disk_total=2048 * 2**20)
            for i in range(count)]


@pytest.fixture
def mine(team, base_template):
    sb = _sandbox(team, base_template)
    _samples(sb, 6)  # T0, +5, ..., +25 s
    return sb


async def test_metrics_are_what_the_sdk_model_reads(api, mine):
    resp = await api.get(f"/sandboxes/{mine.id}/metrics")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body) == 6
    parsed = [SdkMetric.from_dict(m) for m in body]  # KeyError on any missing field
    assert [p.timestamp for p in parsed] == [T0 + timedelta(seconds=5 * i) for i in range(6)]
    assert [p.timestamp_unix for p in parsed] == [int(T0.timestamp()) + 5 * i for i in range(6)]
    first = parsed[0]
    assert (first.cpu_count, first.cpu_used_pct, first.mem_used, first.mem_total, first.mem_cache,
            first.disk_used, first.disk_total) == (2, 10.0, 100 * 2**20, 512 * 2**20, 7 * 2**20, 900 * 2**20,
                                                   2048 * 2**20)
    assert body[0]["timestamp"].endswith("Z")


async def test_start_and_end_filter_inclusively_to_the_second(api, mine):
    t = int(T0.timestamp())
    window = (await api.get(f"/sandboxes/{mine.id}/metrics", params={"start": t + 5, "end": t + 15})).json()
    assert [m["timestampUnix"] for m in window] == [t + 5, t + 10, t + 15]
    after = (await api.get(f"/sandboxes/{mine.id}/metrics", params={"start": t + 21})).json()
    assert [m["timestampUnix"] for m in after] == [t + 25]
    before = (await api.get(f"/sandboxes/{mine.id}/metrics", params={"end": t - 1})).json()
    assert before == []  # a window before the sandbox existed: empty, as the SDK's tests expect


@pytest.mark.parametrize("params, text", [
    ({"start": "yesterday"}, "start"), ({"end": "-5"}, "end"), ({"start": "20", "end": "10"}, "start must not be after end"),
])
async def test_bad_windows_are_400(api, mine, assert_error, params, text):
    assert_error(await api.get(f"/sandboxes/{mine.id}/metrics", params=params), 400, text)


async def test_other_teams_and_dead_sandboxes_are_404(api, other_team, base_template, team, assert_error):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    theirs = await sync_to_async(_sandbox)(other_team, base_template)
    await sync_to_async(_samples)(theirs, 2)
    killed = await sync_to_async(_sandbox)(team, base_template, state="killed")
    assert_error(await api.get(f"/sandboxes/{theirs.id}/metrics"), 404, "not found")
    assert_error(await api.get(f"/sandboxes/{killed.id}/metrics"), 404, "not found")
    assert_error(await api.get("/sandboxes/nope/metrics"), 404, "not found")


async def test_newest_sample_of_each_requested_sandbox(api, mine, team, other_team, base_template):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    second = await sync_to_async(_sandbox)(team, base_template, state="paused")
    await sync_to_async(_samples)(second, 3, start=T0 + timedelta(minutes=1))
    silent = await sync_to_async(_sandbox)(team, base_template)  # no sample yet
    theirs = await sync_to_async(_sandbox)(other_team, base_template)
    await sync_to_async(_samples)(theirs, 1)

    ids = ",".join([mine.id, second.id, silent.id, theirs.id, "nope"])
    resp = await api.get("/sandboxes/metrics", params={"sandbox_ids": ids})
    assert resp.status_code == 200, resp.text
    parsed = SandboxesWithMetrics.from_dict(resp.json())
    assert set(parsed.sandboxes) == {mine.id, second.id}
    assert SdkMetric.from_dict(parsed.sandboxes[mine.id]).timestamp == T0 + timedelta(seconds=25)
    assert SdkMetric.from_dict(parsed.sandboxes[second.id]).timestamp == T0 + timedelta(minutes=1, seconds=10)


async def test_sandbox_ids_are_required_and_bounded(api, mine, assert_error):
    assert_error(await api.get("/sandboxes/metrics"), 400, "sandbox_ids is required")
    assert_error(await api.get("/sandboxes/metrics", params={"sandbox_ids": " , "}), 400, "sandbox_ids is required")
    many = ",".join(f"i{n}" for n in range(101))
    assert_error(await api.get("/sandboxes/metrics", params={"sandbox_ids": many}), 400, "at most 100")


async def test_metrics_need_an_api_key(anon, mine, assert_error):
    assert_error(await anon.get(f"/sandboxes/{mine.id}/metrics"), 401)
    assert_error(await anon.get("/sandboxes/metrics", params={"sandbox_ids": mine.id}), 401)
