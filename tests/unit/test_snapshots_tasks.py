"""Node-side snapshot, restore, fork and delete tasks, run in-process with the VM driver
replaced by a stub and envd by a small HTTP server that enforces access tokens like
the real one (so the token handoff to a restored/forked child is really checked)."""
import errno
import http.server
import json
import threading
from pathlib import Path

import pytest

from agent import driver as node_driver
from agent import tasks
from agent.stores.base import PosixFsStore, SnapshotStoreError
from nodes import protocol
from vmm.driver import SnapshotManifest, VMError, VMInfo


class TokenEnvd(http.server.BaseHTTPRequestHandler):
    """POST /init: 401 unless X-Access-Token matches the current token (if any); an
    ``accessToken`` in the body becomes the new token."""

    token: str | None = None
    calls: list = []
    paths: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        cls = type(self)
        ok = not cls.token or self.headers.get("X-Access-Token") == cls.token
        cls.calls.append((self.headers.get("X-Access-Token"), body, ok))
        cls.paths.append(self.path)
        if ok and body.get("accessToken"):
            cls.token = body["accessToken"]
        self.send_response(204 if ok else 401)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def envd():
    TokenEnvd.token, TokenEnvd.calls, TokenEnvd.paths = None, [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenEnvd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


class StubDriver:
    """Records calls; ``snapshot`` writes a manifest like the QEMU driver."""

    def __init__(self, port: int):
        self.port, self.killed, self.fail_snapshot, self.fail_children = port, [], None, set()

    def _info(self, sid):
        return VMInfo(sandbox_id=sid, pid=1, envd_host="127.0.0.1", envd_port=self.port, accel="tcg",
                      state_dir=Path("/nonexistent"), timings={"total_ms": 1.0})

    def snapshot(self, sandbox_id, dest, memory=True):
        self.snapshot_memory = memory
        if memory:
            (Path(dest) / "memory.ram").write_bytes(b"x" * 4096)
            (Path(dest) / "device.state").write_bytes(b"d")
        if self.fail_snapshot:
            raise self.fail_snapshot
        files = [str(Path(dest) / "memory.ram"), str(Path(dest) / "device.state")] if memory else ["", ""]
        m = SnapshotManifest(dir=Path(dest), layers=["/base"], memory_file=files[0],
                             device_state_file=files[1], cpu_count=2, memory_mb=512,
                             disk_size_mb=2048, machine={"accel": "tcg"}, source_sandbox_id=sandbox_id,
                             timings={"pause_ms": 5.0})
        m.save()
        return m

    def boot(self, spec):
        self.booted = spec
        return self._info(spec.sandbox_id)

    def restore(self, manifest, spec, template=False, source_stays=False):
        self.restored = (manifest, spec)
        self.restored_as_template = template
        self.restored_source_stays = source_stays
        return self._info(spec.sandbox_id)

    def fork(self, sandbox_id, count, child_ids):
        return [VMError("no port") if i in self.fail_children else self._info(cid) for i, cid in enumerate(child_ids)]

    def info(self, sandbox_id):
        return self._info(sandbox_id)

    def kill(self, sandbox_id):
        self.killed.append(sandbox_id)
        return True


@pytest.fixture
def stub(envd, settings, tmp_path):
    settings.AENV_HOME = tmp_path
    d = StubDriver(envd)
    node_driver.set_driver(d)
    yield d
    node_driver.set_driver(None)


def test_store_rejects_odd_ids_and_never_overwrites(tmp_path):
    store = PosixFsStore(tmp_path)
    for bad in ("../x", "a/b", "", "X" * 3, "."):
        with pytest.raises(SnapshotStoreError):
            store.prepare(bad)
    store.prepare("sabc")
    with pytest.raises(FileExistsError):
        store.prepare("sabc")
    with pytest.raises(SnapshotStoreError):
        store.local_dir("sabc")  # no manifest yet: not a complete snapshot
    assert store.delete("sabc") is True and store.delete("sabc") is False


def test_snapshot_writes_into_the_store(stub, tmp_path):
    out = tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s1")
    assert (tmp_path / "snapshots" / "s1" / "manifest.json").is_file()
    assert out["manifest"]["source_sandbox_id"] == "i1" and out["size_bytes"] >= 4096
    assert out["timings"]["pause_ms"] == 5.0 and "task_ms" in out["timings"]
    json.dumps(out)  # the result travels through Celery's JSON serializer


@pytest.mark.parametrize("exc, kind", [(OSError(errno.ENOSPC, "No space left on device"), tasks.StorageFull),
                                       (VMError("cp: error writing 'memory.ram': No space left on device"),
                                        tasks.StorageFull),
                                       (VMError("QMP stop failed"), VMError)])
def test_failed_snapshot_leaves_no_partial_files(stub, tmp_path, exc, kind):
    stub.fail_snapshot = exc
    with pytest.raises(kind):
        tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s2")
    assert not (tmp_path / "snapshots" / "s2").exists()


def test_restore_hands_the_token_over_then_inits(stub, envd):
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s3")
    TokenEnvd.token = "source-token"  # the captured envd still wants its source's token
    out = tasks.restore_sandbox(sandbox_id="i2", snapshot_id="s3", env_vars={"A": "1"}, access_token="own-token",
                                source_token="source-token")
    assert out["envd_port"] == envd and TokenEnvd.token == "own-token"
    (h1, b1, ok1), (h2, b2, ok2) = TokenEnvd.calls
    assert (h1, b1, ok1) == ("source-token", {"accessToken": "own-token"}, True)
    assert h2 == "own-token" and ok2 and b2["envVars"] == {"A": "1"} and b2["timestamp"]
    assert stub.restored[1].sandbox_id == "i2" and stub.killed == []
    assert stub.restored_as_template is False  # a team's snapshot: copy-on-write memory


def test_a_built_templates_snapshot_is_restored_as_a_template(stub, envd):
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s5")
    tasks.restore_sandbox(sandbox_id="i3", snapshot_id="s5", env_vars={}, access_token=None, template=True)
    assert stub.restored[1].sandbox_id == "i3" and stub.restored_as_template is True
    assert stub.restored_source_stays is True  # a template's snapshot outlives its sandboxes


def test_a_moved_sandboxs_pause_image_is_restored_as_its_own_memory(stub, envd):
    """A resume on another node restores the sandbox's pause image like a template (its own RAM
    copy) but never reads its memory from it for good: the image goes once it has moved."""
    image = protocol.pause_image_of("i4")
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id=image)
    tasks.restore_sandbox(sandbox_id="i4", snapshot_id=image, env_vars={}, access_token=None, template=True)
    assert stub.restored_as_template is True and stub.restored_source_stays is False


