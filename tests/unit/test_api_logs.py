"""GET /sandboxes/{id}/logs and /v2/sandboxes/{id}/logs through the ASGI app: E2B's shapes
(parsed with the SDK's own generated models), pagination as the E2B CLI and dashboard
page, filters, bad parameters and team isolation."""
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from sandboxes.models import Sandbox, SandboxLog

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 12, 2, 3, 0, 0, tzinfo=timezone.utc)
LEVELS = ["info", "debug", "warn", "error", "info"]


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@pytest.fixture
async def logged(create):
    """A sandbox with 25 lines, 10 ms apart from T0, levels cycling through LEVELS."""
    sb = await create()
    await SandboxLog.objects.abulk_create([
        SandboxLog(sandbox_id=sb["sandboxID"], timestamp=T0 + timedelta(milliseconds=10 * i),
                   level=LEVELS[i % len(LEVELS)], message=f"message {i:02d}" + (" needle" if i % 7 == 0 else ""),
                   line=f"raw {i:02d}", source="envd" if i % 2 else "console", logger="envd" if i % 2 else "kernel",
                   vm_generation=1, offset=i)
        for i in range(25)])
    return sb["sandboxID"]


async def test_v1_shape_as_the_sdk_models_read_it(api, logged):
    from e2b.api.client.models.sandbox_logs import SandboxLogs

    body = (await api.get(f"/sandboxes/{logged}/logs")).json()
    parsed = SandboxLogs.from_dict(body)
    assert [entry.line for entry in parsed.logs] == [f"raw {i:02d}" for i in range(25)]
    first = parsed.log_entries[1]
    assert (first.message, first.level.value, first.fields["source"], first.fields["logger"]) == \
        ("message 01", "debug", "envd", "envd")
    assert first.timestamp == T0 + timedelta(milliseconds=10)
    assert set(body["logEntries"][0]) == {"timestamp", "level", "message", "fields"}


async def test_v1_pages_from_start_as_the_e2b_cli_does(api, logged):
    """The CLI asks from ``start`` = its last line's timestamp + 1 ms."""
    seen, start = [], None
    while True:
        params = {"limit": 7, **({"start": start} if start is not None else {})}
        entries = (await api.get(f"/sandboxes/{logged}/logs", params=params)).json()["logEntries"]
        if not entries:
            break
        seen += [e["message"][:10] for e in entries]
        start = _ms(datetime.fromisoformat(entries[-1]["timestamp"].replace("Z", "+00:00"))) + 1
    assert seen == [f"message {i:02d}" for i in range(25)]


async def test_v2_forward_backward_and_page_cursors(api, logged):
    from e2b.api.client.models.sandbox_logs_v2_response import SandboxLogsV2Response

    url = f"/v2/sandboxes/{logged}/logs"
    page = (await api.get(url, params={"limit": 10})).json()
    parsed = SandboxLogsV2Response.from_dict(page)
    assert [e.message[:10] for e in parsed.logs] == [f"message {i:02d}" for i in range(10)]
    got = [e["message"][:10] for e in page["logs"]]
    while "nextCursor" in page:
        page = (await api.get(url, params={"limit": 10, "pageCursor": page["nextCursor"]})).json()
        got += [e["message"][:10] for e in page["logs"]]
    assert got == [f"message {i:02d}" for i in range(25)] and len({e["id"] for e in page["logs"]}) == 5

    cursor = _ms(T0 + timedelta(milliseconds=100))  # line 10
    forward = (await api.get(url, params={"cursor": cursor, "limit": 3})).json()["logs"]
    assert [e["message"][:10] for e in forward] == ["message 10", "message 11", "message 12"]
    backward = (await api.get(url, params={"cursor": cursor, "limit": 3, "direction": "backward"})).json()
    assert [e["message"][:10] for e in backward["logs"]] == ["message 10", "message 09", "message 08"]
    rest = (await api.get(url, params={"direction": "backward", "pageCursor": backward["nextCursor"]})).json()
    assert [e["message"][:10] for e in rest["logs"]] == [f"message {i:02d}" for i in range(7, -1, -1)]
    newest = (await api.get(url, params={"direction": "backward", "limit": 1})).json()["logs"]  # from now
    assert newest[0]["message"] == "message 24"


async def test_v2_level_and_search(api, logged):
    url = f"/v2/sandboxes/{logged}/logs"
    warn = (await api.get(url, params={"level": "warn"})).json()["logs"]
    assert {e["level"] for e in warn} == {"warn", "error"} and len(warn) == 10
    found = (await api.get(url, params={"search": "needle"})).json()["logs"]
    assert [e["message"] for e in found] == ["message 00 needle", "message 07 needle", "message 14 needle",
                                             "message 21 needle"]
    assert (await api.get(url, params={"search": "NEEDLE"})).json()["logs"] == []  # case-sensitive
    assert (await api.get(url, params={"search": "needle", "level": "error"})).json()["logs"] == []


@pytest.mark.parametrize("params,field", [
    ({"limit": 1001}, "limit"), ({"limit": -1}, "limit"), ({"cursor": -5}, "cursor"), ({"cursor": "soon"}, "cursor"),
    ({"direction": "sideways"}, "direction"), ({"level": "loud"}, "level"), ({"search": "x" * 257}, "search"),
    ({"pageCursor": "not-a-cursor"}, "pageCursor"),
])
async def test_v2_bad_parameters_are_400(api, logged, assert_error, params, field):
    assert_error(await api.get(f"/v2/sandboxes/{logged}/logs", params=params), 400, field)


async def test_v1_bad_parameters_are_400_and_a_page_cursor_keeps_its_direction(api, logged, assert_error):
    assert_error(await api.get(f"/sandboxes/{logged}/logs", params={"start": "x"}), 400, "start")
    assert_error(await api.get(f"/sandboxes/{logged}/logs", params={"limit": 10001}), 400, "limit")
    forward = (await api.get(f"/v2/sandboxes/{logged}/logs", params={"limit": 2})).json()
    resp = await api.get(f"/v2/sandboxes/{logged}/logs",
                         params={"direction": "backward", "pageCursor": forward["nextCursor"]})
    assert_error(resp, 400, "forward")
    assert (await api.get(f"/v2/sandboxes/{logged}/logs", params={"limit": 0})).json() == {"logs": []}


async def test_logs_are_the_teams_own_and_outlive_a_kill(api, logged, asgi_app, other_key, assert_error):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}) as other:
        for path in (f"/sandboxes/{logged}/logs", f"/v2/sandboxes/{logged}/logs"):
            assert_error(await other.get(path), 404, "not found")
    assert_error(await api.get("/sandboxes/nope/logs"), 404, "not found")
    await Sandbox.objects.filter(pk=logged).aupdate(state="killed")
    assert len((await api.get(f"/v2/sandboxes/{logged}/logs")).json()["logs"]) == 25
