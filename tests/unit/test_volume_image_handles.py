"""A volume with a size limit is a filesystem of its own (volumes.image); a paused guest's NFS
handles name it, so they must stay good when it is mounted again on another loop device (a
node's reboot, a resume on another node of the machine): ganesha's filesystem id comes from
the ext4's UUID, not from the device. Real image, real server, a stand-in guest
(test_volume_server_confinement.py's)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.nfs3_client import OK, Nfs3Client
from tests.unit.test_volume_server_confinement import POOL, SECRET, in_netns, stand_in_guest
from vmm.net import nfs_guard, slots
from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP
from volumes import image


def _loop_of(root) -> str:
    """The device mounted at ``root`` (mountinfo: the source after the `` - `` separator)."""
    with open("/proc/self/mountinfo") as f:
        return next(line.split(" - ")[1].split()[1] for line in f if line.split()[4] == str(root))


def _hold(device: str, was, backing) -> str | None:
    """Attaches ``backing`` to ``device`` once the unmount of ``was`` has let go of it (a loop
    device's autoclear is asynchronous: ``losetup --find`` right after the umount may still
    pass it over, and the mount again then gets it back), so the mount again gets another
    one; None when another process took it first (it is held all the same).

    A process in a mount namespace of its own made while the volume was mounted holds a copy
    of that mount (this machine's root mount is private: the umount does not reach it), and
    the device with it, until it exits: a parallel test's ``ip netns exec`` listener does. So
    the wait is long, and a failure names who holds it."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if subprocess.run(["losetup", device, str(backing)], capture_output=True).returncode == 0:
            return device
        held_by = subprocess.run(["losetup", "--noheadings", "--output", "BACK-FILE", device],
                                 capture_output=True, text=True).stdout.strip()
        if held_by and held_by != str(was):
            return None
        time.sleep(0.05)
    raise AssertionError(f"{device} still backs {was} 90 s after its umount; held by {_holders(device)}")


def _holders(device: str) -> list[str]:
    """The processes whose mount namespace still mounts ``device`` (pid and command)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f" {device} " in Path(f"/proc/{pid}/mountinfo").read_text():
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(bytes(1), b" ")
                found.append(f"{pid} {command.decode(errors='replace')[:80]}")
        except OSError:
            continue
    return found


def test_handles_outlive_a_remount_on_another_loop_device(tmp_path, slot_prefix):
    root, other = tmp_path / "team" / "vol", tmp_path / "team" / "other"
    image.create(root, 8, 1000, 1000)
    image.create(other, 8, 1000, 1000)
    (other / "secret").write_text("other volume\n")
    key = nfs_guard.volume_key(SECRET, "team/vol")
    exports = [vs.Export(3, str(root), "/3", key)]
    slot = slots.create(slots.Slot(slot_prefix, 1, POOL))
    guest = stand_in_guest(slot)
    run_dir = tmp_path / "server"
    spare = None
    try:
        vs.start(slot, exports, run_dir)
        vs.open_ports(slot)

        def first():
            with Nfs3Client(GATEWAY_IP) as nfs:
                _, mounted = nfs.mnt("/3")
                _, fh = nfs.create(mounted, "kept.txt")
                return mounted, fh, nfs.write(fh, b"before")

        mounted, fh, status = in_netns(guest, first)
        assert status == OK
        vs.stop(run_dir)
        before = _loop_of(root)
        subprocess.run(["umount", str(root)], check=True)
        spare = _hold(before, image.image_of(root), image.image_of(other))
        assert image.ensure_mounted(root) and _loop_of(root) != before
        vs.start(slot, exports, run_dir)
        vs.open_ports(slot)

        def again():
            with Nfs3Client(GATEWAY_IP) as nfs:
                nfs.mnt("/3")
                return nfs.write(fh, b"+after", 6), nfs.read(fh)[1]

        assert in_netns(guest, again) == (OK, b"before+after")
    finally:
        vs.stop(run_dir)
        subprocess.run(["ip", "netns", "del", guest], check=False)
        if spare:
            subprocess.run(["losetup", "-d", spare], check=False)
        image.remove(root)
        image.remove(other)
    assert not os.path.exists(root)
