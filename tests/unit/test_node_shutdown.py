"""agent.shutdown: a stopping node pauses its running sandboxes through the pause
transitions (events say why); one whose pause fails stays running; others' sandboxes and
sandboxes in other states are untouched; a pause that does not end in time is reported."""
import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from agent import shutdown
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


class Driver:
    def __init__(self, fail=(), block=None):
        self.paused, self.fail, self.block = [], set(fail), block
        self.settled = False

    def settle(self, timeout=None):
        self.settled = True
        return True

    def pause_to_disk(self, sandbox_id, memory=True):
        if self.block is not None and sandbox_id in self.block[0]:
            self.block[1].wait(10)
        if sandbox_id in self.fail:
            raise RuntimeError("qemu said no")
        self.paused.append(sandbox_id)
        return {"total_ms": 12.0}


def _rows():
    team = Team.objects.create(slug="t", name="t")
    tpl = Template.objects.create(id="base")
    mine = Node.objects.create(id="n1", address="127.0.0.1", last_heartbeat_at=timezone.now())
    other = Node.objects.create(id="n2", address="127.0.0.1", last_heartbeat_at=timezone.now())

    def box(node, state):
        return Sandbox.objects.create(team=team, template=tpl, node=node, state=state,
                                      end_at=timezone.now() + timedelta(minutes=5)).pk
    return {"a": box(mine, "running"), "b": box(mine, "running"), "paused": box(mine, "paused"),
            "creating": box(mine, "creating"), "theirs": box(other, "running")}


def test_running_sandboxes_are_paused_with_their_events():
    ids = _rows()
    driver = Driver(fail={ids["b"]})
    out = shutdown.pause_all("n1", driver, timeout=30)
    assert out == {ids["a"]: "paused", ids["b"]: "failed: qemu said no"}
    states = dict(Sandbox.objects.values_list("pk", "state"))
    assert states[ids["a"]] == "paused" and states[ids["b"]] == "running"  # a failed pause leaves it running
    assert states[ids["theirs"]] == "running" and states[ids["creating"]] == "creating"
    assert driver.paused == [ids["a"]] and driver.settled  # its memory safely on disk before the exit
    done = SandboxEvent.objects.get(sandbox_id=ids["a"], operation="pause", outcome="ok")
    assert done.details["reason"] == "node shutdown" and done.actor == "node:n1" and done.to_state == "paused"
    failed = SandboxEvent.objects.get(sandbox_id=ids["b"], operation="pause", outcome="error")
    assert failed.to_state == "running" and "qemu said no" in failed.message


def test_a_pause_that_takes_too_long_is_reported_and_left_to_finish():
    ids = _rows()
    release = threading.Event()
    out = shutdown.pause_all("n1", Driver(block=({ids["a"]}, release)), timeout=0.5)
    assert out[ids["a"]] == "not paused in time" and out[ids["b"]] == "paused"
    release.set()


def test_nothing_running_is_nothing_to_do():
    Node.objects.create(id="empty", address="127.0.0.1")
    assert shutdown.pause_all("empty", Driver(), timeout=1) == {}
