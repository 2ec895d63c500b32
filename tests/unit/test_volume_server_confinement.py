"""A hostile guest against a real volume server (nfs-ganesha behind ``nfs_guard``, started by
``vmm.net.volume_server.start`` in a network namespace of the test's own, standing in for a
slot): it speaks NFSv3 from the guest's side (the gateway address) with handles it forges.

What must hold: ganesha itself resolves a forged handle to any inode of the export's
filesystem (the first test shows it, talking to ganesha on the slot's loopback where no guest
can reach); through the guard every forged, altered, untagged or other-volume handle is
``NFS3ERR_BADHANDLE``, while the volume's own files work and its handles survive a restart.
And the server holds little: ganesha keeps three capabilities with ``no_new_privs`` in a root
that shows only ``/usr``, a few ``/etc`` files and the exports; the guard runs as nobody."""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import struct
import subprocess
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.polling import until
from tests.nfs3_client import BADHANDLE, MOUNT_PROGRAM, NFS_PROGRAM, NOENT, OK, Nfs3Client, Packer
from vmm.net import nfs_guard, slots
from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or vs.available() is not None,
                                reason=f"needs root and nfs-ganesha ({vs.available()})")
SECRET = b"s" * 32


def in_netns(netns: str, fn):
    """``fn()`` in a thread that joined ``netns`` (sockets it makes live there)."""
    out = {}

    def run():
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            out["error"] = e
        finally:
            os.close(fd)

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    if "error" in out:
        raise out["error"]
    return out["value"]


POOL = "10.218.0.0/24"  # this file's own slot pool (inside namespaces of the test's own)


def _sh(netns: str | None, *argv: str) -> None:
    subprocess.run([*(["ip", "netns", "exec", netns] if netns else []), *argv], check=True, capture_output=True,
                   timeout=30)


def stand_in_guest(slot) -> str:
    """A netns in the guest's place: the slot's tap0 replaced by a veth to it, with the guest's
    address and MAC, so what it sends crosses the slot's real table as a guest's would."""
    guest = f"{slot.netns}g"
    _sh(None, "ip", "netns", "add", guest)
    _sh(slot.netns, "ip", "link", "del", "tap0")
    _sh(slot.netns, "ip", "link", "add", "tap0", "address", slots.GATEWAY_MAC, "type", "veth", "peer", "name", "eth0",
        "address", slots.GUEST_MAC, "netns", guest)
    _sh(slot.netns, "ip", "addr", "add", f"{GATEWAY_IP}/{slots.GUEST_PREFIX}", "dev", "tap0")
    _sh(slot.netns, "ip", "link", "set", "tap0", "up")
    for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{slots.GUEST_IP}/{slots.GUEST_PREFIX}",
                                                     "dev", "eth0"], ["ip", "link", "set", "eth0", "up"]):
        _sh(guest, *argv)
    return guest


@pytest.fixture
def node(tmp_path, slot_prefix):
    """Two teams' volumes in one store, a real slot (its table and all) with a stand-in guest."""
    store = tmp_path / "volumes"
    mine, theirs = store / "team-a" / "vol-a", store / "team-b" / "vol-b"
    for d in (mine, theirs):
        d.mkdir(parents=True)
    (mine / "hello.txt").write_text("hello from my volume\n")
    (theirs / "secret.txt").write_text("team b's secret\n")
    for p in (store, mine.parent, theirs.parent, mine, theirs, mine / "hello.txt", theirs / "secret.txt"):
        os.chown(p, 1000, 1000)
    slot = slots.create(slots.Slot(slot_prefix, 1, POOL))
    guest = stand_in_guest(slot)
    exports = [vs.Export(3, str(mine), "/3", nfs_guard.volume_key(SECRET, "team-a/vol-a"))]
    run_dir = tmp_path / "server"
    try:
        yield SimpleNamespace(store=store, mine=mine, theirs=theirs, slot=slot, guest=guest, exports=exports,
                              run_dir=run_dir)
    finally:
        vs.stop(run_dir)
        subprocess.run(["ip", "netns", "del", guest], check=False)
        shutil.rmtree(store, ignore_errors=True)


