"""A real S3 API for tests: a ``moto_server`` subprocess on a free port (shared by the
S3 store's unit tests and its end-to-end test; nothing about boto3 is mocked)."""
import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(url: str):
    return boto3.client("s3", endpoint_url=url, region_name=REGION,
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


@contextlib.contextmanager
def moto_server(bucket: str):
    """Starts moto_server, creates ``bucket`` and yields the endpoint URL; stops it after."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, "moto_server exited"
            time.sleep(0.1)
        client(url).create_bucket(Bucket=bucket)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
