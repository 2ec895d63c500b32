"""The node's pause task asks the guest agent first (E2B's requireHealthyGuest): with the
VM driver replaced by a stub and envd by a local socket that answers, refuses or hangs."""
import http.server
import socket
import threading
from pathlib import Path

import pytest

from agent import driver as node_driver
from agent import guest, tasks
from agent.guest import GuestUnresponsive
from vmm.driver import VMInfo, VMStatus


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(204 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class StubDriver:
    def __init__(self, port: int, status=VMStatus.RUNNING):
        self.port, self.status, self.paused = port, status, []

    def info(self, sandbox_id):
        return VMInfo(sandbox_id=sandbox_id, pid=1, envd_host="127.0.0.1", envd_port=self.port, accel="tcg",
                      state_dir=Path("/nonexistent"), status=self.status)

    def console_path(self, sandbox_id):
        return None

    def pause_to_disk(self, sandbox_id, memory=True):
        self.paused.append((sandbox_id, memory))
        return {"save_ms": 1.0}


@pytest.fixture
def answering():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def hanging():
    """Accepts connections (the kernel's backlog) and never answers: a stopped envd."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def refusing():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture
def use_driver(monkeypatch):
    monkeypatch.setattr(guest, "GUEST_PROBE_TIMEOUT", 0.3)
    made = []

    def use(port, **kwargs):
        driver = StubDriver(port, **kwargs)
        node_driver.set_driver(driver)
        made.append(driver)
        return driver

    yield use
    node_driver.set_driver(None)


def _pause(**kwargs):
    return tasks.pause_sandbox.run(sandbox_id="s1", **kwargs)


def test_a_healthy_guest_is_paused_in_every_mode(use_driver, answering):
    driver = use_driver(answering)
    for kwargs in ({}, {"require_healthy_guest": True}, {"memory": False}):
        result = _pause(**kwargs)
        assert result["envd_unresponsive"] is False and "guest_probe" in result["timings"]
    assert driver.paused == [("s1", True), ("s1", True), ("s1", False)]


@pytest.mark.parametrize("guest_port", ["hanging", "refusing"])
def test_an_unresponsive_guest_is_refused_when_strict_or_filesystem_only(use_driver, guest_port, request):
    driver = use_driver(request.getfixturevalue(guest_port))
    for kwargs in ({"require_healthy_guest": True}, {"memory": False}):
        with pytest.raises(GuestUnresponsive, match="does not answer"):
            _pause(**kwargs)
    assert driver.paused == []  # nothing was done to the VM
    result = _pause()  # a plain pause keeps the memory anyway and says so
    assert result["envd_unresponsive"] is True and driver.paused == [("s1", True)]


def test_a_vm_not_running_is_not_probed(use_driver, refusing):
    driver = use_driver(refusing, status=VMStatus.PAUSED)
    assert _pause(require_healthy_guest=True)["envd_unresponsive"] is False
    assert driver.paused == [("s1", True)]
