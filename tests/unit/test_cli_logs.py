"""``aenv logs`` against a stand-in API that answers E2B's sandbox log shapes: v2
(``{logs: [{timestamp, level, message, fields}]}``, ``cursor`` / ``direction`` /
``limit`` / ``level``), v1 only (``{logs: [{timestamp, line}]}``, ``start``), and a
server that predates both (404) — told apart from an unknown sandbox. Following picks
up new lines once each and stops when the sandbox is gone."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from aenv_cli import observe

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


def stamp(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


class LogsApi:
    """E2B's log endpoints over a list of entries, in one of three server generations."""

    def __init__(self, version: int):
        self.version = version  # 2, 1 or 0 (neither)
        self.entries = []
        self.sandbox_exists = True
        self.requests = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                api.requests.append((url.path, query))
                status, body = api.answer(url.path, query)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def add(self, seconds: float, message: str, level: str = "info", **fields):
        self.entries.append({"timestamp": stamp(seconds), "level": level, "message": message, "fields": fields})

    def answer(self, path: str, query: dict):
        missing = (404, {"code": 404, "message": "sandbox sb not found"})
        if path == "/sandboxes/sb":
            return (200, {"sandboxID": "sb", "state": "running"}) if self.sandbox_exists else missing
        if not path.startswith(("/v2/sandboxes/", "/sandboxes/")) or not path.endswith("/logs"):
            return 404, {"code": 404, "message": "not found"}
        v2 = path.startswith("/v2/")
        if (v2 and self.version != 2) or (not v2 and self.version < 1):
            return 404, {"code": 404, "message": f"Not Found: {path}"}
        if not path.split("/")[-2] == "sb" or not self.sandbox_exists:
            return missing
        since = int(query.get("cursor" if v2 else "start", 0))
        limit = int(query.get("limit", 1000))
        rows = [e for e in self.entries if observe.epoch_ms(e["timestamp"]) >= since][:limit]
        if v2:
            order = ["debug", "info", "warn", "error"]
            rows = [e for e in rows if order.index(e["level"]) >= order.index(query.get("level", "debug"))]
            return 200, {"logs": rows}
        return 200, {"logs": [{"timestamp": e["timestamp"], "line": e["message"]} for e in rows]}

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def logs_api():
    made = []

    def make(version: int) -> LogsApi:
        made.append(LogsApi(version))
        return made[-1]

    yield make
    for api in made:
        api.close()


def aenv(api: LogsApi, *argv, **kwargs):
    env = {**os.environ, "E2B_API_URL": api.url, "E2B_API_KEY": "k", "TZ": "UTC"}
    return subprocess.run([sys.executable, "-m", "aenv_cli", "logs", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60, **kwargs)


def test_v2_logs_as_text_and_json_lines_with_a_level(logs_api):
    api = logs_api(2)
    api.add(0, "booted", source="console")
    api.add(1.5, "disk almost full", "warn")
    api.add(2, "envd started")
    out = aenv(api, "sb")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["2026-12-01 12:00:00 INFO  booted  source=console",
                                       "2026-12-01 12:00:01 WARN  disk almost full",
                                       "2026-12-01 12:00:02 INFO  envd started"]
    out = aenv(api, "sb", "-o", "json", "--level", "warn")
    assert [json.loads(line) for line in out.stdout.splitlines()] == [
        {"timestamp": stamp(1.5), "level": "warn", "message": "disk almost full", "fields": {}}]
    assert ("/v2/sandboxes/sb/logs", {"limit": "1000", "direction": "forward", "level": "warn"}) in api.requests


def test_pages_are_followed_without_repeating_a_line(logs_api):
    api = logs_api(2)
    for i in range(7):
        api.add(i // 2, f"line {i}")  # two lines share each second: page boundaries fall inside one
    out = aenv(api, "sb", "--limit", "3", "-o", "json")
    assert [json.loads(line)["message"] for line in out.stdout.splitlines()] == [f"line {i}" for i in range(7)]
    assert sum(path.endswith("/logs") for path, _ in api.requests) == 4  # 3 + 2 new + 2 new + 0 new


def test_a_v1_server_is_asked_the_v1_path(logs_api):
    api = logs_api(1)
    api.add(0, "from v1")
    out = aenv(api, "sb", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == [
        {"timestamp": stamp(0), "level": "info", "message": "from v1", "fields": {}}]


def test_an_older_server_is_told_apart_from_an_unknown_sandbox(logs_api):
    api = logs_api(0)
    out = aenv(api, "sb")
    assert out.returncode == 4 and "this server does not serve sandbox logs" in out.stderr
    api.sandbox_exists = False
    out = aenv(api, "sb")
    assert out.returncode == 4 and out.stderr.strip() == "aenv: 404: sandbox sb not found"


def test_follow_prints_new_lines_once_and_ends_with_the_sandbox(logs_api):
    api = logs_api(2)
    api.add(0, "first")
    env = {**os.environ, "E2B_API_URL": api.url, "E2B_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "aenv_cli", "logs", "sb", "-f", "-o", "json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["message"] == "first"
        api.add(0, "same millisecond, new line")
        api.add(3, "later")
        assert json.loads(proc.stdout.readline())["message"] == "same millisecond, new line"
        assert json.loads(proc.stdout.readline())["message"] == "later"
        api.sandbox_exists = False
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == "" and "no longer exists" in err


def test_ctrl_c_stops_following(logs_api):
    api = logs_api(2)
    env = {**os.environ, "E2B_API_URL": api.url, "E2B_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "aenv_cli", "logs", "sb", "-f"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not api.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 130
