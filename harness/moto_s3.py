"""A real S3 API for tests: a ``moto_server`` subprocess on a free port (shared by the
S3 store's unit tests and its end-to-end test; nothing about boto3 is mocked), on loopback
or inside a namespace of the caller's behind a rate-limited link (bench/lazy.py)."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3

from harness.ports import free_port as _free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"
# The same credentials as boto3's keyword arguments (chunkfs.sources.s3_client takes them).
CLIENT_KEYS = {"aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}


def default_credentials() -> None:
    """moto's credentials in this process's environment unless set there: boto3 clients made
    without keys (the S3 store's, the chunkfs daemon's) find them there."""
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)


def client(url: str):
    return boto3.client("s3", endpoint_url=url, region_name=REGION, **CLIENT_KEYS)


_SERVERS: dict[str, subprocess.Popen] = {}  # url -> its moto_server, while it runs


def server_pid(url: str) -> int:
    """The pid of the moto_server serving ``url`` (a benchmark counts its CPU time)."""
    return _SERVERS[url].pid


@contextlib.contextmanager
def silenced(url: str):
    """The moto_server at ``url`` stops answering until the block ends (SIGSTOP: the kernel
    still accepts connections, nothing ever answers them): a store that went away mid-read."""
    proc = _SERVERS[url]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def moto_server(bucket: str, link=None):
    """Starts moto_server, creates ``bucket`` and yields the endpoint URL; stops it after.
    ``link`` (a ``harness.shaped_link.ShapedLink``): moto runs inside that link's namespace,
    on its inside address, so its traffic crosses the link (and its rate limit); the link is
    set up here and removed after."""
    port = _free_port() if link is None else 9000
    host = "127.0.0.1" if link is None else link.inside_ip
    exe = Path(sys.executable).with_name("moto_server")
    argv = [str(exe), "-H", host, "-p", str(port)]
    if link is not None:
        link.start()
        argv = link.inside(*argv)
    proc = None
    url = f"http://{host}:{port}"
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((host, port)) == 0:
                    break
            assert proc.poll() is None, "moto_server exited"
            time.sleep(0.1)
        client(url).create_bucket(Bucket=bucket)
        _SERVERS[url] = proc
        yield url
    finally:
        _SERVERS.pop(url, None)
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        if link is not None:
            link.stop()
