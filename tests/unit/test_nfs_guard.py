"""``vmm.net.nfs_guard`` on crafted RPC records: a call's handles must carry a good tag of one
of the sandbox's volumes (else BADHANDLE with the procedure's exact failure shape, never
forwarded), a reply's handles get tagged with the key of the volume the call named, and
anything but NFSv3/MOUNTv3 is refused. The real server: test_volume_server_confinement.py."""
import struct

import pytest

from tests.nfs3_client import Packer, Unpacker
from vmm.net import nfs_guard as g

KEY_A, KEY_B = g.volume_key(b"k" * 32, "team/a"), g.volume_key(b"k" * 32, "team/b")
RAW = bytes(range(24))  # a server handle


def call(xid, proc, args=b"", prog=g.NFS_PROGRAM, vers=3):
    cred = Packer().uint(0).opaque(b"guest").uint(1000).uint(1000).uint(0).bytes()
    return Packer().uint(xid).uint(0).uint(2).uint(prog).uint(vers).uint(proc).uint(1).opaque(cred).uint(0) \
        .opaque(b"").bytes() + args


def reply(xid, results):
    return Packer().uint(xid).uint(1).uint(0).uint(0).opaque(b"").uint(0).bytes() + results


def results_of(record):
    u = Unpacker(record)
    assert u.uint() and u.uint() == 1 and u.uint() == 0
    u.uint()
    u.opaque()
    return u.uint(), record[u.at:]


def nfs_guard(*keys):
    return g.Guard(g.NFS_PROGRAM, {f"/{i}": k for i, k in enumerate(keys, 1)})


def test_tags_are_per_volume_and_cannot_be_forged():
    tagged = g.sign(KEY_A, RAW)
    assert len(tagged) == len(RAW) + g.TAG_LEN
    assert g.unsign([KEY_B, KEY_A], tagged) == (KEY_A, RAW)
    assert g.unsign([KEY_B], tagged) is None
    assert g.unsign([KEY_A], RAW) is None and g.unsign([KEY_A], tagged[:g.TAG_LEN]) is None
    assert g.unsign([KEY_A], RAW[:-1] + b"\xff" + tagged[len(RAW):]) is None
    with pytest.raises(g.Garbage):
        g.sign(KEY_A, bytes(g.FH_MAX - g.TAG_LEN + 1))  # no room for a tag within NFS3_FHSIZE


def test_a_good_handle_reaches_the_server_unwrapped():
    guard = nfs_guard(KEY_A)
    args = Packer().opaque(g.sign(KEY_A, RAW)).hyper(0).uint(4096).bytes()
    to_server, to_guest = guard.call(call(7, 6, args))  # READ
    assert to_guest is None and to_server == call(7, 6, Packer().opaque(RAW).hyper(0).uint(4096).bytes())


@pytest.mark.parametrize("proc, bools", [(1, 0), (2, 2), (3, 1), (6, 1), (7, 2), (12, 2), (17, 1), (21, 2)])
def test_a_bad_handle_is_refused_with_the_procedures_failure_shape(proc, bools):
    guard = nfs_guard(KEY_A)
    for handle in (RAW, g.sign(KEY_B, RAW), b"", bytes(40)):
        to_server, to_guest = guard.call(call(9, proc, Packer().opaque(handle).bytes() + bytes(16)))
        assert to_server is None
        accept, body = results_of(to_guest)
        assert accept == 0 and body == struct.pack(">I", g.NFS3ERR_BADHANDLE) + bytes(4 * bools)
    assert guard.pending == {}


def test_rename_and_link_need_both_handles_of_one_volume():
    guard = nfs_guard(KEY_A, KEY_B)
    same = Packer().opaque(g.sign(KEY_A, RAW)).opaque(b"x").opaque(g.sign(KEY_A, RAW[::-1])).opaque(b"y").bytes()
    to_server, _ = guard.call(call(1, 14, same))
    assert to_server.endswith(Packer().opaque(RAW).opaque(b"x").opaque(RAW[::-1]).opaque(b"y").bytes())
    mixed = Packer().opaque(g.sign(KEY_A, RAW)).opaque(b"x").opaque(g.sign(KEY_B, RAW)).opaque(b"y").bytes()
    assert guard.call(call(2, 14, mixed))[0] is None
    untagged_second = Packer().opaque(g.sign(KEY_A, RAW)).opaque(RAW).opaque(b"l").bytes()
    to_server, to_guest = guard.call(call(3, 15, untagged_second))  # LINK
    assert to_server is None and results_of(to_guest)[1] == struct.pack(">I", g.NFS3ERR_BADHANDLE) + bytes(12)


