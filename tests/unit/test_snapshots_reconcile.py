"""Node-side reconcile of interrupted snapshots and forks (agent.reconcile_snapshots) with a
stub driver and a stub envd: rows end consistent, partial files and orphan captures go."""
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from test_snapshots_tasks import StubDriver, TokenEnvd, envd  # noqa: F401 - envd is a fixture

from sandboxes.models import Sandbox, SandboxEvent
from snapshots.models import Snapshot
from agent.reconcile_snapshots import reconcile_interrupted
from vmm.driver import Leftover

pytestmark = pytest.mark.django_db


class ReconcileDriver(StubDriver):
    def __init__(self, port, home: Path, alive: set[str]):
        super().__init__(port)
        self.home, self.alive, self.resumed, self.released = home, alive, [], []

    def info(self, sandbox_id):
        return self._info(sandbox_id) if sandbox_id in self.alive else None

    def resume(self, sandbox_id):
        self.resumed.append(sandbox_id)
        return self._info(sandbox_id)

    def gc(self, sandbox_id=None):
        """Like QEMU's: fork captures no VM refers to (here: named orphan-*) are removed."""
        removed = []
        for capture in sorted((self.home / "forks").iterdir()):
            self.released.append(capture.name)
            if capture.name.startswith("orphan"):
                capture.rmdir()
                removed.append(Leftover("fork capture", capture.name))
        return removed


def _sandbox(team, template, node, sid, state):
    now = timezone.now() - timedelta(minutes=5)
    Sandbox.objects.create(id=sid, team=team, template=template, node=node, state=state, created_at=now,
                           started_at=now, end_at=now + timedelta(hours=1), envd_access_token="tok")
    Sandbox.objects.filter(pk=sid).update(updated_at=now)


def test_interrupted_operations_settle(team, base_template, node, envd, settings, tmp_path):  # noqa: F811
    settings.AENV_HOME = tmp_path
    _sandbox(team, base_template, node, "isnap", "snapshotting")
    _sandbox(team, base_template, node, "ifork", "forking")
    _sandbox(team, base_template, node, "igone", "snapshotting")
    _sandbox(team, base_template, node, "ifresh", "running")
    snap = Snapshot.objects.create(team=team, template=base_template, node=node, source_sandbox_id="isnap")
    Snapshot.objects.filter(pk=snap.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    partial = tmp_path / "snapshots" / snap.pk
    partial.mkdir(parents=True)
    (partial / "memory.ram").write_bytes(b"half")
    (tmp_path / "forks" / "orphan-1").mkdir(parents=True)
    (tmp_path / "forks" / "inuse-2").mkdir()
    TokenEnvd.token = "tok"
    driver = ReconcileDriver(envd, tmp_path, alive={"isnap", "ifork"})

    done = reconcile_interrupted(node.id, driver, older_than=timezone.now(), at_start=True)

    states = dict(Sandbox.objects.values_list("id", "state"))
    assert states == {"isnap": "running", "ifork": "running", "igone": "error", "ifresh": "running"}
    assert sorted(driver.resumed) == ["ifork", "isnap"] and driver.killed == ["igone"]
    assert len(TokenEnvd.calls) == 2  # each continued VM got a fresh /init (clock)
    snap.refresh_from_db()
    assert snap.state == "error" and not partial.exists()
    assert not (tmp_path / "forks" / "orphan-1").exists() and (tmp_path / "forks" / "inuse-2").exists()
    assert ("fork capture", "orphan-1", "removed") in done
    ops = set(SandboxEvent.objects.filter(operation="reconcile").values_list("sandbox_id", "to_state"))
    assert {("isnap", "running"), ("ifork", "running"), ("igone", "error")} <= ops


def test_periodic_pass_leaves_long_captures_alone(team, base_template, node, envd, settings,  # noqa: F811
                                                  tmp_path):
    """While the worker runs, an old ``snapshotting`` row may be a long capture in
    progress: only the pass at start (nothing runs yet) settles anything."""
    settings.AENV_HOME = tmp_path
    _sandbox(team, base_template, node, "isnap", "snapshotting")
    snap = Snapshot.objects.create(team=team, template=base_template, node=node)
    Snapshot.objects.filter(pk=snap.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    (tmp_path / "forks" / "orphan-1").mkdir(parents=True)
    driver = ReconcileDriver(envd, tmp_path, alive={"isnap"})
    done = reconcile_interrupted(node.id, driver, older_than=timezone.now(), at_start=False)
    assert done == [] and driver.resumed == [] and driver.released == []
    assert Sandbox.objects.get(pk="isnap").state == "snapshotting"
    assert Snapshot.objects.get(pk=snap.pk).state == "creating"
    # at start, only rows last changed before the worker started count
    done = reconcile_interrupted(node.id, driver, older_than=timezone.now() - timedelta(hours=1), at_start=True)
    assert Sandbox.objects.get(pk="isnap").state == "snapshotting" and driver.resumed == []
