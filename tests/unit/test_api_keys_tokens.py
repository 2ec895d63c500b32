"""E2B's ``/api-keys``, ``/access-tokens`` and ``/teams`` on the real ASGI app: the wire
models (E2B's names, masks, never a stored secret), who may call what (a team's API key, a
person's access token or dashboard session), team scoping (another team's key: 404; a team
the person is not in: 403), every bad input as ``{code, message}``, and that a team keeps a
working key."""
import uuid

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model

from sandboxes.models import AccessToken, ApiKey, hash_api_key

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def person(team, other_team):
    """A member of team A only, with an access token."""
    user = get_user_model().objects.create_user("bob", email="bob@example.org", password="pw-bob-1234")
    team.members.add(user)
    token, raw = AccessToken.generate(user, "laptop")
    return user, token, raw


@pytest.fixture
async def bearer(asgi_app, person):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"Authorization": f"Bearer {person[2]}"}, timeout=30) as client:
        yield client


def _is_mask(mask: dict, prefix: str) -> None:
    assert set(mask) == {"prefix", "valueLength", "maskedValuePrefix", "maskedValueSuffix"}, mask
    assert mask["prefix"] == prefix and mask["valueLength"] == 40
    assert len(mask["maskedValuePrefix"]) == 2 and len(mask["maskedValueSuffix"]) == 4


