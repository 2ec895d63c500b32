"""The dashboard terminal against a real VM: Channels' WebsocketCommunicator on the
real ASGI app (session cookie, origin check) → the consumer → envd in a QEMU
microVM. One VM per module: echo round-trip, resize seen by ``stty size``,
reconnect to the same PTY by pid after the socket went away, a pause closing the
socket with its reason and the shell surviving the resume, and a kill closing it.

The VM is booted in-process by the vmm driver (like the node worker does) and its
envd initialised with an access token; the lifecycle runs for real, with
the Celery hop to the node replaced by direct driver calls (``inproc_node``)."""
import asyncio
import secrets
import shutil
import uuid
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.utils import timezone

from dashboard import terminal
from envd_client import EnvdClient
from nodes.models import Node
from lifecycle.sandboxes import kill, pause
from sandboxes.models import Sandbox, Team, Template

from harness.stack import ROOT, shared_images_dir

pytestmark = [pytest.mark.vm, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def vm():
    from vmm.driver import BootSpec, get_driver  # noqa: PLC0415
    from vmm.images import ensure_image  # noqa: PLC0415

    ensure_image(shared_images_dir(), "base")
    home = ROOT / "var" / "test-runs" / f"term-{uuid.uuid4().hex[:8]}"
    driver = get_driver("qemu", home, shared_images_dir(), boot_timeout=240)
    sandbox_id = "iterm" + secrets.token_hex(7)
    token = secrets.token_hex(24)
    try:
        info = driver.boot(BootSpec(sandbox_id=sandbox_id, image="base", cpu_count=1, memory_mb=512,
                                    disk_size_mb=2048))
        init_envd(info, token)
        yield SimpleNamespace(driver=driver, info=info, token=token, sandbox_id=sandbox_id)
    finally:
        driver.kill(sandbox_id)
        shutil.rmtree(home, ignore_errors=True)


def init_envd(info, token: str, *, again: bool = False) -> None:
    """What the node's boot/resume tasks do: /init with the token (a re-init must show it)."""
    with EnvdClient.at(info.envd_host, info.envd_port, token if again else None, timeout=30) as envd:
        envd.init({}, access_token=token, timeout=30)


@pytest.fixture
def team(db):
    return Team.objects.create(name="Team A", slug="team-a")


@pytest.fixture
def base_template(db):
    return Template.objects.create(id="base", alias="base", image="base")


@pytest.fixture
def node(db):
    return Node.objects.create(id="term-node", address="127.0.0.1", vcpu_capacity=8, memory_mb_capacity=8192,
                               last_heartbeat_at=timezone.now())


@pytest.fixture
def dash(client, team):
    """A signed-in dashboard user of ``team`` (Django test client, for its session cookie)."""
    user = get_user_model().objects.create_user("tess", password="pw-tess-123")
    team.members.add(user)
    client.force_login(user)
    return client


@pytest.fixture
def sandbox(vm, team, base_template, node):
    """The VM as a running sandbox of ``team`` (a fresh row per test: the DB is flushed)."""
    info = vm.driver.info(vm.sandbox_id)
    return Sandbox.objects.create(
        id=vm.sandbox_id, team=team, template=base_template, node=node, state="running",
        envd_host=info.envd_host, envd_port=info.envd_port, secure=True, envd_access_token=vm.token,
        end_at=timezone.now() + timedelta(minutes=10))


@pytest.fixture
def inproc_node(vm):
    """``lifecycle.sandboxes`` with node tasks run by the in-process driver."""
    from nodes import client as real  # noqa: PLC0415
    from nodes import placement  # noqa: PLC0415

    async def kill_sandbox(node, *, sandbox_id, **_):
        return {"killed": await asyncio.to_thread(vm.driver.kill, sandbox_id)}

    async def pause_sandbox(node, *, sandbox_id, to_disk=True, **_):
        return {"to_disk": True, "timings": await asyncio.to_thread(vm.driver.pause_to_disk, sandbox_id)}

    async def resume_sandbox(node, *, sandbox_id, access_token=None, **_):
        info = await asyncio.to_thread(vm.driver.resume, sandbox_id)
        await asyncio.to_thread(lambda: init_envd(info, access_token, again=True))
        return {"envd_host": info.envd_host, "envd_port": info.envd_port, "pid": info.pid, "timings": {}}

    client = SimpleNamespace(NodeError=real.NodeError, NodeUnavailable=real.NodeUnavailable,
                             NodeTimeout=real.NodeTimeout, NodeTaskFailed=real.NodeTaskFailed,
                             kill_sandbox=kill_sandbox, pause_sandbox=pause_sandbox, resume_sandbox=resume_sandbox)
    with mock.patch("lifecycle.sandboxes.core.node_api", return_value=(client, placement)):
        yield client


def open_terminal(sandbox_id: str, dash, query: str = "cols=80&rows=24") -> WebsocketCommunicator:
    from config.asgi import application  # noqa: PLC0415

    headers = [(b"host", b"testserver"), (b"origin", b"http://testserver"),
               (b"cookie", f"sessionid={dash.cookies['sessionid'].value}".encode())]
    return WebsocketCommunicator(application, f"/ws/sandboxes/{sandbox_id}/terminal?{query}", headers=headers)


class Screen:
    """Collects what the server sends: PTY bytes, JSON status messages, the close."""

    def __init__(self, comm: WebsocketCommunicator):
        self.comm = comm
        self.output = b""
        self.status: list[dict] = []
        self.closed: dict | None = None

    async def _one(self, timeout: float) -> None:
        import json  # noqa: PLC0415

        msg = await self.comm.receive_output(timeout=timeout)
        if msg["type"] == "websocket.close":
            self.closed = msg
        elif msg.get("bytes") is not None:
            self.output += msg["bytes"]
        elif msg.get("text") is not None:
            self.status.append(json.loads(msg["text"]))

    async def until(self, check, timeout: float = 60.0, what: str = ""):
        deadline = asyncio.get_running_loop().time() + timeout
        while not check(self):
            left = deadline - asyncio.get_running_loop().time()
            assert left > 0 and self.closed is None, \
                f"waiting for {what}: closed={self.closed} tail={self.output[-400:]!r}"
            try:
                await self._one(min(left, 5))
            except asyncio.TimeoutError:
                pass
        return self

    async def ready(self) -> dict:
        await self.until(lambda s: any(m["type"] == "ready" for m in s.status), what="ready")
        return next(m for m in self.status if m["type"] == "ready")

    async def run(self, line: str, expect: str, timeout: float = 60.0) -> None:
        start = len(self.output)
        await self.comm.send_json_to({"type": "input", "data": line + "\r"})
        await self.until(lambda s: expect.encode() in s.output[start:], timeout, what=repr(expect))


async def connect(sandbox_id, dash, **kw) -> Screen:
    comm = open_terminal(sandbox_id, dash, **kw)
    connected, _ = await comm.connect(timeout=10)
    assert connected
    return Screen(comm)


async def test_echo_round_trip_and_resize(sandbox, dash):
    screen = await connect(sandbox.id, dash, query="cols=90&rows=30")
    ready = await screen.ready()
    assert ready["reconnected"] is False and ready["pid"] > 0
    # The shell computes it, so this is output, not the echo of what was typed.
    await screen.run("echo hello-$((6*7))", "hello-42")
    await screen.run("stty size", "30 90")
    await screen.comm.send_json_to({"type": "resize", "cols": 123, "rows": 41})
    await screen.run("stty size", "41 123")
    await screen.comm.send_to(bytes_data=b"echo raw-$((2+3))\r")  # binary frames are raw input too
    await screen.until(lambda s: b"raw-5" in s.output, what="raw input")
    await screen.comm.disconnect()


async def test_reload_reconnects_to_the_same_pty(sandbox, dash):
    first = await connect(sandbox.id, dash)
    pid = (await first.ready())["pid"]
    await first.run("export MARK=kept-$((40+2))", "$")
    await first.comm.disconnect()  # the page is reloaded

    second = await connect(sandbox.id, dash)
    ready = await second.ready()
    assert ready == {"type": "ready", "pid": pid, "reconnected": True}
    await second.run("echo $MARK", "kept-42")
    await second.comm.disconnect()

    # The shell ends with `exit`: the socket closes saying so, and the next open starts a new one.
    third = await connect(sandbox.id, dash)
    assert (await third.ready())["pid"] == pid
    await third.comm.send_json_to({"type": "input", "data": "exit 3\r"})
    await third.until(lambda s: s.closed is not None, what="close after exit")
    assert third.closed["code"] == terminal.CLOSE_EXITED and "exit code 3" in third.closed["reason"]
    assert {"type": "exit", "exit_code": 3, "status": "exit status 3"} in third.status
    await third.comm.disconnect(code=third.closed["code"])

    fourth = await connect(sandbox.id, dash)
    ready = await fourth.ready()
    assert ready["reconnected"] is False and ready["pid"] != pid
    await fourth.comm.disconnect()


async def test_pause_closes_with_reason_and_shell_survives_resume(sandbox, dash, team, inproc_node):
    screen = await connect(sandbox.id, dash)
    pid = (await screen.ready())["pid"]
    await screen.run("export MARK=before-pause", "$")
    await pause.pause_sandbox(team, sandbox.id, actor="test")
    await screen.until(lambda s: s.closed is not None, timeout=30, what="close on pause")
    assert screen.closed["code"] == terminal.CLOSE_NOT_RUNNING
    assert screen.closed["reason"] == "sandbox is paused: resume it to use the terminal"
    await screen.comm.disconnect(code=screen.closed["code"])

    await pause.connect_sandbox(team, sandbox.id, timeout=300, actor="test")
    again = await connect(sandbox.id, dash)
    ready = await again.ready()
    assert ready["pid"] == pid and ready["reconnected"] is True  # memory pause: the same process
    await again.run("echo $MARK", "before-pause")
    await again.comm.disconnect()


async def test_kill_closes_with_reason(sandbox, dash, team, inproc_node):
    """Last in the module: it kills the VM."""
    screen = await connect(sandbox.id, dash)
    await screen.ready()
    await screen.run("echo alive", "alive")
    await kill.kill_sandbox(team, sandbox.id, actor="test")
    await screen.until(lambda s: s.closed is not None, timeout=30, what="close on kill")
    assert screen.closed == {"type": "websocket.close", "code": terminal.CLOSE_NOT_RUNNING,
                             "reason": "sandbox was killed"}
    await screen.comm.disconnect(code=screen.closed["code"])
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("terminal-") and not t.done()] == []
