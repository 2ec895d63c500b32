"""A guest writes files its volume server did not create (issue 25: "a file opened for append
stopped growing after a pause and resume"): ganesha's VFS backend opens an existing file, sets
its attributes and links it as root once its own permission check passed, so with only
CAP_DAC_READ_SEARCH it answered every WRITE to a file made by an earlier server (every file
after a resume) or by the content API with NFS3ERR_ACCES, which the guest's client reports
only at fsync or close. Real server in a real slot (the confinement test's stand-in guest);
ganesha's own checks still refuse another uid and a read-only directory."""
from __future__ import annotations

import os

from tests.nfs3_client import Nfs3Client, OK
from tests.unit.test_volume_server_confinement import in_netns, node, serve  # noqa: F401 - a fixture
from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP

ACCES = 13


def test_files_the_server_did_not_make_are_writable_by_their_owner_only(node):
    (node.mine / "locked").mkdir(mode=0o555)
    os.chown(node.mine / "locked", 1000, 1000)
    serve(node)

    def first_server():
        with Nfs3Client(GATEWAY_IP) as nfs:
            _, root = nfs.mnt("/3")
            _, made = nfs.create(root, "made-here.txt")
            return nfs.write(made, b"1"), made

    status, made = in_netns(node.guest, first_server)
    assert status == OK
    vs.stop(node.run_dir)  # what a pause does; the resume starts a new server
    serve(node)

    def as_uid(uid: int):
        with Nfs3Client(GATEWAY_IP, uid=uid) as nfs:
            _, root = nfs.mnt("/3")
            _, hello = nfs.lookup(root, "hello.txt")  # written on the node, like the content API's
            _, locked = nfs.lookup(root, "locked")
            return {"earlier server's file": nfs.write(made, b"2", 1), "node's file": nfs.write(hello, b"H"),
                    "in a 0555 directory": nfs.create(locked, "x")[0]}

    assert in_netns(node.guest, lambda: as_uid(1000)) == {
        "earlier server's file": OK, "node's file": OK, "in a 0555 directory": ACCES}
    assert in_netns(node.guest, lambda: as_uid(2000)) == {
        "earlier server's file": ACCES, "node's file": ACCES, "in a 0555 directory": ACCES}
    assert (node.mine / "made-here.txt").read_bytes() == b"12"
    assert (node.mine / "hello.txt").read_bytes() == b"Hello from my volume\n"
