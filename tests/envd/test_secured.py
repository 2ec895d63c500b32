"""A secured envd (/init with accessToken): token header, signed URLs, 401s."""
import datetime
import json

import httpx
import pytest
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import AuthenticationException
from packaging.version import Version

from envd import ENVD_PORT

from .conftest import EnvdServer

TOKEN = "secret-token-123"


@pytest.fixture(scope="module")
def secured(sandbox_user):
    server = EnvdServer()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    r = httpx.post(server.url + "/init", json={
        "envVars": {"SANDBOX_WIDE": "yes", "OVERRIDE_ME": "base"},
        "accessToken": TOKEN,
        "timestamp": now,
        "defaultUser": "user",
        "defaultWorkdir": "/home/user",
    })
    assert r.status_code == 204, r.text
    yield server
    server.stop()


def _sandbox(server, token):
    headers = {"E2b-Sandbox-Id": "debug_sandbox_id", "E2b-Sandbox-Port": str(ENVD_PORT)}
    if token:
        headers["X-Access-Token"] = token
    cfg = ConnectionConfig(debug=True, sandbox_url=server.url, extra_sandbox_headers=headers)
    return Sandbox(sandbox_id="debug_sandbox_id", sandbox_domain=None, envd_version=Version("0.6.4"),
                   envd_access_token=token, traffic_access_token=None, connection_config=cfg)


def test_sdk_with_token_works_and_sees_init_envs(secured):
    sbx = _sandbox(secured, TOKEN)
    assert sbx.commands.run("echo $SANDBOX_WIDE").stdout == "yes\n"
    assert sbx.commands.run("echo $OVERRIDE_ME", envs={"OVERRIDE_ME": "req"}).stdout == "req\n"
    assert sbx.commands.run("echo $OVERRIDE_ME").stdout == "base\n"
    sbx.files.write("secured.txt", "s")
    assert sbx.files.read("secured.txt") == "s"
    w = sbx.files.watch_dir("/home/user")
    sbx.files.write("secured2.txt", "s")
    assert w.get_new_events()
    w.stop()


def test_sdk_without_token_is_rejected(secured):
    sbx = _sandbox(secured, None)
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true")
    with pytest.raises(AuthenticationException):
        sbx.files.list("/home/user")
    with pytest.raises(AuthenticationException):
        sbx.files.read("/etc/hostname")


def test_raw_401_shape_and_health_is_open(secured):
    assert httpx.get(secured.url + "/health").status_code == 204
    assert httpx.post(secured.url + "/aenv/sync").status_code == 204  # the driver has no token
    r = httpx.get(secured.url + "/files", params={"path": "/etc/hostname"})
    assert r.status_code == 401 and r.json()["code"] == 401 and r.json()["message"]
    r = httpx.post(secured.url + "/process.Process/List", content=b"{}",
                   headers={"content-type": "application/json", "x-access-token": "wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.post(secured.url + "/process.Process/List", content=b"{}",
                   headers={"content-type": "application/json", "x-access-token": TOKEN})
    assert r.status_code == 200


def test_signed_urls(secured):
    sbx = _sandbox(secured, TOKEN)
    sbx.files.write("/home/user/signed.txt", "signed content")
    url = sbx.download_url("/home/user/signed.txt")
    assert "signature=v1_" in url
    r = httpx.get(url)  # no X-Access-Token: signature alone authorises
    assert r.status_code == 200 and r.text == "signed content"
    url = sbx.download_url("/home/user/signed.txt", user="root", use_signature_expiration=60)
    assert httpx.get(url).text == "signed content"
    up = sbx.upload_url("/home/user/up.txt")
    r = httpx.post(up, files={"file": ("up.txt", b"uploaded")})
    assert r.status_code == 200 and r.json()[0]["path"] == "/home/user/up.txt"
    # A read signature does not authorise a write.
    r = httpx.post(url, files={"file": ("x", b"x")})
    assert r.status_code == 401
    tampered = url.replace("signature=v1_", "signature=v1_A")
    assert httpx.get(tampered).status_code == 401


def test_expired_signature_exact_body(secured):
    sbx = _sandbox(secured, TOKEN)
    url = sbx.download_url("/home/user/signed.txt", use_signature_expiration=-10)
    r = httpx.get(url)
    assert r.status_code == 401
    assert json.loads(r.content) == {"code": 401, "message": "signature is already expired"}


def test_reinit_needs_old_token(secured):
    r = httpx.post(secured.url + "/init", json={"accessToken": "hijack"})
    assert r.status_code == 401
    r = httpx.post(secured.url + "/init", json={"envVars": {"SANDBOX_WIDE": "yes", "OVERRIDE_ME": "base"}},
                   headers={"X-Access-Token": TOKEN})
    assert r.status_code == 204
