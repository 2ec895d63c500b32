"""E2B's ``GET /teams/{teamID}/metrics`` and ``/metrics/max`` on stored sandboxes and their
state changes (what the lifecycle writes): the series' steps and values, the maximum and
when it was reached, paused sandboxes not counting, the SDK-shaped models, team scoping
(another team's id: 403, as E2B answers) and bad input."""
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model

from lifecycle.sandboxes.team_metrics import MAX_POINTS, step_for
from sandboxes.models import AccessToken, Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)  # a multiple of every step
U0 = int(T0.timestamp())


def _sandbox(team, template, created_s: int, changes: list[tuple[int, str, str]]) -> Sandbox:
    """A sandbox created ``created_s`` after T0 whose state changes (seconds after T0,
    operation, new state) are recorded as the lifecycle records them; its row ends in the
    last state."""
    created = T0 + timedelta(seconds=created_s)
    last = changes[-1][2] if changes else "running"
    sb = Sandbox.objects.create(team=team, template=template, state=last, created_at=created, started_at=created,
                                end_at=created + timedelta(hours=5))
    SandboxEvent.objects.create(sandbox=sb, operation="create", from_state="", to_state="creating", started_at=created)
    SandboxEvent.objects.create(sandbox=sb, operation="create", from_state="creating", to_state="running",
                                started_at=created + timedelta(seconds=1))
    previous = "running"
    for at, op, state in changes:
        SandboxEvent.objects.create(sandbox=sb, operation=op, from_state=previous, to_state=state,
                                    started_at=T0 + timedelta(seconds=at))
        previous = state
    return sb


@pytest.fixture
def history(team, other_team, base_template):
    """Team A: s1 runs 0..100 s (killed), s2 runs 20..60 then pauses, resumes at 300 and runs
    on, s3 is created at 40 and killed at 45; team B: 10 sandboxes at 30 s (never counted)."""
    _sandbox(team, base_template, 0, [(100, "kill", "killing"), (101, "kill", "killed")])
    _sandbox(team, base_template, 20, [(60, "pause", "pausing"), (61, "pause", "paused"),
                                        (300, "resume", "resuming"), (302, "resume", "running")])
    _sandbox(team, base_template, 40, [(45, "kill", "killing"), (46, "kill", "killed")])
    for _ in range(10):
        _sandbox(other_team, base_template, 30, [])


def _params(start=0, end=600, **extra):
    return {"start": U0 + start, "end": U0 + end, **extra}


async def test_series_steps_and_values(api, team, history):
    resp = await api.get(f"/teams/{team.pk}/metrics", params=_params(0, 600))
    assert resp.status_code == 200, resp.text
    points = resp.json()
    assert step_for(600) == 5 and len(points) == 121  # [T0, T0 + 600] in steps of 5 s
    assert all(set(p) == {"timestamp", "timestampUnix", "concurrentSandboxes", "sandboxStartRate"} for p in points)
    at = {p["timestampUnix"] - U0: p for p in points}
    assert points[0]["timestamp"].endswith("Z") and at[0]["timestamp"].startswith("2026-11-30T12:00:00")
    assert [at[s]["concurrentSandboxes"] for s in (0, 20, 40, 45, 50, 60, 65, 100, 105, 295, 300, 600)] == \
        [1, 2, 3, 3, 2, 2, 1, 1, 0, 0, 1, 1]
    assert at[0]["sandboxStartRate"] == 0.2 and at[20]["sandboxStartRate"] == 0.2 and at[40]["sandboxStartRate"] == 0.2
    assert sum(p["sandboxStartRate"] for p in points) == pytest.approx(0.6)  # 3 starts; a resume is not one


async def test_longer_windows_use_e2bs_longer_steps(api, team, history):
    day = (await api.get(f"/teams/{team.pk}/metrics", params=_params(0, 86400 - 1))).json()
    assert step_for(86400 - 1) == 120 and len(day) == 720
    assert day[0]["concurrentSandboxes"] == 3 and day[0]["sandboxStartRate"] == pytest.approx(3 / 120)
    assert day[1]["concurrentSandboxes"] == 0 and day[2]["concurrentSandboxes"] == 1  # s2 paused 60..300 s
    week = (await api.get(f"/teams/{team.pk}/metrics", params=_params(0, 7 * 86400))).json()
    assert step_for(7 * 86400) == 900 and len(week) == 7 * 96 + 1
    assert step_for(365 * 86400) > 900 and 365 * 86400 / step_for(365 * 86400) <= MAX_POINTS


