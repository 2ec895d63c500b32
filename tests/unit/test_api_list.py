"""GET /v2/sandboxes: filters, order, keyset pagination, metadata triple decoding."""
from datetime import timedelta
from urllib.parse import quote, urlencode

import pytest
from django.utils import timezone

from sandboxes.models import Sandbox
from lifecycle.sandboxes.queries import decode_metadata_filter

pytestmark = pytest.mark.django_db(transaction=True)


def test_metadata_triple_decoding_captured_example():
    from django.http import QueryDict  # noqa: PLC0415

    # exactly what SDK 2.63.0 put on the wire for {"k": "v", "x y": "1/2"}
    query = QueryDict("metadata=k%3Dv%26x%252520y%3D1%252F2")
    assert decode_metadata_filter(query["metadata"]) == {"k": "v", "x y": "1/2"}


def test_metadata_decoding_roundtrip_like_the_sdk():
    wanted = {"user": "a b&c", "p=q": "100%", "é": "/x/"}
    inner = urlencode({quote(k): quote(v) for k, v in wanted.items()})  # what the SDK builds
    from django.http import QueryDict  # noqa: PLC0415

    query = QueryDict(urlencode({"metadata": inner}))
    assert decode_metadata_filter(query["metadata"]) == wanted


async def _make(team, template, n, **extra):
    now = timezone.now()
    ids = []
    for i in range(n):
        sb = await Sandbox.objects.acreate(
            team=team, template=template, state=extra.get("state", "running"),
            started_at=now - timedelta(seconds=n - i), end_at=now + timedelta(hours=1),
            metadata=extra.get("metadata", {"i": str(i)}))
        ids.append(sb.id)
    return ids  # oldest first


async def test_default_order_newest_first_and_both_states(api, team, base_template):
    ids = await _make(team, base_template, 3)
    await Sandbox.objects.filter(pk=ids[0]).aupdate(state="paused")
    await Sandbox.objects.filter(pk=ids[1]).aupdate(state="killed")
    listed = (await api.get("/v2/sandboxes")).json()
    assert [s["sandboxID"] for s in listed] == [ids[2], ids[0]]
    assert [s["state"] for s in listed] == ["running", "paused"]
    asc = (await api.get("/v2/sandboxes", params={"order": "asc"})).json()
    assert [s["sandboxID"] for s in asc] == [ids[0], ids[2]]
    only_paused = (await api.get("/v2/sandboxes", params={"state": "paused"})).json()
    assert [s["sandboxID"] for s in only_paused] == [ids[0]]
    both = (await api.get("/v2/sandboxes?state=running%2Cpaused")).json()
    assert len(both) == 2


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_limit_1_walks_every_page_exactly_once(api, team, base_template, order):
    ids = await _make(team, base_template, 7)
    # equal start times must not lose or repeat rows either
    await Sandbox.objects.filter(pk__in=ids[2:5]).aupdate(started_at=timezone.now() - timedelta(seconds=3))
    seen, token, pages = [], None, 0
    while True:
        params = {"limit": 1, "order": order, **({"nextToken": token} if token else {})}
        resp = await api.get("/v2/sandboxes", params=params)
        assert resp.status_code == 200
        assert "X-Next-Token" in resp.headers["access-control-expose-headers"]
        page = resp.json()
        assert len(page) == 1
        seen.append(page[0]["sandboxID"])
        pages += 1
        token = resp.headers.get("x-next-token")
        if not token:
            break
        assert pages < 20
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen)) == 7
    starts = [s.started_at async for s in Sandbox.objects.filter(pk__in=seen)]
    assert len(starts) == 7


async def test_last_page_has_no_token(api, team, base_template):
    await _make(team, base_template, 3)
    resp = await api.get("/v2/sandboxes", params={"limit": 3})
    assert len(resp.json()) == 3 and "x-next-token" not in resp.headers
    resp = await api.get("/v2/sandboxes", params={"limit": 2})
    assert len(resp.json()) == 2 and resp.headers["x-next-token"]


async def test_filters_metadata_template_started_after(api, team, base_template):
    from sandboxes.models import Template  # noqa: PLC0415

    other = await Template.objects.acreate(id="tpl2", alias="py")
    ids = await _make(team, base_template, 3)
    await Sandbox.objects.filter(pk=ids[0]).aupdate(metadata={"user": "a b&c", "x": "1"})
    await Sandbox.objects.filter(pk=ids[1]).aupdate(template=other)
    # the SDK's encoding of {"user": "a b&c"} (spec §4.5 capture)
    resp = await api.get("/v2/sandboxes?metadata=user%3Da%252520b%252526c")
    assert [s["sandboxID"] for s in resp.json()] == [ids[0]]
    assert resp.json()[0]["metadata"] == {"user": "a b&c", "x": "1"}
    assert [s["sandboxID"] for s in (await api.get("/v2/sandboxes", params={"template": "py"})).json()] == [ids[1]]
    assert [s["sandboxID"] for s in (await api.get("/v2/sandboxes", params={"template": "tpl2"})).json()] == [ids[1]]
    third = await Sandbox.objects.aget(pk=ids[2])
    resp = await api.get("/v2/sandboxes", params={"startedAfter": third.started_at.isoformat()})
    assert [s["sandboxID"] for s in resp.json()] == [ids[2]]  # inclusive bound
    # an unencoded '+' offset arrives as a space and still parses
    raw = third.started_at.isoformat().replace("+", "%20")
    resp = await api.get(f"/v2/sandboxes?startedAfter={raw}")
    assert resp.status_code == 200 and [s["sandboxID"] for s in resp.json()] == [ids[2]]


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=-1", "limit=x", "nextToken=garbage",
                                   "nextToken=bm90IGpzb24", "nextToken=WzEsMl0", "state=running,dead",
                                   "order=sideways", "startedAfter=yesterday", "metadata=%3D%3D%26"])
async def test_bad_queries_are_400_json(api, assert_error, query):
    assert_error(await api.get(f"/v2/sandboxes?{query}"), 400)


async def test_limit_bounds_are_accepted(api):
    assert (await api.get("/v2/sandboxes?limit=1")).status_code == 200
    assert (await api.get("/v2/sandboxes?limit=100")).status_code == 200