def test_only_nfs_v3_and_mount_v3_pass():
    guard = nfs_guard(KEY_A)
    assert results_of(guard.call(call(1, 0, prog=100227))[1])[0] == g.PROG_UNAVAIL  # NFSACL
    assert results_of(guard.call(call(1, 0, prog=g.MOUNT_PROGRAM))[1])[0] == g.PROG_UNAVAIL
    to_guest = guard.call(call(1, 1, vers=4))[1]
    assert results_of(to_guest) == (g.PROG_MISMATCH, struct.pack(">II", 3, 3))
    assert results_of(guard.call(call(1, 22))[1])[0] == g.PROC_UNAVAIL
    assert guard.call(call(1, 0)) == (call(1, 0), None)  # NULL
    assert guard.reply(reply(1, b"")) == reply(1, b"")  # and its answer
    with pytest.raises(g.Garbage):
        guard.call(struct.pack(">III", 1, 1, 2))  # not a call
    with pytest.raises(g.Garbage):
        guard.call(call(1, 1)[:30])


def test_mount_gives_only_the_sandboxs_paths_and_tags_the_root():
    guard = g.Guard(g.MOUNT_PROGRAM, {"/3": KEY_A})
    for path in ("/", "/4", "/srv/volumes", "/3/.."):
        to_server, to_guest = guard.call(call(1, 1, Packer().opaque(path.encode()).bytes(), prog=g.MOUNT_PROGRAM))
        assert to_server is None and results_of(to_guest)[1] == struct.pack(">I", g.MNT3ERR_NOENT)
    assert results_of(guard.call(call(1, 2, prog=g.MOUNT_PROGRAM))[1])[0] == g.PROC_UNAVAIL  # DUMP
    umnt = call(2, 3, Packer().opaque(b"/3").bytes(), prog=g.MOUNT_PROGRAM)
    assert guard.call(umnt) == (umnt, None) and guard.reply(reply(2, b"")) == reply(2, b"")
    record = call(5, 1, Packer().opaque(b"/3").bytes(), prog=g.MOUNT_PROGRAM)
    assert guard.call(record) == (record, None)
    out = guard.reply(reply(5, Packer().uint(0).opaque(RAW).uint(1).uint(1).bytes()))
    assert results_of(out)[1] == Packer().uint(0).opaque(g.sign(KEY_A, RAW)).uint(1).uint(1).bytes()


def test_reply_handles_are_tagged_with_the_key_of_the_volume_called():
    guard = nfs_guard(KEY_A, KEY_B)
    guard.call(call(11, 3, Packer().opaque(g.sign(KEY_B, RAW)).opaque(b"f").bytes()))  # LOOKUP in b
    found = bytes(range(100, 124))
    out = guard.reply(reply(11, Packer().uint(0).opaque(found).uint(0).uint(0).bytes()))
    assert results_of(out)[1] == Packer().uint(0).opaque(g.sign(KEY_B, found)).uint(0).uint(0).bytes()
    assert guard.reply(reply(11, b"")) is None  # no call in flight under that xid: dropped

    guard.call(call(12, 17, Packer().opaque(g.sign(KEY_A, RAW)).hyper(0).hyper(0).uint(1).uint(1).bytes()))
    attrs = Packer().uint(1).bytes() + bytes(84)

    def listing(h1, h2):
        p = Packer().uint(0).bytes() + attrs + bytes(8)
        for n, (name, fh) in enumerate((("a", h1), ("b", h2))):
            p += Packer().uint(1).hyper(n).opaque(name.encode()).hyper(n + 1).bytes() + attrs
            p += Packer().uint(1).opaque(fh).bytes() if fh else Packer().uint(0).bytes()
        return p + Packer().uint(0).uint(1).bytes()

    out = guard.reply(reply(12, listing(found, None)))
    assert results_of(out)[1] == listing(g.sign(KEY_A, found), None)


def test_readdirplus_asks_ganesha_for_a_reply_that_fits_once_tagged():
    """Tags make every entry 16 bytes longer: the guard asks for 3/4 of the guest's maxcount
    (the smallest entry with a handle, 48 bytes, becomes 64), so the guest's buffer still fits."""
    guard = nfs_guard(KEY_A)
    to_server, _ = guard.call(call(1, 17, Packer().opaque(g.sign(KEY_A, RAW)).hyper(5).hyper(6).uint(4096)
                                   .uint(32768).bytes()))
    assert to_server.endswith(Packer().opaque(RAW).hyper(5).hyper(6).uint(4096).uint(24576).bytes())
    smallest = 4 + 8 + 8 + 8 + 4 + 4 + 4 + 8  # a 1-byte name, no attributes, an 8-byte handle
    entries = 32768 * 3 // 4 // smallest
    assert entries * (smallest + g.TAG_LEN) <= 32768


def test_an_xid_in_flight_is_not_reused_for_another_call():
    guard = nfs_guard(KEY_A, KEY_B)
    lookup_a = call(4, 3, Packer().opaque(g.sign(KEY_A, RAW)).opaque(b"f").bytes())
    guard.call(lookup_a)
    assert guard.call(lookup_a)[0] is not None  # a retransmission
    with pytest.raises(g.Garbage, match="reused"):
        guard.call(call(4, 3, Packer().opaque(g.sign(KEY_B, RAW)).opaque(b"f").bytes()))
