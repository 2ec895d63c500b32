"""Template builds that end badly, with real VMs (on the conftest's node kill stack, not the
session's, since one test kills its node worker): the template deleted while a RUN step
runs, and the node worker SIGKILLed mid-build. Each ends the build ``error`` with a reason saying what happened,
and leaves no build VM, no template snapshot and nothing a create could start from."""
from __future__ import annotations

import time
import uuid

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]


@pytest.fixture
def sdk(node_kill_stack, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", node_kill_stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", node_kill_stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", node_kill_stack.api_key)
    return node_kill_stack


def _start_long_build(image: str):
    name = f"fault-{uuid.uuid4().hex[:6]}"
    info = Template.build_in_background(Template().from_image(image)
                                        .run_cmd("echo step-running; sleep 600"), name)
    deadline = time.monotonic() + 600
    offset = 0
    while time.monotonic() < deadline:
        status = Template.get_build_status(info, logs_offset=offset)
        offset += len(status.log_entries)
        if any("step-running" in e.message for e in status.log_entries):
            return name, info
        assert status.status.value == "building", status
        time.sleep(0.5)
    raise AssertionError("the RUN step never started")


def _wait_error(info, seconds: float = 120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = Template.get_build_status(info)
        if status.status.value != "building":
            return status
        time.sleep(0.5)
    raise AssertionError("the build never ended")


def _build_vms(stack) -> list[int]:
    return stack.qemu_pids("build-")


def _nothing_left(stack, info, name) -> None:
    assert _build_vms(stack) == [], "the build VM is still running"
    left = stack.db("from snapshots.models import Snapshot; "
                    f"print(Snapshot.objects.filter(template_id='{info.template_id}').count())").strip()
    assert left == "0"
    with pytest.raises(SandboxException):
        Sandbox.create(name, timeout=60)


def test_deleting_the_template_mid_build_stops_it(sdk, app_image):
    stack = sdk
    name, info = _start_long_build(app_image.ref)
    assert _build_vms(stack)
    gone = httpx.delete(f"{stack.api_url}/templates/{info.template_id}", headers=stack.headers(), timeout=60)
    assert gone.status_code == 204, gone.text
    status = _wait_error(info, 60)
    assert status.status.value == "error" and status.reason.message == "the template was deleted"
    deadline = time.monotonic() + 30
    while _build_vms(stack) and time.monotonic() < deadline:
        time.sleep(0.5)  # the builder notices at its next log write and kills the VM
    _nothing_left(stack, info, name)


def test_a_node_worker_killed_mid_build_fails_it_when_it_restarts(sdk, app_image):
    stack = sdk
    name, info = _start_long_build(app_image.ref)
    stack.kill_node()  # SIGKILL: the build VM outlives the worker
    assert _build_vms(stack) and Template.get_build_status(info).status.value == "building"
    stack.start_node()
    status = _wait_error(info, 60)
    assert status.status.value == "error" and status.reason.message == "the node worker restarted during the build"
    _nothing_left(stack, info, name)