def serve(node) -> None:
    vs.start(node.slot, node.exports, node.run_dir)
    vs.open_ports(node.slot)


def forge(handle: bytes, ino: int, gen: int = 0) -> bytes:
    """ganesha's v3 handle with its VFS part's kernel handle (ext4: inode, generation) replaced:
    header (5 bytes), flags and fsid (9), the kernel handle type (1), then inode and generation."""
    assert handle[0] == 0x43 and handle[15 - 1] in (1, 0x81), handle.hex()  # FILEID_INO32_GEN
    return handle[:15] + struct.pack("<II", ino, gen) + handle[23:]


def test_ganesha_alone_lets_a_forged_handle_out_of_the_export(node):
    """The risk the guard exists for, on ganesha's own port (the slot's loopback: no guest
    reaches it): a handle for inode 2 with generation 0 is the root of the export's filesystem,
    and from it another team's volume is readable."""
    serve(node)

    def attack():
        with Nfs3Client("127.0.0.1", vs.SERVER_NFS_PORT, vs.SERVER_MOUNT_PORT) as nfs:
            status, root = nfs.mnt("/3")
            assert status == OK
            theirs = forge(root, os.stat(node.theirs / "secret.txt").st_ino)
            return nfs.getattr(forge(root, 2)), nfs.read(theirs)

    (status, attrs), read = in_netns(node.slot.netns, attack)  # the node's side of the slot
    assert status == OK and attrs["fileid"] == 2  # the filesystem's root directory
    assert read == (OK, b"team b's secret\n")


def test_the_guest_gets_nothing_but_its_volume(node):
    serve(node)
    other_key = nfs_guard.volume_key(SECRET, "team-b/vol-b")
    targets = {"the filesystem root": 2, "the volume store": os.stat(node.store).st_ino,
               "another team's file": os.stat(node.theirs / "secret.txt").st_ino,
               "another team's volume": os.stat(node.theirs).st_ino, "/etc": os.stat("/etc").st_ino}

    def attack():
        results = {}
        with Nfs3Client(GATEWAY_IP) as nfs:
            status, root = nfs.mnt("/3")
            assert status == OK and len(root) == 24 + nfs_guard.TAG_LEN
            status, hello = nfs.lookup(root, "hello.txt")
            results["own file"] = nfs.read(hello)
            inner = root[:-nfs_guard.TAG_LEN]
            for what, ino in targets.items():
                forged = forge(inner, ino)
                results[f"{what}, untagged"] = nfs.getattr(forged)[0]
                results[f"{what}, the root's tag"] = nfs.getattr(forged + root[-nfs_guard.TAG_LEN:])[0]
                results[f"{what}, another volume's key"] = nfs.getattr(nfs_guard.sign(other_key, forged))[0]
                results[f"{what}, read"] = nfs.read(forged + root[-nfs_guard.TAG_LEN:])[0]
            results["ganesha's own root handle"] = nfs.getattr(inner)[0]
            results["a flipped tag bit"] = nfs.getattr(root[:-1] + bytes([root[-1] ^ 1]))[0]
            results["lookup .. at the root"] = nfs.lookup(root, "..")
            results["mount /"] = nfs.mnt("/")[0]
            results["mount the store's path"] = nfs.mnt(str(node.store))[0]
            results["root"] = root
        for port in (vs.SERVER_NFS_PORT, vs.SERVER_MOUNT_PORT, 111):  # ganesha and rpcbind themselves
            try:
                socket.create_connection((GATEWAY_IP, port), timeout=1).close()
                results[f"port {port}"] = "open"
            except OSError:
                results[f"port {port}"] = "closed"
        return results

    results = in_netns(node.guest, attack)
    root = results.pop("root")
    assert results.pop("own file") == (OK, b"hello from my volume\n")
    assert results.pop("lookup .. at the root") == (OK, root)  # ".." of the export is the export
    assert results.pop("mount /") == NOENT and results.pop("mount the store's path") == NOENT
    assert [results.pop(f"port {p}") for p in (vs.SERVER_NFS_PORT, vs.SERVER_MOUNT_PORT, 111)] == ["closed"] * 3
    assert results and all(status == BADHANDLE for status in results.values()), results