async def test_default_window_is_the_last_week(api, team, base_template):
    now = datetime.now(timezone.utc)
    await sync_to_async(_sandbox)(team, base_template, int((now - T0).total_seconds()) - 3600, [])  # runs since 1 h
    points = (await api.get(f"/teams/{team.pk}/metrics")).json()
    assert len(points) in (7 * 96, 7 * 96 + 1)  # a week of 15 min steps, ending now
    assert abs(points[-1]["timestampUnix"] - now.timestamp()) < 900
    assert points[-1]["concurrentSandboxes"] == 1 and points[0]["concurrentSandboxes"] == 0


async def test_maximum_of_each_metric_and_when(api, team, history):
    url = f"/teams/{team.pk}/metrics/max"
    concurrent = (await api.get(url, params=_params(metric="concurrent_sandboxes"))).json()
    assert set(concurrent) == {"timestamp", "timestampUnix", "value"}
    assert (concurrent["value"], concurrent["timestampUnix"]) == (3, U0 + 40)  # s3 counts from its create
    rate = (await api.get(url, params=_params(metric="sandbox_start_rate"))).json()
    assert (rate["value"], rate["timestampUnix"]) == (0.2, U0)  # one start in 5 s; the first such
    later = (await api.get(url, params=_params(200, 400, metric="concurrent_sandboxes"))).json()
    assert (later["value"], later["timestampUnix"]) == (1, U0 + 300)  # resuming counts as running
    running_at_start = (await api.get(url, params=_params(70, 90, metric="concurrent_sandboxes"))).json()
    assert (running_at_start["value"], running_at_start["timestampUnix"]) == (1, U0 + 70)
    empty = (await api.get(url, params=_params(1000, 2000, metric="sandbox_start_rate"))).json()
    assert (empty["value"], empty["timestampUnix"]) == (0, U0 + 2000)


@pytest.mark.parametrize("suffix, params, text", [
    ("", {"start": "yesterday"}, "start"),
    ("", {"end": "-5"}, "end"),
    ("", {"start": "20", "end": "10"}, "start must not be after end"),
    ("", {"start": str(10**12)}, "start"),
    ("", {"start": str(U0 + 10**9)}, "start must not be after end"),  # after now, end defaulting to now
    ("/max", {}, "metric"),
    ("/max", {"metric": "cpu"}, "metric"),
    ("/max", {"metric": "concurrent_sandboxes", "start": "20", "end": "10"}, "start must not be after end"),
])
async def test_bad_input_is_400(api, team, assert_error, suffix, params, text):
    assert_error(await api.get(f"/teams/{team.pk}/metrics{suffix}", params=params), 400, text)


async def test_another_team_is_403_as_in_e2b(api, other_team, anon, assert_error):
    for suffix in ("", "/max?metric=concurrent_sandboxes"):
        assert_error(await api.get(f"/teams/{other_team.pk}/metrics{suffix}"), 403, "not authorized")
        assert_error(await api.get(f"/teams/not-a-team/metrics{suffix}"), 403, "not authorized")
        assert_error(await anon.get(f"/teams/{other_team.pk}/metrics{suffix}"), 401)


async def test_a_member_with_an_access_token(asgi_app, team, other_team, history, assert_error):
    user = await sync_to_async(get_user_model().objects.create_user)("erin", password="pw-erin-1234")
    await sync_to_async(team.members.add)(user)
    _, raw = await sync_to_async(AccessToken.generate)(user, "t")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"Authorization": f"Bearer {raw}"}) as client:
        resp = await client.get(f"/teams/{team.pk}/metrics/max", params=_params(metric="concurrent_sandboxes"))
        assert resp.status_code == 200 and resp.json()["value"] == 3
        assert_error(await client.get(f"/teams/{other_team.pk}/metrics"), 403, "not a member")
