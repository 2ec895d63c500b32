"""The S3 snapshot store end to end, with real VMs, a real S3 API (a ``moto_server``
subprocess) and the official SDK: a snapshot is uploaded; with the node's own copy
gone (as on another node, or after cache eviction) a create from it downloads it
and the restored sandbox has the file and the still-running process; deleting the
snapshot removes every object it stored."""
import shutil
import time
import uuid

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from cluster.processes import qemu_pids
from harness.moto_s3 import CREDENTIALS, moto_server
from harness.moto_s3 import client as s3_client

from .conftest import running_stack
from harness.guest_counter import read_counter, start_counter

pytestmark = pytest.mark.vm

BUCKET = "aenv-e2e"


@pytest.fixture(scope="module")
def moto_s3():
    with moto_server(BUCKET) as url:
        yield url, s3_client(url)


@pytest.fixture(scope="module")
def s3_stack(moto_s3):
    url, _ = moto_s3
    env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
           "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": f"e2e-{uuid.uuid4().hex[:6]}", **CREDENTIALS,
           "AENV_LAZY_RESTORE": "0"}  # the whole download (lazy restores: tests/vmm/test_lazy_restore_vm.py)
    with running_stack("s3", extra_env=env) as s:
        yield s


@pytest.fixture
def s3_sdk(s3_stack, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", s3_stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", s3_stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", s3_stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return s3_stack


def _objects(client, prefix: str) -> list[str]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
    return out


def test_restore_downloads_from_s3_then_delete_removes_objects(s3_sdk, moto_s3):
    stack = s3_sdk
    _, client = moto_s3
    prefix = stack.extra_env["AENV_S3_PREFIX"]
    src = Sandbox.create(timeout=600)
    restored = None
    snap_id = None
    try:
        src.files.write("/home/user/state.txt", "from s3")
        pid, _ = start_counter(src)
        snap_id = src.create_snapshot().snapshot_id
        keys = _objects(client, prefix)
        assert f"snapshots/{snap_id}/manifest.json" in keys
        assert any(k.startswith("chunks/") for k in keys) and any(k.startswith("refs/") for k in keys)
        src.kill()  # one VM at a time; the snapshot does not depend on its source

        # as on a node that never had the files (or evicted them): only S3 has them now
        local = stack.home / "snapshots" / snap_id
        assert (local / "manifest.json").is_file()
        shutil.rmtree(local)
        restored = Sandbox.create(snap_id, timeout=300)
        cached = stack.home / "cache" / "snapshots" / snap_id
        assert (cached / "manifest.json").is_file(), "the restore did not come from the download cache"
        assert not local.exists()
        assert restored.files.read("/home/user/state.txt") == "from s3"
        p1, n1 = read_counter(restored)
        assert p1 == pid, "the background process was restarted, not restored"
        time.sleep(0.8)
        p2, n2 = read_counter(restored)
        assert p2 == pid and n2 > n1, "the restored counter does not run"

        with pytest.raises(SandboxException) as err:
            Sandbox.delete_snapshot(snap_id)
        assert "409" in str(err.value)
        restored.kill()
        assert Sandbox.delete_snapshot(snap_id) is True
        snap_id = None
        assert _objects(client, prefix) == [], "the snapshot's objects were not all removed"
        assert not cached.exists()
    finally:
        if restored is not None:
            restored.kill()
        src.kill()
        if snap_id:
            Sandbox.delete_snapshot(snap_id)
    left = stack.vm_leftovers()
    for sbx in (src, restored):
        if sbx is not None:
            assert sbx.sandbox_id not in left["state_dirs"] and qemu_pids(sbx.sandbox_id) == []
