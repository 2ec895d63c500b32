"""No credential reaches a log (config.log_redaction): the data plane as deployed
(``uvicorn config.dataplane_asgi:application``, its access log on) and the API as deployed
(``daphne config.asgi:application``, whose access log is written to stdout by default)
are run, asked with a signed URL and every token header, and their whole output searched."""
import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from config.log_redaction import REDACTED, redact
from harness.processes import stop
from harness.stack import free_port
from tests.unit.test_dataplane import _test_database_url

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"signature": "v1_SIGNATURESECRET", "access": "ACCESSTOKENSECRET", "api": "e2b_" + "ab" * 20,
           "traffic": "TRAFFICSECRET", "bearer": "BEARERSECRET", "query": "QUERYTOKENSECRET",
           "admin": "ADMINTOKENSECRET"}
HEADERS = {"X-Access-Token": SECRETS["access"], "X-API-Key": SECRETS["api"],
           "Authorization": f"Bearer {SECRETS['bearer']}", "E2b-Traffic-Access-Token": SECRETS["traffic"],
           "X-Admin-Token": SECRETS["admin"]}
QUERY = f"path=%2Fa&signature={SECRETS['signature']}&signature_expiration=4102444800&token={SECRETS['query']}"


def _serve_and_ask(tmp_path, argv, ready_status, requests) -> str:
    """Runs ``argv`` (a server on ``{port}``) until it answers, makes ``requests``
    (method, path, headers), stops it, and returns everything it wrote."""
    port = free_port()
    out = tmp_path / "server.log"
    env = {**os.environ, "DATABASE_URL": _test_database_url(), "AENV_HOME": str(tmp_path), "AENV_LOG_LEVEL": "DEBUG",
           "PYTHONUNBUFFERED": "1"}
    with open(out, "wb") as log:
        proc = subprocess.Popen([a.format(port=port) for a in argv], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == ready_status:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        for method, path, headers in requests:
            httpx.request(method, url + path, headers=headers, timeout=10)
        time.sleep(0.5)  # the access log line is written after the response
    finally:
        stop(proc)
    return out.read_text(errors="replace")


def _assert_clean(text: str, expect: str):
    assert expect in text, text  # the requests were logged at all
    leaked = [name for name, secret in SECRETS.items() if secret in text]
    assert not leaked, f"{leaked} in:\n{text}"
    assert REDACTED in text


def test_the_data_planes_logs_hold_no_credentials(tmp_path):
    text = _serve_and_ask(tmp_path, [sys.executable, "-m", "uvicorn", "config.dataplane_asgi:application",
                                     "--host", "127.0.0.1", "--port", "{port}", "--log-level", "debug"], 400, [
        ("GET", f"/files?{QUERY}", HEADERS),  # a signed URL naming no sandbox
        ("POST", f"/files?{QUERY}", {**HEADERS, "E2b-Sandbox-Id": "inope"}),
        ("GET", f"/x?{QUERY}", {**HEADERS, "Host": "8080-inope.localhost"}),
    ])
    _assert_clean(text, "/files?path=%2Fa&signature=")


def test_the_apis_logs_hold_no_credentials(tmp_path):
    text = _serve_and_ask(tmp_path, [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", "{port}",
                                     "config.asgi:application"], 204, [
        ("GET", f"/proxy/files?{QUERY}", HEADERS),  # AgentENV's /proxy mount: a signed URL
        ("GET", f"/sandboxes?{QUERY}", HEADERS),  # the API, with a wrong key
        ("GET", f"/nowhere?{QUERY}", HEADERS),  # Django's 404 logging
    ])
    _assert_clean(text, "/proxy/files?path=%2Fa&signature=")


def test_every_logger_and_handler_gets_redacted_records():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("aenv.test.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("GET %s %s", f"/files?{QUERY}", {"x-access-token": SECRETS["access"]})
        logger.warning("headers %r", [(b"authorization", b"Bearer " + SECRETS["bearer"].encode())])
        logger.warning("nodes asked with %s", {"X-Admin-Token": SECRETS["admin"]})  # the operators' token
        logger.warning("key %s", httpx.URL(f"http://h/files?{QUERY}"))  # no string: the whole line is redacted
        try:
            raise ValueError(f"failed on /files?{QUERY} with X-API-Key: {SECRETS['api']}")
        except ValueError:
            logger.exception("request failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "signature_expiration=4102444800" in text  # not a secret: kept
    assert not [name for name, secret in SECRETS.items() if secret in text], text


def test_redact_keeps_what_is_no_credential():
    line = '127.0.0.1:5 - "GET /files?path=%2Fa&username=user&signature=v1_x&signature_expiration=9 HTTP/1.1" 200'
    assert redact(line) == ('127.0.0.1:5 - "GET /files?path=%2Fa&username=user&signature=[redacted]'
                            '&signature_expiration=9 HTTP/1.1" 200')
    assert redact("Authorization: Basic dXNlcjpw") == "Authorization: [redacted]"
    assert (redact('{"envdAccessToken": "abc", "sandboxID": "s1"}')
            == '{"envdAccessToken": "[redacted]", "sandboxID": "s1"}')
    assert redact("authorization failed for team t") == "authorization failed for team t"
