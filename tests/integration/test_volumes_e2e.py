"""Volumes end to end with real VMs and the unchanged E2B SDK: the content API writes a file
without a sandbox, two sandboxes mount the volume (NFSv3 from their own slots) and see each
other's writes, the volume survives a pause to disk and a resume, a fork child sees it too,
a delete while it is mounted is refused, and nothing of the volume servers is left after."""
import subprocess
import uuid

import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import VolumeException

pytestmark = pytest.mark.vm


def run(sbx, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout.strip()


def servers_of(stack, sandbox_id: str) -> list[str]:
    """Processes of the sandbox's volume server still alive (ganesha.nfsd, rpcbind)."""
    out = subprocess.run(["pgrep", "-f", f"volume-servers/{sandbox_id}/"], capture_output=True, text=True).stdout
    return out.split()


def test_two_sandboxes_share_a_volume_across_pause_and_fork(stack, sdk_env, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", stack.api_url)
    vol = Volume.create(f"shared-{uuid.uuid4().hex[:8]}")
    vol.write_file("/seed.txt", "from the content API")
    a = Sandbox.create(volume_mounts={"/home/user/data": vol}, timeout=600)
    b = Sandbox.create(volume_mounts={"/mnt/shared": vol.name}, timeout=600)
    child = None
    try:
        assert a.get_info().volume_mounts == [{"name": vol.name, "path": "/home/user/data"}]
        assert run(a, "cat /home/user/data/seed.txt") == "from the content API"
        run(a, "echo from-a > /home/user/data/a.txt")
        assert run(b, "cat /mnt/shared/a.txt") == "from-a"
        run(b, "echo from-b > /mnt/shared/b.txt")
        assert vol.read_file("/b.txt").strip() == "from-b"  # the content API sees the guests' files
        assert run(a, "stat -c %u /home/user/data/b.txt") == "1000"

        with pytest.raises(VolumeException, match="mounted by"):
            Volume.destroy(vol.volume_id)

        assert a.pause() is True
        assert servers_of(stack, a.sandbox_id) == []  # the slot went with the pause, and its server
        vol.write_file("/while-paused.txt", "written while a was paused")
        a = Sandbox.connect(a.sandbox_id, timeout=600)
        assert run(a, "cat /home/user/data/while-paused.txt") == "written while a was paused"
        run(a, "echo after-resume > /home/user/data/resumed.txt")
        assert run(b, "cat /mnt/shared/resumed.txt") == "after-resume"

        [child] = a.fork(count=1)
        assert run(child, "cat /home/user/data/a.txt") == "from-a"
        run(child, "echo from-child > /home/user/data/child.txt")
        assert run(b, "cat /mnt/shared/child.txt") == "from-child"
        assert run(a, "cat /home/user/data/child.txt") == "from-child"
        assert child.get_info().volume_mounts == [{"name": vol.name, "path": "/home/user/data"}]
    finally:
        for sbx in (child, a, b):
            if sbx is not None:
                sbx.kill()
    for sbx in (child, a, b):
        assert servers_of(stack, sbx.sandbox_id) == []
    assert Volume.destroy(vol.volume_id) is True
