"""Volumes end to end with real VMs and the unchanged E2B SDK: the content API writes a file
without a sandbox, two sandboxes mount the volume (NFSv3 from their own slots) and see each
other's writes, the volume survives a pause to disk and a resume, a fork child sees it too,
a delete while it is mounted is refused, and nothing of the volume servers is left after.
A guest that speaks NFS itself with forged handles gets nothing but its volume, and cannot
reach ganesha behind the guard."""
import json
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import VolumeException, VolumePathNotFoundException

from harness.polling import until

pytestmark = pytest.mark.vm


def run(sbx, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout.strip()


def servers_of(stack, sandbox_id: str) -> list[str]:
    """Processes of the sandbox's volume server still alive (ganesha.nfsd, rpcbind)."""
    out = subprocess.run(["pgrep", "-f", f"volume-servers/{sandbox_id}/"], capture_output=True, text=True).stdout
    return out.split()


# A long-running writer in the guest (its user): one file opened for append before a pause and
# kept open through it, a numbered line at a time, each fsync'd (so the node has it at once);
# an error goes to a file of its own.
APPENDER = """
import os, sys, time
f = open(sys.argv[1], "a")
n = 0
while True:
    n += 1
    try:
        f.write(f"line {n}\\n")
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        open("/tmp/appender.err", "a").write(f"{n}: {e!r}\\n")
    time.sleep(0.1)
"""


# Fills a file on a volume a MiB at a time, each fsync'd, until the volume refuses: how many
# MiB went in, and the error's name.
FILL = """
import errno, os, sys
n = 0
try:
    with open(sys.argv[1], "wb") as f:
        while n < 64:
            f.write(b"x" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
            n += 1
    print(n, "none")
except OSError as e:
    print(n, errno.errorcode.get(e.errno, e.errno))
"""


def small_volume(stack, name: str, size_mb: int) -> tuple[str, str]:
    """(id, token) of a volume made as the API makes one with AENV_VOLUME_MAX_MB=size_mb."""
    out = stack.db("from asgiref.sync import async_to_sync; from django.conf import settings; "
                   "from sandboxes.models import ApiKey, hash_api_key; "
                   "from lifecycle.volumes.records import create_volume; "
                   f"settings.AENV_VOLUME_MAX_MB = {size_mb}; "
                   f"team = ApiKey.objects.get(key_hash=hash_api_key({stack.api_key!r})).team; "
                   f"v = async_to_sync(create_volume)(team, {name!r}); print(v.id, v.token)")
    volume_id, token = out.split()
    return volume_id, token


def put(stack, volume_id: str, token: str, path: str, body: bytes) -> httpx.Response:
    return httpx.put(f"{stack.api_url}/volumecontent/{volume_id}/file", params={"path": path}, content=body,
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
                     timeout=120)


def appended(vol) -> list[str]:
    try:
        return vol.read_file("/appended.log").splitlines()
    except VolumePathNotFoundException:  # the appender has not opened it yet
        return []


# Runs in the guest as its unprivileged user, with tests/nfs3_client.py next to it.
ATTACK = """
import json, socket, struct, sys
sys.path.insert(0, "/tmp")
from nfs3_client import Nfs3Client
pseudo = sys.argv[1]
out = {}
with Nfs3Client("169.254.0.22") as nfs:
    out["mnt"], root = nfs.mnt(pseudo)
    out["own"] = nfs.read(nfs.lookup(root, "seed.txt")[1])[1].decode()
    inner, tag = root[:-16], root[-16:]
    for name, ino in (("fs_root", 2), ("etc", int(sys.argv[2])), ("other_volume", int(sys.argv[3]))):
        forged = inner[:15] + struct.pack("<II", ino, 0) + inner[23:]
        out[name] = [nfs.getattr(forged)[0], nfs.getattr(forged + tag)[0], nfs.read(forged + tag)[0]]
    out["mnt_slash"] = nfs.mnt("/")[0]
for port in (12049, 12048, 111):
    try:
        socket.create_connection(("169.254.0.22", port), timeout=3).close()
        out[str(port)] = "open"
    except OSError:
        out[str(port)] = "closed"
print(json.dumps(out))
"""


def test_two_sandboxes_share_a_volume_across_pause_and_fork(stack, sdk_env, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", stack.api_url)
    vol = Volume.create(f"shared-{uuid.uuid4().hex[:8]}")
    vol.write_file("/seed.txt", "from the content API")
    small_name = f"small-{uuid.uuid4().hex[:8]}"
    small_id, small_token = small_volume(stack, small_name, 8)
    a = Sandbox.create(volume_mounts={"/home/user/data": vol}, timeout=600)
    b = Sandbox.create(volume_mounts={"/mnt/shared": vol.name, "/mnt/small": small_name}, timeout=600)
    child = None
    try:
        assert a.get_info().volume_mounts == [{"name": vol.name, "path": "/home/user/data"}]
        assert run(a, "cat /home/user/data/seed.txt") == "from the content API"
        run(a, "echo from-a > /home/user/data/a.txt")
        assert run(b, "cat /mnt/shared/a.txt") == "from-a"
        run(b, "echo from-b > /mnt/shared/b.txt")
        assert vol.read_file("/b.txt").strip() == "from-b"  # the content API sees the guests' files
        vol.write_file("/notes.txt", "written by the content API\n")
        run(b, "echo appended by b >> /mnt/shared/notes.txt")  # a file its server did not create
        assert vol.read_file("/notes.txt") == "written by the content API\nappended by b\n"

        # an 8 MiB volume: the guest's writes stop with ENOSPC at its limit (no hang: the run's
        # timeout), the content API refuses an upload into the full volume with a 413, and the
        # guest's delete gives the room back
        b.files.write("/tmp/fill.py", FILL)
        filled, error = run(b, "python3 /tmp/fill.py /mnt/small/fill").split()
        assert error in ("ENOSPC", "EDQUOT") and 4 <= int(filled) < 8, (filled, error)
        [small_root] = stack.home.glob(f"volumes/*/{small_id}")
        small_image = small_root.with_name(small_id + ".img")
        assert small_image.stat().st_size == 8 << 20 and small_image.stat().st_blocks * 512 <= 8 << 20
        refused = put(stack, small_id, small_token, "/up.bin", b"u" * (1 << 20))
        assert refused.status_code == 413 and "its limit is 8 MiB" in refused.json()["message"], refused.text
        run(b, "rm /mnt/small/fill")
        until(lambda: put(stack, small_id, small_token, "/up.bin", b"u" * (1 << 20)).status_code == 201,
              "room after the guest's delete", 90, tolerate=())  # ext4 frees the blocks at its next commit
        assert run(b, "stat -c %s /mnt/small/up.bin") == str(1 << 20)
        assert run(a, "stat -c %u /home/user/data/b.txt") == "1000"

        with pytest.raises(VolumeException, match="mounted by"):
            Volume.destroy(vol.volume_id)

        other = Volume.create(f"other-{uuid.uuid4().hex[:8]}")
        try:
            other.write_file("/secret.txt", "not for a")
            other_ino = next(stack.home.glob(f"volumes/*/{other.volume_id}/secret.txt")).stat().st_ino
            a.files.write("/tmp/nfs3_client.py", (Path(__file__).parents[1] / "nfs3_client.py").read_text())
            a.files.write("/tmp/attack.py", ATTACK)
            source = run(a, "awk '$2 == \"/home/user/data\" {print $1}' /proc/mounts")
            pseudo = source.split(":", 1)[1]
            got = json.loads(run(a, f"python3 /tmp/attack.py {pseudo} {Path('/etc').stat().st_ino} {other_ino}"))
        finally:
            Volume.destroy(other.volume_id)
        assert got.pop("mnt") == 0 and got.pop("own") == "from the content API"
        assert got.pop("mnt_slash") == 2  # MNT3ERR_NOENT
        # the volume has a size limit, so it is a filesystem of its own: "inode 2, generation 0"
        # is its own root (the handle ganesha issued, its tag good: getattr OK, read EISDIR);
        # untagged it is refused as ever, and nothing of the node or of another volume is reached
        [root_dir] = stack.home.glob(f"volumes/*/{vol.volume_id}")
        assert root_dir.stat().st_ino == 2
        assert got == {"fs_root": [10001, 0, 21], "etc": [10001] * 3, "other_volume": [10001] * 3,
                       "12049": "closed", "12048": "closed", "111": "closed"}, got

        a.files.write("/tmp/appender.py", APPENDER)
        a.commands.run("python3 /tmp/appender.py /home/user/data/appended.log", background=True)
        until(lambda: len(appended(vol)) >= 3, "the appender's first lines", 90, tolerate=())
        assert a.pause() is True
        assert servers_of(stack, a.sandbox_id) == []  # the slot went with the pause, and its server
        at_pause = len(appended(vol))
        vol.write_file("/while-paused.txt", "written while a was paused")
        a = Sandbox.connect(a.sandbox_id, timeout=600)
        assert run(a, "cat /home/user/data/while-paused.txt") == "written while a was paused"
        # the file opened before the pause keeps growing on the node, every line once, in order
        # (the bug: each write after the resume was refused and the guest kept rewriting one offset)
        lines = until(lambda: (got := appended(vol)) and len(got) >= at_pause + 5 and got, "appends after the resume",
                      90, tolerate=())
        assert lines == [f"line {i}" for i in range(1, len(lines) + 1)], lines
        assert int(run(a, "wc -l < /home/user/data/appended.log")) >= len(lines)  # and the guest sees them
        run(a, "pkill -f '/tmp/appende[r].py' || true")  # (the pattern does not match this shell)
        assert run(a, "cat /tmp/appender.err 2>/dev/null || true") == ""
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
    assert Volume.destroy(small_id) is True
    assert not small_root.exists() and not small_image.exists() and not os.path.ismount(small_root)
