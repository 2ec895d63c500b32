"""E2B's secrets API (/secrets…): the SDK 2.63 shapes, team scoping, versions, bad input as
400s, and no value in any answer, log line or row (the raw row holds only ciphertext)."""
import logging

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from team_secrets.models import Secret, SecretVersion

pytestmark = pytest.mark.django_db(transaction=True)

VALUE = "sk-live-0123456789abcdef-VALUE"


async def _create(api, name="openai-key", value=VALUE, **extra):
    resp = await api.post("/secrets", json={"name": name, "value": value, **extra})
    assert resp.status_code == 201, resp.text
    return resp.json()


async def test_create_get_list_update_delete_in_the_sdk_shape(api):
    made = await _create(api, name="OpenAI-Key", metadata={"owner": "ci"})
    assert set(made) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}
    assert made["secretID"].startswith("sec_") and made["name"] == "openai-key"
    assert made["currentVersion"] == 1 and made["metadata"] == {"owner": "ci"}
    by_id = await api.get(f"/secrets/{made['secretID']}")
    by_name = await api.get("/secrets/OPENAI-KEY")
    assert by_id.status_code == by_name.status_code == 200 and by_id.json() == by_name.json() == made
    assert by_id.headers["cache-control"] == "no-store"
    updated = await api.post(f"/secrets/{made['secretID']}", json={"value": "second"})
    assert updated.status_code == 200 and updated.json()["currentVersion"] == 2
    assert updated.json()["metadata"] == {"owner": "ci"}  # no metadata given: kept
    replaced = (await api.post("/secrets/openai-key", json={"value": "third", "metadata": {}})).json()
    assert replaced["currentVersion"] == 3 and replaced["metadata"] == {}
    versions = (await api.get("/secrets/openai-key/versions")).json()
    assert [v["version"] for v in versions] == [3, 2, 1]
    listed = await api.get("/secrets")
    assert listed.status_code == 200 and [s["secretID"] for s in listed.json()] == [made["secretID"]]
    assert (await api.delete("/secrets/openai-key")).status_code == 204
    assert (await api.get(f"/secrets/{made['secretID']}")).status_code == 404
    assert await SecretVersion.objects.acount() == 0  # every version went with it
    assert (await api.delete("/secrets/openai-key")).status_code == 404


async def test_works_through_the_unchanged_python_sdk(api, asgi_app, raw_key):
    """The SDK's own generated client parses every answer (its models raise on a missing field)."""
    from e2b.api.client.api.secrets import get_secrets, get_secrets_secret_id, post_secrets  # noqa: PLC0415
    from e2b.api.client.client import AuthenticatedClient  # noqa: PLC0415
    from e2b.api.client.models import NewSecret, Secret as SecretModel  # noqa: PLC0415
    import httpx  # noqa: PLC0415

    client = AuthenticatedClient(base_url="http://testserver", token="unused", prefix="", auth_header_name="X-API-Key")
    client.set_async_httpx_client(httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app),
                                                    base_url="http://testserver", headers={"X-API-Key": raw_key}))
    made = await post_secrets.asyncio_detailed(client=client, body=NewSecret(name="gh", value=VALUE))
    assert made.status_code == 201 and isinstance(made.parsed, SecretModel)
    got = await get_secrets_secret_id.asyncio_detailed(made.parsed.secret_id, client=client)
    assert got.parsed.name == "gh" and got.parsed.current_version == 1
    listed = await get_secrets.asyncio_detailed(client=client)
    assert [s.secret_id for s in listed.parsed] == [made.parsed.secret_id]


async def test_another_teams_secret_is_a_404_everywhere(api, asgi_app, other_key):
    import httpx  # noqa: PLC0415

    made = await _create(api)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}) as other:
        for ref in (made["secretID"], "openai-key"):
            assert (await other.get(f"/secrets/{ref}")).status_code == 404
            assert (await other.post(f"/secrets/{ref}", json={"value": "x"})).status_code == 404
            assert (await other.delete(f"/secrets/{ref}")).status_code == 404
            assert (await other.get(f"/secrets/{ref}/versions")).status_code == 404
        assert (await other.get("/secrets")).json() == []
        # the same name is free in another team
        assert (await other.post("/secrets", json={"name": "openai-key", "value": "v"})).status_code == 201
    assert (await api.get("/secrets/openai-key")).json()["currentVersion"] == 1


async def test_without_a_key_401(anon, assert_error):
    assert_error(await anon.get("/secrets"), 401)
    assert_error(await anon.post("/secrets", json={"name": "a", "value": "b"}), 401)


