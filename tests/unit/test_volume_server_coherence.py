"""Two sandboxes' volume servers over one volume (each sandbox has its own ganesha, on one node
or on two) answer from the files as they are now: ganesha's attribute cache kept a size for
60 s by default, so a guest opening a file another sandbox had appended to got the old size
and the old bytes, which breaks NFS's close-to-open promise (docs/volumes.md#consistency).
Real servers in two real slots with stand-in guests (test_volume_server_confinement.py's)."""
from __future__ import annotations

import os
import subprocess

from tests.nfs3_client import OK, Nfs3Client
from tests.unit.test_volume_server_confinement import POOL, SECRET, in_netns, stand_in_guest
from vmm.net import nfs_guard, slots
from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP


def test_one_servers_changes_are_seen_through_another_at_once(tmp_path, slot_prefix):
    volume = tmp_path / "volume"
    volume.mkdir()
    os.chown(volume, 1000, 1000)
    exports = [vs.Export(3, str(volume), "/3", nfs_guard.volume_key(SECRET, "team/volume"))]
    guests, run_dirs = [], []
    try:
        for index in (1, 2):
            slot = slots.create(slots.Slot(slot_prefix, index, POOL))
            guests.append(stand_in_guest(slot))
            run_dirs.append(tmp_path / f"server-{index}")
            vs.start(slot, exports, run_dirs[-1])
            vs.open_ports(slot)

        def on(guest: str, fn):
            def call():
                with Nfs3Client(GATEWAY_IP) as nfs:
                    status, root = nfs.mnt("/3")
                    assert status == OK
                    return fn(nfs, root)
            return in_netns(guest, call)

        first, second = guests
        fh = on(first, lambda nfs, root: nfs.create(root, "f")[1])
        assert on(first, lambda nfs, root: nfs.write(fh, b"12345")) == OK
        size = lambda nfs, root: nfs.getattr(fh)[1]["size"]  # noqa: E731
        listing = lambda nfs, root: sorted(nfs.readdirplus(root)[1])  # noqa: E731
        seen = [on(second, size), on(second, listing)]
        assert on(first, lambda nfs, root: nfs.write(fh, b"67890", 5)) == OK  # an append
        seen.append(on(second, size))
        assert on(first, lambda nfs, root: (nfs.create(root, "g")[0], nfs.remove(root, "f"))) == (OK, OK)
        seen.append(on(second, listing))
        assert seen == [5, [".", "..", "f"], 10, [".", "..", "g"]]
    finally:
        for run_dir in run_dirs:
            vs.stop(run_dir)
        for guest in guests:
            subprocess.run(["ip", "netns", "del", guest], check=False)