async def test_create_shows_the_key_once_and_stores_only_its_hash(api, team):
    resp = await api.post("/api-keys", json={"name": "ci"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert set(body) == {"id", "key", "mask", "name", "createdAt", "createdBy", "lastUsed"}
    raw = body["key"]
    assert raw.startswith("e2b_") and len(raw) == 44
    _is_mask(body["mask"], "e2b_")
    assert (body["mask"]["maskedValuePrefix"], body["mask"]["maskedValueSuffix"]) == (raw[4:6], raw[-4:])
    assert body["name"] == "ci" and body["createdBy"] is None and body["lastUsed"] is None  # made with a key: nobody
    row = await ApiKey.objects.aget(uid=uuid.UUID(body["id"]))
    assert row.team_id == team.pk and row.key_hash == hash_api_key(raw)
    assert raw not in {row.prefix, row.suffix, row.key_hash, row.name}
    # the new key works, and no list ever shows a key again
    assert (await api.get("/templates", headers={"X-API-Key": raw})).status_code == 200
    listed = (await api.get("/api-keys")).json()
    assert raw not in str(listed)
    mine = next(k for k in listed if k["id"] == body["id"])
    assert set(mine) == {"id", "name", "mask", "createdAt", "createdBy", "lastUsed"}
    assert mine["mask"] == body["mask"] and mine["lastUsed"] is not None  # used just now


async def test_list_is_the_teams_live_keys_only(api, team, other_key, raw_key):
    made = (await api.post("/api-keys", json={"name": "to-delete"})).json()
    second = (await api.post("/api-keys", json={"name": "kept"})).json()
    assert (await api.delete(f"/api-keys/{made['id']}")).status_code == 204
    listed = (await api.get("/api-keys")).json()
    names = [k["name"] for k in listed]
    assert "to-delete" not in names and names[0] == "kept" and len(listed) == 2  # newest first, the fixture's key
    theirs = await ApiKey.objects.filter(key_hash=hash_api_key(other_key)).aget()
    assert str(theirs.uid) not in {k["id"] for k in listed}
    assert second["id"] in {k["id"] for k in listed}


async def test_rename(api):
    made = (await api.post("/api-keys", json={"name": "old"})).json()
    resp = await api.patch(f"/api-keys/{made['id']}", json={"name": "  new name "})
    assert resp.status_code == 200, resp.text
    assert (await ApiKey.objects.aget(uid=made["id"])).name == "new name"


async def test_another_teams_key_is_404_and_untouched(api, other_key, assert_error):
    theirs = await ApiKey.objects.filter(key_hash=hash_api_key(other_key)).aget()
    assert_error(await api.patch(f"/api-keys/{theirs.uid}", json={"name": "mine now"}), 404, "not found")
    assert_error(await api.delete(f"/api-keys/{theirs.uid}"), 404, "not found")
    assert_error(await api.delete(f"/api-keys/{uuid.uuid4()}"), 404, "not found")
    await theirs.arefresh_from_db()
    assert theirs.name == "default" and theirs.revoked_at is None


@pytest.mark.parametrize("method, path, body, text", [
    ("post", "/api-keys", {}, "name"),
    ("post", "/api-keys", {"name": ""}, "name"),
    ("post", "/api-keys", {"name": "   "}, "name"),
    ("post", "/api-keys", {"name": 5}, "name"),
    ("post", "/api-keys", {"name": "x" * 129}, "name"),
    ("post", "/api-keys", ["name"], None),
    ("patch", "/api-keys/not-a-uuid", {"name": "x"}, "not a UUID"),
    ("delete", "/api-keys/not-a-uuid", None, "not a UUID"),
    ("post", "/access-tokens", {"name": None}, "name"),
    ("delete", "/access-tokens/123", None, "not a UUID"),
])
async def test_bad_input_is_400(api, bearer, assert_error, method, path, body, text):
    client = bearer if "access-tokens" in path else api
    kwargs = {} if body is None else {"json": body}
    assert_error(await client.request(method.upper(), path, **kwargs), 400, text)


async def test_malformed_json_is_400(api, assert_error):
    resp = await api.post("/api-keys", content=b"{nope", headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "json")


async def test_the_teams_last_key_cannot_be_deleted_and_the_key_in_use_stops_at_once(api, raw_key, assert_error):
    only = (await api.get("/api-keys")).json()
    assert len(only) == 1
    assert_error(await api.delete(f"/api-keys/{only[0]['id']}"), 409, "last API key")
    assert (await api.get("/api-keys")).status_code == 200  # still works
    spare = (await api.post("/api-keys", json={"name": "spare"})).json()
    # the key this request authenticates with may go once another is left
    assert (await api.delete(f"/api-keys/{only[0]['id']}")).status_code == 204
    assert_error(await api.get("/api-keys"), 401, "invalid API key")
    assert (await api.get("/api-keys", headers={"X-API-Key": spare["key"]})).status_code == 200
    assert_error(await api.delete(f"/api-keys/{spare['id']}", headers={"X-API-Key": spare["key"]}), 409, "last")


async def test_keys_through_a_persons_access_token(bearer, person, team, other_team, assert_error):
    user = person[0]
    made = await bearer.post("/api-keys", json={"name": "from the laptop"})
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["createdBy"] == {"id": str(uuid.UUID(int=user.pk)), "email": "bob@example.org"}
    assert (await ApiKey.objects.aget(uid=body["id"])).team_id == team.pk  # the default (only) team
    named = await bearer.get("/api-keys", headers={"X-Supabase-Team": str(team.pk)})
    assert body["id"] in {k["id"] for k in named.json()}
    # a team the person is not in, a team that does not exist, nonsense: the same 403
    for other in (str(other_team.pk), str(uuid.uuid4()), "nope"):
        assert_error(await bearer.get("/api-keys", headers={"X-Supabase-Team": other}), 403, "not a member")
    assert_error(await bearer.post("/api-keys", json={"name": "x"}, headers={"X-Supabase-Team": str(other_team.pk)}),
                 403, "not a member")


async def test_who_may_call_what(anon, api, bearer, person, assert_error):
    assert_error(await anon.get("/api-keys"), 401)
    assert_error(await anon.get("/teams"), 401)
    assert_error(await anon.post("/access-tokens", json={"name": "x"}), 401)
    # a team's key is nobody: no person's routes
    assert_error(await api.get("/teams"), 401)
    assert_error(await api.post("/access-tokens", json={"name": "x"}), 401)
    # wrong or unknown bearer credentials
    assert_error(await anon.get("/teams", headers={"Authorization": "Bearer sk_e2b_" + "0" * 40}), 401, "invalid")
    assert_error(await anon.get("/teams", headers={"Authorization": f"Basic {person[2]}"}), 401)
    assert_error(await anon.get("/teams", headers={"Authorization": "Bearer e2b_" + "0" * 40}), 401)
    # an inactive person's token stops working
    user = person[0]
    user.is_active = False
    await user.asave()
    assert_error(await bearer.get("/teams"), 401, "invalid access token")


async def test_access_tokens_are_shown_once_and_deleted_by_their_owner_only(bearer, person, anon, assert_error):
    resp = await bearer.post("/access-tokens", json={"name": "ci"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert set(body) == {"id", "name", "token", "mask", "createdAt"}
    raw = body["token"]
    assert raw.startswith("sk_e2b_") and len(raw) == 47
    _is_mask(body["mask"], "sk_e2b_")
    row = await AccessToken.objects.aget(pk=body["id"])
    assert row.token_hash == hash_api_key(raw) and row.user_id == person[0].pk
    headers = {"Authorization": f"Bearer {raw}"}
    assert (await anon.get("/teams", headers=headers)).status_code == 200  # it works on its own
    # someone else's token: not found, and still there
    carol = await sync_to_async(get_user_model().objects.create_user)("carol", password="pw-carol-1234")
    theirs, _ = await sync_to_async(AccessToken.generate)(carol, "hers")
    assert_error(await bearer.delete(f"/access-tokens/{theirs.pk}"), 404, "not found")
    assert await AccessToken.objects.filter(pk=theirs.pk).aexists()
    # a token may delete itself: answered, then refused
    assert (await anon.delete(f"/access-tokens/{body['id']}", headers=headers)).status_code == 204
    assert_error(await anon.get("/teams", headers=headers), 401, "invalid access token")
    assert_error(await bearer.delete(f"/access-tokens/{body['id']}"), 404, "not found")


async def test_teams_lists_the_persons_teams_with_a_new_working_key_each(bearer, person, team, other_team, anon):
    user = person[0]
    await sync_to_async(other_team.members.add)(user)
    before = await ApiKey.objects.filter(team=team).acount()
    resp = await bearer.get("/teams")
    assert resp.status_code == 200, resp.text
    teams = resp.json()
    assert [t["teamID"] for t in teams] == [str(team.pk), str(other_team.pk)]  # oldest first
    assert [t["isDefault"] for t in teams] == [True, False]
    assert [t["name"] for t in teams] == ["Team A", "Team B"]
    for t in teams:
        assert set(t) == {"teamID", "name", "apiKey", "isDefault"}
        listed = await anon.get("/api-keys", headers={"X-API-Key": t["apiKey"]})
        assert listed.status_code == 200
        assert "CLI login/configure" in {k["name"] for k in listed.json()}
    assert await ApiKey.objects.filter(team=team).acount() == before + 1
    key = await ApiKey.objects.filter(team=team, name="CLI login/configure").aget()
    assert key.created_by_id == user.pk


async def test_a_person_in_no_team(asgi_app, assert_error):
    user = await sync_to_async(get_user_model().objects.create_user)("dave", password="pw-dave-1234")
    _, raw = await sync_to_async(AccessToken.generate)(user, "t")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"Authorization": f"Bearer {raw}"}) as client:
        assert (await client.get("/teams")).json() == []
        assert_error(await client.get("/api-keys"), 403, "not a member of any team")


def test_the_dashboard_session_is_a_person_too(dash, user, team):
    """The signed-in dashboard session (E2B's Supabase session) may call the person's routes;
    a write needs the CSRF token like every form of the dashboard."""
    assert dash.get("/teams").status_code == 200
    listed = dash.get("/api-keys")
    assert listed.status_code == 200 and isinstance(listed.json(), list)
    from django.test import Client  # noqa: PLC0415

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    refused = strict.post("/access-tokens", data={"name": "x"}, content_type="application/json")
    assert refused.status_code == 403 and refused.json()["code"] == 403 and "csrf" in refused.json()["message"].lower()
    made = dash.post("/access-tokens", data={"name": "from the browser"}, content_type="application/json")
    assert made.status_code == 201 and made.json()["token"].startswith("sk_e2b_")


def test_the_first_access_token_from_manage_py(person, capsys):
    from django.core.management import call_command  # noqa: PLC0415
    from django.core.management.base import CommandError  # noqa: PLC0415

    call_command("create_access_token", "--user", "bob", "--name", "first")
    out, err = capsys.readouterr()
    raw = out.strip().removeprefix("E2B_ACCESS_TOKEN=")
    assert raw.startswith("sk_e2b_") and "team-a" in err and raw not in err
    assert AccessToken.objects.get(token_hash=hash_api_key(raw)).name == "first"
    with pytest.raises(CommandError, match="no active user"):
        call_command("create_access_token", "--user", "nobody")
    with pytest.raises(CommandError, match="name"):
        call_command("create_access_token", "--user", "bob", "--name", " ")


def test_two_deletes_of_the_last_two_keys_cannot_both_win(team, raw_key):
    """Each delete runs in its own thread and database connection, both at once, and each
    waits (up to 3 s) after revoking for the other to have revoked too before it counts what
    is left: without the team's lock both would count one key left and both would win. With
    it the second waits for the first to commit: one key goes, the other delete is a
    Conflict, the team keeps a key."""
    import threading  # noqa: PLC0415
    from unittest import mock  # noqa: PLC0415

    from django.db import connection  # noqa: PLC0415
    from django.db.models.query import QuerySet  # noqa: PLC0415

    from sandboxes.api_keys import _revoke_unless_last  # noqa: PLC0415
    from sandboxes.errors import Conflict  # noqa: PLC0415

    ApiKey.generate(team, name="second")
    keys = list(ApiKey.objects.filter(team=team))
    assert len(keys) == 2
    start, revoked, outcomes = threading.Barrier(2), threading.Barrier(2), []
    exists = QuerySet.exists

    def exists_after_both_revoked(qs):
        try:
            revoked.wait(timeout=3)
        except threading.BrokenBarrierError:
            pass  # the other one is held back by the lock
        return exists(qs)

    def delete(key):
        try:
            start.wait(timeout=10)
            _revoke_unless_last(team, key)
            outcomes.append("deleted")
        except Conflict:
            outcomes.append("conflict")
        finally:
            connection.close()

    with mock.patch.object(QuerySet, "exists", exists_after_both_revoked):
        threads = [threading.Thread(target=delete, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(outcomes) == ["conflict", "deleted"]
    assert ApiKey.objects.filter(team=team, revoked_at__isnull=True).count() == 1


def test_the_admin_lists_tokens_without_their_hash(client, person):
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    listing = client.get("/admin/sandboxes/accesstoken/?q=bob").content.decode()
    assert person[1].prefix in listing and "laptop" in listing
    page = client.get(f"/admin/sandboxes/accesstoken/{person[1].pk}/change/").content.decode()
    assert person[1].token_hash not in page and person[2] not in page
    assert client.get("/admin/sandboxes/accesstoken/add/").status_code == 403


def test_access_tokens_are_redacted_from_logs(person):
    from config.log_redaction import redact  # noqa: PLC0415

    raw = person[2]
    assert raw not in redact(f"token {raw} in a message") and "[redacted]" in redact(f"token {raw} in a message")