def test_the_volume_works_and_its_handles_survive_a_new_server(node):
    serve(node)

    def work():
        with Nfs3Client(GATEWAY_IP, uid=0, gid=0) as nfs:  # guest root: squashed
            _, root = nfs.mnt("/3")
            status, d = nfs.mkdir(root, "dir")
            assert status == OK
            status, f = nfs.create(d, "f.txt")
            assert status == OK and nfs.write(f, b"written by the guest") == OK
            status, entries = nfs.readdirplus(d)
            assert status == OK and set(entries) == {".", "..", "f.txt"} and entries["f.txt"] == f
            for n in range(300):  # a listing of many pages, each within what the client asked for
                assert nfs.create(d, f"file-{n:03}-{'x' * (n % 40)}")[0] == OK
            status, entries = nfs.readdirplus(d, maxcount=4096)
            assert status == OK and len(entries) == 303
            assert all(nfs.getattr(fh)[0] == OK for fh in list(entries.values())[::37])
            return root, d, f

    root, d, f = in_netns(node.guest, work)
    assert (node.mine / "dir" / "f.txt").read_bytes() == b"written by the guest"
    assert os.stat(node.mine / "dir" / "f.txt").st_uid == 1000
    vs.stop(node.run_dir)
    serve(node)  # a resume or a fork child: a new server

    def again():
        with Nfs3Client(GATEWAY_IP) as nfs:  # no MNT: the guest's memory still has the handles
            return nfs.read(f), nfs.lookup(d, "f.txt")

    assert in_netns(node.guest, again) == ((OK, b"written by the guest"), (OK, f))


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def _procs(comm: str, run_dir: Path) -> list[int]:
    """The server's processes (its process group) whose command name starts with ``comm``."""
    pgid = int((run_dir / "server.pid").read_text())
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.getpgid(int(p.name)) == pgid and (p / "comm").read_text().startswith(comm[:15]):
                    out.append(int(p.name))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return out