@pytest.mark.parametrize("body, text", [
    ({"value": "v"}, "name"),
    ({"name": "", "value": "v"}, "name"),
    ({"name": "a b", "value": "v"}, "secret name"),
    ({"name": "x{y}", "value": "v"}, "secret name"),
    ({"name": "sec_abc", "value": "v"}, "sec_"),
    ({"name": "n" * 129, "value": "v"}, "secret name"),
    ({"name": "ok"}, "value"),
    ({"name": "ok", "value": ""}, "value"),
    ({"name": "ok", "value": 5}, "value"),
    ({"name": "ok", "value": "a\r\nX-Evil: 1"}, "CR, LF"),
    ('{"name": "ok", "value": "\\ud800"}', "unicode"),  # JSON's escape of a lone surrogate
    ({"name": "ok", "value": "x" * 16385}, "longer"),
    ({"name": "ok", "value": "v", "metadata": {"a": 1}}, "metadata"),
    ({"name": "ok", "value": "v", "metadata": [1]}, "metadata"),
    ({"name": "ok", "value": "v", "metadata": {str(i): "v" for i in range(33)}}, "32"),
    ({"name": "ok", "value": "v", "metadata": {"k": "v" * 1025}}, "metadata"),
    ({"name": "ok", "value": "v", "metadata": {f"k{i}": "v" * 1000 for i in range(9)}}, "8192"),
])
async def test_bad_bodies_are_400_and_never_quote_the_value(api, assert_error, body, text):
    if isinstance(body, str):
        resp = await api.post("/secrets", content=body.encode(), headers={"content-type": "application/json"})
    else:
        resp = await api.post("/secrets", json=body)
    assert "X-Evil" not in assert_error(resp, 400, text)["message"]


async def test_a_body_that_is_no_object_is_400(api, assert_error):
    assert_error(await api.post("/secrets", json=["name", "value"]), 400, "object")
    assert_error(await api.post("/secrets", content=b"{", headers={"content-type": "application/json"}), 400)


async def test_duplicate_name_is_409_case_insensitively(api, assert_error):
    await _create(api, name="dup")
    assert_error(await api.post("/secrets", json={"name": "DUP", "value": "v"}), 409, "already exists")


async def test_update_checks_like_create(api, assert_error):
    await _create(api, name="u")
    assert_error(await api.post("/secrets/u", json={"value": "a\nb"}), 400, "CR, LF")
    assert_error(await api.post("/secrets/u", json={}), 400, "value")
    assert (await api.get("/secrets/u")).json()["currentVersion"] == 1  # nothing stored


async def test_list_pages_with_x_next_token(api, assert_error):
    for i in range(5):
        await _create(api, name=f"s{i}")
    seen, token = [], None
    while True:
        params = {"limit": 2, **({"nextToken": token} if token else {})}
        resp = await api.get("/secrets", params=params)
        assert resp.status_code == 200
        seen += [s["name"] for s in resp.json()]
        token = resp.headers.get("x-next-token")
        if not token:
            break
    assert seen == ["s4", "s3", "s2", "s1", "s0"]
    assert_error(await api.get("/secrets", params={"nextToken": "garbage!"}), 400, "nextToken")
    assert_error(await api.get("/secrets", params={"limit": 0}), 400)
    assert_error(await api.get("/secrets", params={"limit": 101}), 400)


def _raw_rows() -> list:
    """Every column of every secrets row, as a database dump would show them."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM team_secrets_secretversion")
        rows = cursor.fetchall()
        cursor.execute("SELECT * FROM team_secrets_secret")
        return rows + cursor.fetchall()


async def test_no_value_in_answers_logs_or_the_raw_rows(api, caplog):
    caplog.set_level(logging.DEBUG)
    made = await _create(api, name="raw")
    await api.post("/secrets/raw", json={"value": VALUE + "-2"})
    answers = [await api.get("/secrets"), await api.get("/secrets/raw"), await api.get("/secrets/raw/versions")]
    for resp in answers:
        assert VALUE not in resp.text
    assert VALUE not in caplog.text
    rows = await sync_to_async(_raw_rows)()
    dump = repr(rows).encode() + b"".join(bytes(c) for r in rows for c in r if isinstance(c, (bytes, memoryview)))
    assert len(rows) == 3 and VALUE.encode() not in dump and b"0123456789abcdef" not in dump
    assert await Secret.objects.filter(pk=made["secretID"]).aexists()


@pytest.mark.django_db(transaction=True)
def test_the_python_sdks_secret_class_end_to_end(live_server, raw_key, monkeypatch):
    """The unchanged SDK's high-level ``Secret`` over real HTTP (E2B_API_URL)."""
    from e2b import Secret as SdkSecret  # noqa: PLC0415

    monkeypatch.setenv("E2B_API_URL", live_server.url)
    monkeypatch.setenv("E2B_API_KEY", raw_key)
    made = SdkSecret.create("Sdk-Key", VALUE, metadata={"a": "b"})
    assert made.secret_id.startswith("sec_") and made.name == "sdk-key" and made.version == 1
    assert made.metadata == {"a": "b"}
    assert SdkSecret.get_info("sdk-key").secret_id == made.secret_id
    assert SdkSecret.exists("SDK-KEY") and not SdkSecret.exists("nope")
    assert SdkSecret.update(made.secret_id, "v2").version == 2
    pages, seen = SdkSecret.list(limit=1), []
    while pages.has_next:
        seen += pages.next_items()
    assert [s.name for s in seen] == ["sdk-key"]
    assert SdkSecret.fill("sdk-key") == "${e2b.secrets.sdk-key}"
    assert SdkSecret.destroy("sdk-key") is True and SdkSecret.destroy("sdk-key") is False
