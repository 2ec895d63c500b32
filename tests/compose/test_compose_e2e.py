"""deploy/compose.yaml (+ compose.ci.yaml) started for real on the Docker engine: PostgreSQL,
Redis, an S3 server, the control plane and two node containers, all built from Debian/PyPI
packages on a local Debian root. The unchanged E2B SDK creates a sandbox on each node (the
other one drained), runs a command in each; each guest reaches no service of the stack, no API
port and not the other node's guest, while its node container reaches them all (so the addresses
are right); then one is paused and resumed on the other node from the S3 store, with its file.
``docker compose down -v`` afterwards. The timings go to the output (docs/deployment.md)."""
from __future__ import annotations

import json
import time

import pytest
from django.conf import settings
from e2b import Sandbox

from envd import ENVD_PORT
from harness.compose_stack import NODES, Unavailable, compose_stack

pytestmark = [pytest.mark.vm, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def stack():
    try:
        with compose_stack(settings.AENV_IMAGES_DIR) as s:
            print(f"[compose] images built in {s.timings['build_s']:.0f} s, up --wait in {s.timings['up_s']:.0f} s",
                  flush=True)
            yield s
    except Unavailable as exc:
        pytest.skip(f"no Docker engine here: {exc}")


@pytest.fixture
def sdk(stack, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return stack


def drain(stack, node: str, on: bool) -> None:
    stack.manage(f"from nodes.models import Node; assert Node.objects.filter(pk={node!r}).update(draining={on}) == 1")


def row(stack, sandbox_id: str) -> dict:
    return json.loads(stack.manage(
        "import json; from sandboxes.models import Sandbox as S; "
        f"s = S.objects.get(pk={sandbox_id!r}); print(json.dumps({{'node': s.node_id, 'state': s.state, "
        "'envd_host': s.envd_host, 'envd_port': s.envd_port, 'exported': s.pause_image_at is not None}))"))


def create_on(stack, node: str) -> Sandbox:
    """A sandbox on ``node``: every other node drains while it is placed."""
    others = [n for n in NODES if n != node]
    for other in others:
        drain(stack, other, True)
    try:
        sandbox = Sandbox.create(timeout=900)
    finally:
        for other in others:
            drain(stack, other, False)
    assert row(stack, sandbox.sandbox_id)["node"] == node
    return sandbox


def closed_from(sandbox: Sandbox, host: str, port: int) -> bool:
    """Whether a TCP connection from inside the guest to host:port fails."""
    done = sandbox.commands.run(f"timeout 5 bash -c 'echo > /dev/tcp/{host}/{port}' && echo OPEN || echo CLOSED",
                                timeout=30)
    return done.stdout.strip().endswith("CLOSED")


def test_two_nodes_a_move_through_s3_and_a_guest_reaches_nothing(sdk):
    stack = sdk
    t0 = time.monotonic()
    one, two = create_on(stack, "node-1"), create_on(stack, "node-2")
    try:
        for sandbox, node in ((one, "node-1"), (two, "node-2")):
            done = sandbox.commands.run("echo hello from $(hostname)")
            assert done.exit_code == 0 and done.stdout.startswith("hello from"), done

        # what a guest must not reach: the stack's services, the API's ports, the other node's guest
        # (its envd port, forwarded on that node's address) — while a node container does reach them
        services = {"postgres": (stack.address("postgres"), 5432), "redis": (stack.address("redis"), 6379),
                    "s3": (stack.address("s3"), 9000), "api": (stack.address("api"), 3000),
                    "dataplane": (stack.address("dataplane"), 3001)}
        placed = {node: row(stack, s.sandbox_id) for s, node in ((one, "node-1"), (two, "node-2"))}
        for guest, node, other in ((one, "node-1", "node-2"), (two, "node-2", "node-1")):
            assert not closed_from(guest, "127.0.0.1", ENVD_PORT)  # the probe can say OPEN: its own envd
            targets = {**services, f"{other}'s guest": (placed[other]["envd_host"], placed[other]["envd_port"])}
            for name, (host, port) in targets.items():
                probe = stack.exec(node, "bash", "-c", f"timeout 5 bash -c 'echo > /dev/tcp/{host}/{port}'", check=False)
                assert probe.returncode == 0, f"{node} does not reach {name} at {host}:{port}: the probe proves nothing"
                assert closed_from(guest, host, port), f"the guest on {node} reaches {name} at {host}:{port}"

        # node-1's sandbox paused (exported to S3), then resumed where only the store has it
        one.files.write("/home/user/moved.txt", "across nodes")
        one.pause()
        deadline = time.monotonic() + 300
        while not row(stack, one.sandbox_id)["exported"]:
            assert time.monotonic() < deadline, stack.logs("node-1")
            time.sleep(1)
        drain(stack, "node-1", True)
        try:
            back = Sandbox.connect(one.sandbox_id, timeout=900)
        finally:
            drain(stack, "node-1", False)
        assert row(stack, one.sandbox_id)["node"] == "node-2"
        assert back.files.read("/home/user/moved.txt") == "across nodes"
        assert back.commands.run("echo resumed").stdout.strip() == "resumed"
        print(f"[compose] two creates, a move through S3 and the probes in {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        for sandbox in (one, two):
            try:
                Sandbox.kill(sandbox.sandbox_id)
            except Exception:  # noqa: BLE001 - down -v removes what is left
                pass