def test_the_server_holds_six_capabilities_and_sees_only_its_root(node):
    serve(node)
    [ganesha] = _procs("ganesha.nfsd", node.run_dir)
    listening = subprocess.run(node.slot.nsenter("ss", "-Hltnp"), capture_output=True, text=True).stdout.splitlines()
    ganesha_binds = sorted(line.split()[3] for line in listening if "ganesha" in line)
    assert ganesha_binds == [f"127.0.0.1:{vs.SERVER_MOUNT_PORT}", f"127.0.0.1:{vs.SERVER_NFS_PORT}"], listening
    status = _status(ganesha)
    # CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_SETGID, CAP_SETUID
    caps = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6) | (1 << 7)
    assert int(status["CapBnd"], 16) == caps and int(status["CapPrm"], 16) == caps
    assert int(status["CapInh"], 16) == 0 and int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"  # syscall_fence's filter
    seen = Path(f"/proc/{ganesha}/root")
    assert sorted(p.name for p in seen.iterdir()) == sorted(
        [".empty", "bin", "dev", "etc", "exports", "fence.py", "guard.py", "lib", "lib64", "log", "proc", "run", "sbin",
         "tmp", "usr", "var"])
    assert sorted(p.name for p in (seen / "exports").iterdir()) == ["3"]
    assert (seen / "exports" / "3" / "hello.txt").read_text() == "hello from my volume\n"
    assert not (seen / "etc" / "shadow").exists() and not (seen / "root").exists()
    assert (seen / "usr" / "bin" / "ganesha.nfsd").exists()
    mounts = [m.split() for m in Path(f"/proc/{ganesha}/mountinfo").read_text().splitlines()]
    assert len(mounts) == 6, mounts  # the tmpfs root, /usr, /dev (a tmpfs of its own), the export, the log, /proc
    [dev] = [m for m in mounts if m[4] == "/dev"]
    assert dev[-3] == "tmpfs" and dev[5].startswith("ro,"), dev  # never a bind of the node's devtmpfs
    assert sorted(p.name for p in (seen / "dev").iterdir()) == ["null", "random", "urandom", "zero"]
    [export] = [m for m in mounts if m[3:5] == [str(node.mine), "/exports/3"]]
    assert "nosuid" in export[5] and "nodev" in export[5]
    [usr] = [m for m in mounts if m[4] == "/usr"]
    assert usr[5].startswith("ro,") and usr[-3] == "overlay"
    # open_by_handle_at takes any fd or mount of a filesystem as the way into all of it: of the
    # node's filesystems (here the store shares "/" with the node) ganesha holds the exports only
    node_fs = os.stat("/").st_dev
    node_mounts = [m[4] for m in mounts if os.makedev(*map(int, m[2].split(":"))) == node_fs]
    assert node_mounts == ["/exports/3"], node_mounts
    fds = {}
    for fd in Path(f"/proc/{ganesha}/fd").iterdir():
        try:
            if os.stat(fd).st_dev == node_fs:
                fds[fd.name] = os.readlink(fd)
        except FileNotFoundError:
            continue
    assert fds and all(target.startswith("/exports/3") for target in fds.values()), fds
    # its /proc shows the server's own processes only (a pid namespace): no /proc/<pid>/root of
    # a node process to walk into
    pids = [p for p in (seen / "proc").iterdir() if p.name.isdigit()]
    names = sorted((p / "comm").read_text().strip() for p in pids)
    assert [n.split(".")[0] for n in names] == ["ganesha", "python3", "rpcbind", "sh"], names  # sh: its init
    [guard] = _procs("python3", node.run_dir)
    gstatus = _status(guard)
    assert gstatus["Uid"].split()[:2] == ["65534", "65534"] and int(gstatus["CapBnd"], 16) == 0
    assert int(gstatus["CapEff"], 16) == 0 and gstatus["NoNewPrivs"].strip() == "1"
    assert gstatus["Seccomp"].strip() == "2"
    assert os.stat(f"/proc/{guard}/environ").st_uid == 0  # not dumpable: another guard (nobody too) can't read it

    pidns = os.readlink(f"/proc/{ganesha}/ns/pid")
    assert vs.stop(node.run_dir) is True

    def left() -> list[str]:  # nothing of it is left: ganesha, rpcbind (a daemon: its own session), the guard
        found = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and os.readlink(p / "ns" / "pid") == pidns:
                    found.append((p / "stat").read_text())
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        return found

    # the pid namespace's last processes are reaped just after its init: a moment, on a loaded host
    until(lambda: not left(), "the server's processes (ganesha, rpcbind, the guard) to be gone", 15, tolerate=())


def test_the_guard_answers_pings_and_holds_few_connections(node):
    """The kernel's client pings (NULL) before it mounts, and keeps many calls in flight when
    busy; a guest that opens connection after connection gets at most ``MAX_CONNECTIONS``."""
    serve(node)

    def pings_and_flood():
        with Nfs3Client(GATEWAY_IP) as nfs:
            nfs.call(NFS_PROGRAM, 0, b"")
            nfs.call(MOUNT_PROGRAM, 0, b"")
            _, root = nfs.mnt("/3")
            # more calls in flight than the guard holds: it makes the client wait, it does not hang up
            burst = nfs.pipeline(NFS_PROGRAM, 1, Packer().opaque(root).bytes(), nfs_guard.MAX_PENDING + 500)
            assert [u.uint() for u in burst] == [OK] * (nfs_guard.MAX_PENDING + 500)
        held = [socket.create_connection((GATEWAY_IP, vs.NFS_PORT), timeout=5)
                for _ in range(nfs_guard.MAX_CONNECTIONS)]
        try:
            extra = socket.create_connection((GATEWAY_IP, vs.NFS_PORT), timeout=5)
            closed = extra.recv(1) == b""
            extra.close()
            held[0].settimeout(0.5)
            try:
                first_open = held[0].recv(1) != b""
            except socket.timeout:
                first_open = True
            return closed, first_open
        finally:
            for s in held:
                s.close()

    assert in_netns(node.guest, pings_and_flood) == (True, True)
