"""Downloads that never end by themselves (``/dev/zero``, ``/dev/urandom``, a FIFO) on envd on the
host: a client that walks away must not leave envd busy, and nothing may block its event loop.

Regression of the finding of tests/integration/test_fuzz_envd.py (every request after an abandoned
``/dev/zero`` download timed out): uvicorn's ``send`` returns at once once the client is gone, so
a download loop that only yielded in ``send`` spun forever reading ``/dev/zero`` and no other
request was served; and opening a FIFO that nobody writes blocked the whole process in ``open``.
Each test runs its own envd, so one that breaks it cannot break the other modules' tests.
"""
import os
import subprocess

import httpx
import pytest

from harness.polling import until

from .conftest import EnvdServer

ENOUGH = 1 << 20  # what a client reads before it walks away


@pytest.fixture
def own_envd(sandbox_user):
    server = EnvdServer()
    yield server
    server.stop()


def open_files(server) -> list[str]:
    """What envd's process has open (targets of /proc/PID/fd)."""
    fd_dir = f"/proc/{server.proc.pid}/fd"
    out = []
    for name in os.listdir(fd_dir):
        try:
            out.append(os.readlink(os.path.join(fd_dir, name)))
        except OSError:
            pass  # closed meanwhile
    return out


def abandon(server, path, headers=None, enough=ENOUGH) -> int:
    """Start a download of ``path`` as root, read ``enough`` bytes, hang up; the bytes read."""
    got = 0
    with httpx.Client(timeout=30) as client:
        with client.stream("GET", f"{server.url}/files", params={"path": path, "username": "root"},
                           headers=headers or {}) as resp:
            assert resp.status_code == 200, resp.read()[:300]
            for chunk in resp.iter_raw():
                got += len(chunk)
                if got >= enough:
                    break
    return got


def still_serves(server, workdir):
    """/health, then an upload and a download of a small file, each answered (30 s client timeout:
    a starved envd never answers; a loaded CI host answers well within it)."""
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 204
    target = os.path.join(workdir, "after.txt")
    up = httpx.post(f"{server.url}/files", params={"path": target, "username": "user"},
                    files={"file": ("after.txt", b"still here")}, timeout=30)
    assert up.status_code == 200, up.text
    down = httpx.get(f"{server.url}/files", params={"path": target, "username": "user"}, timeout=30)
    assert down.status_code == 200 and down.content == b"still here", (down.status_code, down.text[:200])


def released(server, path):
    """envd closes ``path`` once the client is gone (its read loop stopped)."""
    until(lambda: path not in open_files(server), f"envd to close {path}", deadline=30)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
@pytest.mark.parametrize("gzip", [False, True], ids=["identity", "gzip"])
def test_an_abandoned_endless_device_download_stops(own_envd, workdir, device, gzip):
    headers = {"Accept-Encoding": "gzip"} if gzip else {"Accept-Encoding": "identity"}
    # gzip of zeros is ~1000:1, so a few KiB of it are megabytes read
    assert abandon(own_envd, device, headers, enough=4096 if gzip else ENOUGH) > 0
    released(own_envd, device)
    still_serves(own_envd, workdir)


def test_two_endless_downloads_at_once_share_envd(own_envd, workdir):
    """While one client reads /dev/zero as fast as it can, another request is still answered."""
    with httpx.Client(timeout=30) as client:
        with client.stream("GET", f"{own_envd.url}/files", params={"path": "/dev/zero", "username": "root"},
                           headers={"Accept-Encoding": "identity"}) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_raw()
            next(chunks)
            still_serves(own_envd, workdir)
            next(chunks)  # the first download still streams
    released(own_envd, "/dev/zero")
    still_serves(own_envd, workdir)


def test_a_fifo_nobody_writes_answers_empty(own_envd, workdir):
    """Opening it used to block envd's event loop until a writer came (never)."""
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    resp = httpx.get(f"{own_envd.url}/files", params={"path": fifo, "username": "root"}, timeout=30)
    assert resp.status_code == 200 and resp.content == b"", (resp.status_code, resp.content[:200])
    released(own_envd, fifo)
    still_serves(own_envd, workdir)


def held_open(fifo) -> int:
    """A read-write descriptor of ``fifo``: the FIFO has a writer (and a reader) from now on,
    whoever else opens it, so envd's first read never sees an end of file by a race."""
    return os.open(fifo, os.O_RDWR | os.O_NONBLOCK)


def test_a_fifo_streams_what_its_writer_writes(own_envd, workdir):
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    fd = held_open(fifo)
    try:
        os.write(fd, b"a line\n")
        with httpx.Client(timeout=30) as client:
            with client.stream("GET", f"{own_envd.url}/files", params={"path": fifo, "username": "root"}) as resp:
                assert resp.status_code == 200
                chunks = resp.iter_raw()
                assert next(chunks) == b"a line\n"
                os.close(fd)  # the last writer: envd's next read is the end of the file
                fd = -1
                assert b"".join(chunks) == b""
    finally:
        if fd >= 0:
            os.close(fd)
    released(own_envd, fifo)


def test_an_abandoned_endless_fifo_download_stops(own_envd, workdir):
    """A writer that never stops (``cat /dev/zero``): once the client is gone envd closes its end,
    and the writer ends on SIGPIPE."""
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    fd = held_open(fifo)
    writer = subprocess.Popen(["/bin/sh", "-c", f"exec cat /dev/zero > {fifo}"])
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("GET", f"{own_envd.url}/files", params={"path": fifo, "username": "root"}) as resp:
                assert resp.status_code == 200
                got = 0
                for chunk in resp.iter_raw():
                    got += len(chunk)
                    if got >= ENOUGH:
                        break
                os.close(fd)  # envd and the writer alone on the FIFO now
                fd = -1
        released(own_envd, fifo)
        until(lambda: writer.poll() is not None, "the FIFO's writer to end", deadline=30)
        still_serves(own_envd, workdir)
    finally:
        if fd >= 0:
            os.close(fd)
        writer.kill()
        writer.wait()


def test_a_fifo_whose_writer_is_silent_is_released_when_the_client_leaves(own_envd, workdir):
    """The FIFO has a writer that writes nothing: envd waits without blocking anyone, and stops
    waiting when the client gives up."""
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    fd = held_open(fifo)
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(30, read=1)) as client:
                with client.stream("GET", f"{own_envd.url}/files", params={"path": fifo, "username": "root"}) as resp:
                    assert resp.status_code == 200
                    still_serves(own_envd, workdir)  # while envd waits for the writer
                    resp.read()
        released(own_envd, fifo)
        still_serves(own_envd, workdir)
    finally:
        os.close(fd)