def test_restore_with_wrong_source_token_kills_the_vm(stub):
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s4")
    TokenEnvd.token = "real-source"
    with pytest.raises(tasks.EnvdInitFailed):
        tasks.restore_sandbox(sandbox_id="i2", snapshot_id="s4", env_vars={}, access_token="own",
                              source_token="guessed")
    assert stub.killed == ["i2"]


def test_restore_of_unknown_snapshot_fails_without_a_vm(stub):
    with pytest.raises(SnapshotStoreError):
        tasks.restore_sandbox(sandbox_id="i2", snapshot_id="snone", env_vars={}, access_token=None)
    assert not hasattr(stub, "restored")


def test_fork_inits_each_child_and_reports_failures_alone(stub):
    stub.fail_children = {1}  # (one stub envd serves every VM here, so no tokens: they would race)
    children = [{"sandbox_id": f"c{i}", "env_vars": {"C": str(i)}, "access_token": None} for i in range(3)]
    out = tasks.fork_sandbox(sandbox_id="p", env_vars={"E": "1"}, access_token=None, children=children)
    assert out["parent"] == {"ok": True}
    inits = sorted(json.dumps(b["envVars"]) for _h, b, _ok in TokenEnvd.calls)
    assert inits == ['{"C": "0"}', '{"C": "2"}', '{"E": "1"}']  # the parent is re-inited too
    assert stub.killed == []
    assert [c["ok"] for c in out["children"]] == [True, False, True]
    assert out["children"][1]["kind"] == "VMError" and "no port" in out["children"][1]["message"]
    json.dumps(out)


def test_fork_child_token_handoff_failure_kills_only_that_child(stub):
    TokenEnvd.token = "parent-token"
    # a secure parent's child without a token of its own must not inherit the parent's
    children = [{"sandbox_id": "c0", "env_vars": {}, "access_token": None}]
    out = tasks.fork_sandbox(sandbox_id="p", env_vars={}, access_token="parent-token", children=children)
    assert out["children"][0]["ok"] is False and out["children"][0]["kind"] == "EnvdInitFailed"
    assert stub.killed == ["c0"]


def test_delete_snapshot_files(stub, tmp_path):
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s5")
    assert tasks.delete_snapshot_files(snapshot_id="s5") == {"deleted": True}
    assert tasks.delete_snapshot_files(snapshot_id="s5") == {"deleted": False}
    assert not (tmp_path / "snapshots" / "s5").exists()


def test_filesystem_only_snapshot_syncs_keeps_disk_only_and_cold_boots(stub, tmp_path):
    out = tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s6", memory=False)
    assert stub.snapshot_memory is False  # the driver syncs the guest and captures disk layers only
    d = tmp_path / "snapshots" / "s6"
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json"]
    assert out["memory"] is False and out["manifest"]["memory_file"] == ""
    TokenEnvd.token = None
    tasks.restore_sandbox(sandbox_id="i9", snapshot_id="s6", env_vars={}, access_token="own",
                          source_token="source-token")
    assert stub.booted.sandbox_id == "i9" and stub.booted.layers == ["/base"]
    assert not hasattr(stub, "restored")
    assert TokenEnvd.token == "own" and TokenEnvd.calls[-1][0] == "own"  # no handoff to a fresh envd


def test_a_capture_without_commit_is_stored_by_commit_snapshot(stub, tmp_path, monkeypatch):
    """A fork across nodes: the capture first (the parent's node restores from its copy), the
    upload as a task of its own."""
    store = PosixFsStore(tmp_path / "snapshots")
    committed = []
    monkeypatch.setattr(store, "commit", committed.append)
    monkeypatch.setattr(tasks, "_store", lambda: store)
    out = tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s7", commit=False)
    assert committed == [] and out["manifest"]["source_sandbox_id"] == "i1"
    assert (tmp_path / "snapshots" / "s7" / "manifest.json").is_file()
    assert "commit_ms" in tasks.commit_snapshot(snapshot_id="s7")["timings"] and committed == ["s7"]
    tasks.snapshot_sandbox(sandbox_id="i1", snapshot_id="s8")
    assert committed == ["s7", "s8"]


def test_a_node_tasks_result_is_shown_short_in_celerys_log_and_events():
    """Celery reprs every task's result (its success line, its events) whatever the log level:
    a boot's timings at the default 1,024 characters cost the node ~5 % of its CPU per call."""
    from celery.utils.saferepr import saferepr  # noqa: PLC0415

    result = {"timings": {f"step_{i}_ms": i * 1.5 for i in range(60)}, "guest_host": "10.12.0.3"}
    for task in (tasks.boot_sandbox, tasks.restore_sandbox, tasks.snapshot_sandbox, tasks.pause_sandbox):
        assert len(saferepr(result, task.resultrepr_maxsize)) <= 100, task.name
