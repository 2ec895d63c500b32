"""Regressions of what tests/integration/test_fuzz_envd.py found in envd, on envd on the host:
an OS error the caller's own input causes is the caller's (400 / invalid_argument), not a 500
or an ``internal`` Connect error."""
import json
import os

import httpx

from envd_client import protocol


def start(envd, process: dict) -> list[dict]:
    resp = httpx.post(f"{envd.url}/process.Process/Start", content=protocol.envelope(json.dumps(
        {"process": process}).encode()), headers={"Content-Type": protocol.STREAM_CONTENT_TYPE,
                                                  "Authorization": protocol.basic_auth("user"),
                                                  "Connect-Timeout-Ms": "20000"}, timeout=30)
    assert resp.status_code == 200, resp.text
    frames, data = [], resp.content
    while len(data) >= 5:
        size = int.from_bytes(data[1:5], "big")
        frames.append(json.loads(data[5:5 + size] or b"{}"))
        data = data[5 + size:]
    return frames


def test_a_path_past_path_max_is_400(envd):
    """Was a 500 "[Errno 36] File name too long"."""
    for path in ("x" * 5000, "a/" * 3000 + "x"):
        resp = httpx.get(f"{envd.url}/files", params={"path": path, "username": "user"}, timeout=30)
        assert resp.status_code == 400, (resp.status_code, resp.text[:200])
        assert resp.json()["code"] == 400


def test_a_loop_of_links_is_400(envd, workdir):
    os.symlink(os.path.join(workdir, "b"), os.path.join(workdir, "a"))
    os.symlink(os.path.join(workdir, "a"), os.path.join(workdir, "b"))
    resp = httpx.get(f"{envd.url}/files", params={"path": os.path.join(workdir, "a"), "username": "user"},
                     timeout=30)
    assert resp.status_code == 400, (resp.status_code, resp.text[:200])
    stat = httpx.post(f"{envd.url}/filesystem.Filesystem/ListDir", json={"path": os.path.join(workdir, "a")},
                      headers={"Authorization": protocol.basic_auth("user")}, timeout=30)
    assert stat.status_code == 400, (stat.status_code, stat.text[:200])


def test_an_argv_or_environment_past_the_kernels_limit_is_invalid_argument(envd):
    """Was Connect's ``internal`` ("OSError: [Errno 7] Argument list too long")."""
    for process in ({"cmd": "/bin/echo", "args": ["x" * 10_000] * 300},
                    {"cmd": "/bin/echo", "args": ["x" * 200_000]},
                    {"cmd": "/bin/echo", "envs": {f"V{i}": "x" * 100 for i in range(30_000)}}):
        errors = [f["error"] for f in start(envd, process) if "error" in f]
        assert errors and errors[0]["code"] == "invalid_argument", errors
    assert start(envd, {"cmd": "/bin/echo", "args": ["alive"]})[-1] == {}


def test_a_tree_deeper_than_pythons_recursion_is_removed(envd, workdir):
    """Was Connect's ``internal`` (RecursionError in shutil.rmtree), found on a real VM."""
    top = os.path.join(workdir, "deep")
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):  # deeper than PATH_MAX allows as one path: made with openat
            os.mkdir("a", dir_fd=fd)
            child = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    resp = httpx.post(f"{envd.url}/filesystem.Filesystem/Remove", json={"path": top},
                      headers={"Authorization": protocol.basic_auth("root")}, timeout=60)
    assert resp.status_code == 200, (resp.status_code, resp.text[:300])
    assert not os.path.lexists(top)


def test_a_username_with_nul_is_401(envd):
    """Was a 500 ("ValueError: embedded null character" from getpwnam), found on a real VM: a name
    no account can have is an unknown user, on /files and on the RPCs' Basic auth alike."""
    for name in ("\x00", "us\x00er"):
        resp = httpx.get(f"{envd.url}/files", params={"path": "x", "username": name}, timeout=30)
        assert resp.status_code == 401, (name, resp.status_code, resp.text[:200])
        assert resp.json()["code"] == 401
    resp = httpx.get(f"{envd.url}/files?path=x&username=%00", timeout=30)
    assert resp.status_code == 401, (resp.status_code, resp.text[:200])
    listed = httpx.post(f"{envd.url}/filesystem.Filesystem/ListDir", json={"path": "/"},
                        headers={"Authorization": protocol.basic_auth("us\x00er")}, timeout=30)
    assert listed.status_code == 401, (listed.status_code, listed.text[:200])
