"""Requests that name no user act as the sandbox's default user, as both SDK generations send them.

Released SDKs name the user only when the caller passes ``user=`` (and always ``user`` for
envd < 0.4.0): ``/files`` gets ``username=``, RPCs ``Authorization: Basic base64("name:")``.
Newer ones, for envd >= 0.4.0, send neither and rely on envd's default user: its home for
relative paths, its uid for what is created. Here the default user (set by /init, as E2B's
orchestrator does) is an account whose home does not exist yet, like a template's ``USER``
made without ``--create-home``: before envd created a missing home, every relative write was
refused with ``403: permission denied: cannot write in '/'``."""
import base64
import json
import os
import pwd
import shutil
import struct
import subprocess
import uuid

import httpx
import pytest

from .conftest import EnvdServer
from .test_http_raw import _frames

NAME = "aenvdefusr"
HOME = f"/aenv-default-user-home-{uuid.uuid4().hex[:8]}"  # at the top level: its parent is "/"
# The module's tests on one pytest-xdist worker: each worker would run the module fixtures,
# and the account is one passwd entry that two workers would make, re-home and delete under
# each other (each worker imports this module with a HOME of its own).
pytestmark = pytest.mark.xdist_group("envd-default-user")

GENERATIONS = ["names-the-user", "names-no-user"]  # SDK for envd < 0.4.0 or user=; newer SDK


@pytest.fixture(scope="module")
def account(sandbox_user):
    """An account whose home directory is missing, removed afterwards."""
    subprocess.run(["userdel", NAME], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", "--home-dir", HOME, "--shell", "/bin/bash", NAME], check=True)
    try:
        yield pwd.getpwnam(NAME)
    finally:
        subprocess.run(["userdel", NAME], capture_output=True)
        shutil.rmtree(HOME, ignore_errors=True)


@pytest.fixture(scope="module")
def server(account):
    srv = EnvdServer()
    try:
        assert httpx.post(srv.url + "/init", json={"defaultUser": NAME}).status_code == 204
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server, account):
    """Each test starts with the default user's home missing again."""
    shutil.rmtree(HOME, ignore_errors=True)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _query(gen, **params):
    if gen == "names-the-user":
        params["username"] = NAME
    return params


def _rpc_headers(gen, streaming=False):
    headers = {"content-type": "application/connect+json" if streaming else "application/json"}
    if streaming:
        headers["connect-protocol-version"] = "1"
    if gen == "names-the-user":
        headers["authorization"] = "Basic " + base64.b64encode(f"{NAME}:".encode()).decode()
    return headers


def _owned_by_account(path, account):
    st = os.stat(path)
    return (st.st_uid, st.st_gid) == (account.pw_uid, account.pw_gid)


@pytest.mark.parametrize("gen", GENERATIONS)
def test_multipart_files_with_relative_filenames(client, account, gen):
    """``files.write([{path: 'one_test_file.txt', ...}, ...])``: multipart, no ``path``
    parameter, each part's filename relative (a directory in it is kept)."""
    r = client.post("/files", params=_query(gen), files=[
        ("file", ("one_test_file.txt", b"This is a test file.", "text/plain")),
        ("file", ("sub/two.txt", b"two", "text/plain")),
    ])
    assert r.status_code == 200, r.text
    assert r.json() == [
        {"name": "one_test_file.txt", "type": "file", "path": f"{HOME}/one_test_file.txt"},
        {"name": "two.txt", "type": "file", "path": f"{HOME}/sub/two.txt"},
    ]
    for path in (HOME, f"{HOME}/sub", f"{HOME}/one_test_file.txt", f"{HOME}/sub/two.txt"):
        assert _owned_by_account(path, account), path
    assert os.stat(HOME).st_mode & 0o777 == 0o755
    assert open(f"{HOME}/sub/two.txt", "rb").read() == b"two"


@pytest.mark.parametrize("gen", GENERATIONS)
def test_single_file_uploads_and_read_with_a_relative_path(client, account, gen):
    """``files.write('rel.txt', ...)`` (multipart with ``path`` = the part's filename),
    octet-stream uploads, and ``files.read`` of a relative path."""
    r = client.post("/files", params=_query(gen, path="rel.txt"), files=[("file", ("rel.txt", b"multipart"))])
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "rel.txt", "type": "file", "path": f"{HOME}/rel.txt"}]
    shutil.rmtree(HOME)
    r = client.post("/files", params=_query(gen, path="~/deep/oct.txt"), content=b"octet",
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "oct.txt", "type": "file", "path": f"{HOME}/deep/oct.txt"}]
    assert _owned_by_account(f"{HOME}/deep/oct.txt", account) and _owned_by_account(f"{HOME}/deep", account)
    r = client.get("/files", params=_query(gen, path="deep/oct.txt"))
    assert r.status_code == 200 and r.content == b"octet"


@pytest.mark.parametrize("gen", GENERATIONS)
def test_rpcs_without_a_basic_auth_user(client, account, gen):
    """``commands.run`` (Process/Start without ``cwd``), ``files.make_dir``,
    ``files.get_info`` (Stat) and ``files.list`` (ListDir) with relative paths."""
    msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "id -un; pwd"]}, "stdin": False}).encode()
    r = client.post("/process.Process/Start", content=struct.pack(">BI", 0, len(msg)) + msg,
                    headers=_rpc_headers(gen, streaming=True))
    frames = _frames(r.content)
    assert frames[-1] == (2, {}), frames
    stdout = b"".join(base64.b64decode(f[1]["event"]["data"].get("stdout", ""))
                      for f in frames if f[0] == 0 and "data" in f[1]["event"])
    assert stdout.decode().split() == [NAME, HOME]
    r = client.post("/filesystem.Filesystem/MakeDir", json={"path": "made/here"}, headers=_rpc_headers(gen))
    assert r.status_code == 200, r.text
    assert r.json()["entry"]["path"] == f"{HOME}/made/here" and r.json()["entry"]["owner"] == NAME
    r = client.post("/filesystem.Filesystem/Stat", json={"path": "made"}, headers=_rpc_headers(gen))
    assert r.status_code == 200 and r.json()["entry"]["owner"] == NAME
    r = client.post("/filesystem.Filesystem/ListDir", json={"path": ".", "depth": 2}, headers=_rpc_headers(gen))
    assert r.status_code == 200
    assert [e["path"] for e in r.json()["entries"]] == [f"{HOME}/made", f"{HOME}/made/here"]


@pytest.mark.parametrize("user", [None, NAME])
def test_released_python_sdk(server, client, account, user, monkeypatch):
    """The released SDK in debug mode assumes envd 99.99.99, so it names the user only when
    given ``user=``: both request shapes, through the real client."""
    from e2b import Sandbox
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    sandbox = Sandbox.create()
    infos = sandbox.files.write_files([WriteEntry(path="one_test_file.txt", data="This is a test file."),
                                       WriteEntry(path="two/b.txt", data="b")], user=user)
    assert [i.path for i in infos] == [f"{HOME}/one_test_file.txt", f"{HOME}/two/b.txt"]
    assert _owned_by_account(f"{HOME}/two/b.txt", account)
    assert sandbox.files.read("one_test_file.txt", user=user) == "This is a test file."
    assert sandbox.files.get_info("two", user=user).owner == NAME
    assert sandbox.commands.run("pwd", user=user).stdout.strip() == HOME
