"""The chunkfs daemon (``python -m chunkfs serve``) on real FUSE mounts in tmp dirs, over a
directory of chunk files the tests cut: reads through the kernel equal the original bytes,
mmap MAP_PRIVATE works and its writes stay private, writable mounts copy on write, read-ahead
and recording, EIO (not a hang, not wrong bytes) when the source fails, hangs or lies, a
restart on a warm cache fetches nothing, the control socket refuses malformed requests, one
daemon per pidfile, a dead daemon's stale mount is cleaned up, QEMU reads a qcow2 on a lazy
mount."""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chunkfs.client import ChunkfsClient, ChunkfsError, ensure_daemon
from vmm.qemu.ramfile import copy_parallel_into, on_fuse

ROOT = Path(__file__).resolve().parents[2]
CS = 256 * 1024

pytestmark = pytest.mark.xdist_group("chunkfs")


def cut(data: bytes, store: Path, chunk_size: int = CS) -> dict:
    """Writes ``data``'s chunks into ``store/chunks`` and returns its manifest entry."""
    (store / "chunks").mkdir(parents=True, exist_ok=True)
    chunks = []
    for off in range(0, len(data), chunk_size):
        piece = data[off:off + chunk_size]
        if not piece.strip(b"\0"):
            continue
        sha = hashlib.sha256(piece).hexdigest()
        (store / "chunks" / sha).write_bytes(piece)
        chunks.append([off, len(piece), sha])
    return {"size": len(data), "chunks": chunks}


def sample(size: int, seed: int = 1) -> bytes:
    r = random.Random(seed)
    data = bytearray(r.randbytes(size))
    data[CS:2 * CS] = bytes(CS)  # a whole-chunk hole
    data[5 * CS + 10:5 * CS + 9000] = bytes(8990)  # zeros inside a chunk
    return bytes(data)


class Node:
    """A daemon's directories under tmp_path, and starting/stopping it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.mnt = tmp / "mnt"
        self.cache = tmp / "cache"
        self.control = tmp / "chunkfs.sock"
        self.store = tmp / "store"
        self.log = tmp / "chunkfs.log"
        self.store.mkdir(exist_ok=True)

    def start(self, *extra: str, env: dict | None = None, dir_source: bool = True) -> ChunkfsClient:
        return ensure_daemon(self.control, mountpoint=self.mnt, cache_dir=self.cache, limit_mb=64,
                             log_path=self.log, dir_source=self.store if dir_source else None,
                             extra_args=list(extra), env=env, timeout=30)

    def pid(self) -> int:
        return int((Path(str(self.control) + ".pid")).read_text())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        try:
            pid = self.pid()
            os.kill(pid, sig)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return
            time.sleep(0.05)
        raise AssertionError(f"the daemon {pid} did not stop:\n{self.log.read_text()[-2000:]}")


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@pytest.fixture
def node(tmp_path):
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("chunkfs needs /dev/fuse and fusermount3 (the fuse3 package; scripts/setup.sh)")
    n = Node(tmp_path)
    yield n
    n.stop()
    if _mounted(n.mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(n.mnt)], check=False)


def test_reads_through_fuse_equal_the_original_bytes(node):
    data = sample(9 * CS + 4321)
    spec = cut(data, node.store)
    c = node.start()
    path = c.mount("snap-1", CS, {"disk.raw": spec, "small": cut(b"hello", node.store)})
    assert path == node.mnt / "snap-1"
    assert sorted(os.listdir(node.mnt)) == ["snap-1"]
    assert sorted(os.listdir(path)) == ["disk.raw", "small"]
    st = os.stat(path / "disk.raw")
    assert st.st_size == len(data) and stat.S_IMODE(st.st_mode) == 0o444
    assert (path / "small").read_bytes() == b"hello"
    r = random.Random(11)
    fd = os.open(path / "disk.raw", os.O_RDONLY)
    try:
        for _ in range(200):
            off = r.randrange(len(data) + 10)
            n = r.choice([1, 4096, CS - 7, CS, 3 * CS + 5])
            assert os.pread(fd, n, off) == data[off:off + n], (off, n)
    finally:
        os.close(fd)
    assert (path / "disk.raw").read_bytes() == data
    stats = c.stats("snap-1")["mounts"]["snap-1"]
    assert stats["fetched_chunks"] == len(spec["chunks"]) + 1 and stats["errors"] == 0  # each chunk once


def test_files_of_one_mount_may_have_their_own_chunk_sizes(node):
    """Guest RAM cut smaller than the disks beside it: each file reads with its own size, a
    read over several small chunks fetches them all (at once), holes stay zeros."""
    disk, ram = sample(6 * CS + 99, seed=2), sample(3 * CS, seed=3)
    small = CS // 8
    c = node.start()
    path = c.mount("mixed", CS, {"disk": cut(disk, node.store),
                                 "ram": {**cut(ram, node.store, small), "chunk_size": small}})
    assert (path / "ram").read_bytes() == ram and (path / "disk").read_bytes() == disk
    assert on_fuse(path / "ram") and not on_fuse(node.store)
    fd = os.open(node.tmp / "ram-copy", os.O_CREAT | os.O_RDWR, 0o600)
    try:  # how a template restore copies a lazy RAM file: several readers at once
        os.ftruncate(fd, len(ram))
        copy_parallel_into(path / "ram", fd, readers=4, segment=CS)
    finally:
        os.close(fd)
    assert (node.tmp / "ram-copy").read_bytes() == ram
    described = c.list()[0]["files"]
    assert described == {"disk": {"size": len(disk), "chunk_size": CS}, "ram": {"size": len(ram), "chunk_size": small}}
    c.unmount("mixed")
    path = c.mount("mixed2", CS, {"ram": {**cut(ram, node.store, small), "chunk_size": small}}, record=True)
    with open(path / "ram", "rb") as f:
        f.seek(2 * CS + 3 * small + 1)
        assert f.read(10) == ram[2 * CS + 3 * small + 1:2 * CS + 3 * small + 11]
    recorded = c.stats("mixed2")["mounts"]["mixed2"]["recorded"]
    assert ["ram", 2 * 8 + 3] in recorded  # indices count the file's own chunks
    for bad in (0, -1, "4", True):
        with pytest.raises(ChunkfsError) as exc:
            c.mount("bad", CS, {"ram": {**cut(ram, node.store, small), "chunk_size": bad}})
        assert exc.value.code == "bad_request"
    with pytest.raises(ChunkfsError) as exc:  # chunks that do not fit the file's own size
        c.mount("bad", CS, {"ram": {**cut(ram, node.store), "chunk_size": small}})
    assert exc.value.code == "bad_request"


def test_copy_out_writes_a_mounted_file_into_another_leaving_holes(node, tmp_path):
    """What a template or moved restore asks for its lazy RAM: the daemon writes the file into
    the sandbox's own (``copy_out``), the bytes equal, holes where the file has zeros; a bad
    destination or a chunk the store lost is an error object, never a partial success."""
    ram = sample(12 * CS, seed=5)
    small = CS // 4
    c = node.start()
    c.mount("cp", CS, {"ram": {**cut(ram, node.store, small), "chunk_size": small}})
    dest = tmp_path / "copy.ram"
    with open(dest, "wb") as f:
        f.truncate(len(ram))
    reply = c.copy_out("cp", "ram", dest)
    assert dest.read_bytes() == ram
    nonzero = sum(1 for i in range(0, len(ram), 64 << 10) if ram[i:i + (64 << 10)].strip(b"\0"))
    assert reply["written"] == nonzero * (64 << 10) < len(ram)
    assert os.stat(dest).st_blocks * 512 < len(ram)  # the whole-chunk hole stayed a hole
    stats = c.stats("cp")["mounts"]["cp"]
    assert stats["errors"] == 0 and stats["fetched_chunks"] == len(cut(ram, node.store, small)["chunks"])

    link = tmp_path / "link.ram"
    link.symlink_to(dest)
    wrong_size = tmp_path / "short.ram"
    wrong_size.write_bytes(b"x")
    for args, code in [(("cp", "ram", link), "bad_request"), (("cp", "ram", wrong_size), "bad_request"),
                       (("cp", "ram", "relative.ram"), "bad_request"), (("cp", "nope", dest), "not_found"),
                       (("nope", "ram", dest), "not_found"), (("cp", "../ram", dest), "bad_request")]:
        with pytest.raises(ChunkfsError) as exc:
            c.copy_out(*args)
        assert exc.value.code == code, args
    assert dest.read_bytes() == ram  # the symlink's target was not written through it

    lost = sample(3 * CS, seed=6)
    spec = cut(lost, node.store)
    (node.store / "chunks" / spec["chunks"][-1][2]).unlink()
    c.mount("lost", CS, {"ram": spec})
    dest2 = tmp_path / "lost.ram"
    with open(dest2, "wb") as f:
        f.truncate(len(lost))
    with pytest.raises(ChunkfsError) as exc:
        c.copy_out("lost", "ram", dest2)
    assert exc.value.code == "unavailable"
    assert c.ping()["pid"] == node.pid()  # the daemon stays up


def test_ram_copy_goes_to_the_daemon_and_falls_back_to_readers(node, tmp_path):
    """``ramfile.copy_into`` hands a lazy file to the node's copier (``LazyRestores.copy_ram``:
    the chunkfs daemon) and reads it itself only when the copier does not serve it (a daemon
    older than ``copy_out``, a file of no mount); a plain file is copied in the kernel."""
    from agent.stores.lazy import LazyRestores
    from vmm.qemu import ramfile

    ram = sample(6 * CS, seed=7)
    c = node.start()
    path = c.mount("rc", CS, {"ram": cut(ram, node.store)})
    lazy = LazyRestores(tmp_path / "home", limit_mb=64, daemon_env={}, files_in_use=lambda: [])
    lazy.control, lazy.mountpoint = node.control, node.mnt  # the test daemon's
    link = tmp_path / "snapshot-memory.ram"  # as a lazy snapshot's dir links into the mount
    link.symlink_to(path / "ram")

    def copy(src, copier) -> tuple[str, bytes]:
        dst = tmp_path / f"dst-{len(list(tmp_path.glob('dst-*')))}.ram"
        fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, len(ram))
            how = ramfile.copy_into(src, fd, dst, copier)
        finally:
            os.close(fd)
        return how, dst.read_bytes()

    assert copy(link, lazy.copy_ram) == ("daemon", ram)
    assert copy(link, lambda src, dst: False) == ("readers", ram)
    assert copy(link, None) == ("readers", ram)
    plain = tmp_path / "plain.ram"
    plain.write_bytes(ram)
    assert copy(plain, lazy.copy_ram) == ("kernel", ram)
    assert lazy.copy_ram(plain, tmp_path / "x") is False  # not a file of a mount

    class OldDaemon:  # started before copy_out: it answers unknown_op
        def copy_out(self, *args):
            raise ChunkfsError("unknown_op", "unknown op 'copy_out'")

    lazy._daemon = OldDaemon
    assert copy(link, lazy.copy_ram) == ("readers", ram)


def test_many_readers_of_a_file_bigger_than_the_cache(node):
    """16 threads read random ranges of a 6 MiB file through a 2 MiB cache: every byte is
    right, chunks are evicted and fetched again, and the cache never passes its bound."""
    data = sample(24 * CS, seed=9)
    spec = cut(data, node.store)
    c = node.start("--limit-mb", "2")
    path = c.mount("big", CS, {"disk": spec}) / "disk"
    wrong = []

    def reader(seed):
        r = random.Random(seed)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            for _ in range(60):
                off = r.randrange(len(data))
                n = r.choice([4096, 65536, CS + 3])
                if os.pread(fd, n, off) != data[off:off + n]:
                    wrong.append((off, n))
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read asks the daemon again
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not wrong
    s = c.stats()["cache"]
    assert s["limit_bytes"] == 2 << 20 and s["size_bytes"] <= s["limit_bytes"]
    assert s["evictions"] > 0 and s["corrupt"] == 0
    assert c.stats("big")["mounts"]["big"]["errors"] == 0


def test_mmap_private_reads_the_file_and_keeps_its_writes(node):
    data = sample(4 * CS, seed=2)
    spec = cut(data, node.store)
    before = {p.name: p.read_bytes() for p in (node.store / "chunks").iterdir()}
    c = node.start()
    path = c.mount("ram", CS, {"memory": spec}) / "memory"
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), len(data), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        assert m[:] == data
        m[CS - 2:CS + 2] = b"WXYZ"  # into the hole's first page too
        m[3 * CS:3 * CS + 5] = b"guest"
        assert m[3 * CS:3 * CS + 5] == b"guest"
    finally:
        m.close()
    assert path.read_bytes() == data
    assert {p.name: p.read_bytes() for p in (node.store / "chunks").iterdir()} == before


def test_read_only_mount_refuses_writes(node):
    c = node.start()
    path = c.mount("ro", CS, {"disk": cut(sample(2 * CS), node.store)}) / "disk"
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDWR | os.O_TRUNC):
        with pytest.raises(OSError) as exc:
            os.open(path, flags)
        assert exc.value.errno == errno.EROFS
    with pytest.raises(OSError) as exc:
        os.truncate(path, 0)
    assert exc.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError):
        (path.parent / "new").write_bytes(b"x")


def test_writable_mount_copies_on_write_and_drops_the_overlay_on_unmount(node):
    data = sample(6 * CS, seed=3)
    spec = cut(data, node.store)
    before = {p.name: p.read_bytes() for p in (node.store / "chunks").iterdir()}
    c = node.start()
    path = c.mount("rw", CS, {"top.qcow2": spec}, writable=True) / "top.qcow2"
    model = bytearray(data)
    with open(path, "r+b") as f:
        for off, blob in [(0, b"QFI\xfb-header"), (CS - 3, b"across-a-border"), (CS + 100, b"in-the-hole"),
                          (len(data) + 1000, b"grown")]:
            f.seek(off)
            f.write(blob)
            if off > len(model):
                model += bytes(off - len(model))
            model[off:off + len(blob)] = blob
    assert path.stat().st_size == len(model)
    assert path.read_bytes() == bytes(model)
    os.truncate(path, 3 * CS)
    assert path.read_bytes() == bytes(model[:3 * CS])
    overlays = node.tmp / "cache-overlays"
    assert (overlays / "rw" / "top.qcow2").exists()
    assert c.stats("rw")["mounts"]["rw"]["written_bytes"] > 0
    c.unmount("rw")
    assert not (overlays / "rw").exists()
    assert {p.name: p.read_bytes() for p in (node.store / "chunks").iterdir()} == before
    again = c.mount("rw2", CS, {"top.qcow2": spec}, writable=True) / "top.qcow2"
    assert again.read_bytes() == data


def test_sequential_read_fetches_ahead_and_recording_keeps_first_touch_order(node):
    data = os.urandom(16 * CS)
    spec = cut(data, node.store)
    c = node.start("--readahead", "3")
    path = c.mount("seq", CS, {"a": spec, "b": spec}, record=True)
    fd = os.open(path / "a", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead: only ours
        for off in range(0, CS, 64 * 1024):  # chunk 0, sequentially
            assert os.pread(fd, 64 * 1024, off) == data[off:off + 64 * 1024]
        deadline = time.monotonic() + 10
        while c.stats("seq")["mounts"]["seq"]["fetched_chunks"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        # chunk 0 read, chunks 1-3 fetched ahead of the reader, but not read (not recorded)
        assert c.stats("seq")["mounts"]["seq"]["fetched_chunks"] == 4
        os.pread(fd, 10, 9 * CS)
    finally:
        os.close(fd)
    fd = os.open(path / "b", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    os.pread(fd, 10, 5 * CS + 1)
    os.close(fd)
    assert c.stats("seq")["mounts"]["seq"]["recorded"] == [["a", 0], ["a", 9], ["b", 5]]
    # the recorded order replayed as a prefetch list, on a fresh cache of another daemon
    order = c.unmount("seq")["recorded"]
    assert order == [["a", 0], ["a", 9], ["b", 5]]


def test_prefetch_list_runs_in_the_background(node):
    data = os.urandom(8 * CS)
    spec = cut(data, node.store)
    c = node.start()
    c.mount("warm", CS, {"mem": spec}, prefetch=[["mem", 7], ["mem", 2], ["mem", 1]])
    deadline = time.monotonic() + 10
    while not c.stats("warm")["mounts"]["warm"]["prefetch"]["finished"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = c.stats("warm")
    assert s["mounts"]["warm"]["prefetch"] == {"queued": 3, "done": 3, "failed": 0, "finished": True}
    assert s["mounts"]["warm"]["fetched_chunks"] == 3
    assert s["cache"]["hits"] == 0 and s["cache"]["misses"] == 0  # prefetches are no reads
    fd = os.open(node.mnt / "warm" / "mem", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    assert os.pread(fd, 100, 7 * CS) == data[7 * CS:7 * CS + 100]
    os.close(fd)
    assert c.stats("warm")["mounts"]["warm"]["fetched_chunks"] == 3  # served from the prefetched chunk


def test_missing_chunk_gives_eio_and_the_daemon_stays_up(node):
    data = os.urandom(4 * CS)
    spec = cut(data, node.store)
    (node.store / "chunks" / spec["chunks"][2][2]).unlink()
    c = node.start()
    path = c.mount("broken", CS, {"disk": spec}) / "disk"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 100, 0) == data[:100]
        t = time.monotonic()
        with pytest.raises(OSError) as exc:
            os.pread(fd, 100, 2 * CS + 5)
        assert exc.value.errno == errno.EIO and time.monotonic() - t < 5
    finally:
        os.close(fd)
    assert c.ping()["pid"] == node.pid()
    assert c.stats("broken")["mounts"]["broken"]["errors"] >= 1


def test_a_mount_with_store_wait_reads_a_chunk_that_arrives_later(node):
    """A fork's capture handed to this node while its own node still uploads it: a chunk the
    store does not have yet is waited for (``store_wait``), not an EIO."""
    data = os.urandom(4 * CS)
    spec = cut(data, node.store)
    late = node.store / "chunks" / spec["chunks"][2][2]
    body = late.read_bytes()
    late.unlink()
    c = node.start()
    assert "store_wait" in c.ping()["features"]
    path = c.mount("pending", CS, {"disk": spec}, store_wait=20.0) / "disk"
    threading.Timer(1.0, late.write_bytes, args=(body,)).start()  # the upload gets there
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.monotonic()
        assert os.pread(fd, 100, 2 * CS + 5) == data[2 * CS + 5:2 * CS + 105]
        assert 0.8 < time.monotonic() - t < 15
    finally:
        os.close(fd)
    for bad in (-1, "10", True, 7200):
        reply = _raw(node.control, json.dumps({"op": "mount", "mount_id": "w", "chunk_size": CS,
                                               "files": {"d": spec}, "store_wait": bad}).encode() + b"\n")
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", (bad, reply)
        assert "store_wait" in reply["error"]["message"]


def test_a_source_that_never_answers_gives_eio_within_the_read_deadline(node):
    with socket.socket() as silent:  # an S3 endpoint that accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        env = {**os.environ, "AENV_S3_BUCKET": "aenv", "AENV_S3_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "AENV_S3_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        data = os.urandom(2 * CS)
        spec = cut(data, node.store)
        c = node.start("--read-deadline", "2", env=env, dir_source=False)
        assert c.ping()["source"].startswith("s3://aenv/")
        path = c.mount("silent", CS, {"disk": spec}) / "disk"
        t = time.monotonic()
        with pytest.raises(OSError) as exc:
            with open(path, "rb") as f:
                f.read(100)
        took = time.monotonic() - t
        assert exc.value.errno == errno.EIO
        assert 1.5 < took < 4, took  # one deadline: the kernel's retries of the same chunk fail at once
        assert c.ping()["pid"] == node.pid()
        t = time.monotonic()
        node.stop()  # fetches still hang in the source: the daemon still stops promptly
        assert time.monotonic() - t < 10
        assert not _mounted(node.mnt)


def test_reads_hanging_on_the_source_do_not_hold_up_other_reads(node):
    """30 readers wait for a silent store; a read that needs no fetch (a hole) is still
    answered at once (libfuse's 10 default workers and the kernel's 12 background requests
    would have queued it behind them)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(128)
        env = {**os.environ, "AENV_S3_BUCKET": "aenv", "AENV_S3_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "AENV_S3_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        c = node.start("--read-deadline", "6", "--fetch-workers", "40", env=env, dir_source=False)
        n = 30
        chunks = [[i * CS, CS, hashlib.sha256(b"%d" % i).hexdigest()] for i in range(n)]
        path = c.mount("busy", CS, {"f": {"size": (n + 4) * CS, "chunks": chunks}}) / "f"
        errors = []

        def read(i):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            try:
                os.pread(fd, 10, i * CS)
            except OSError as exc:
                errors.append(exc.errno)
            finally:
                os.close(fd)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(1)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t0 = time.monotonic()
        assert os.pread(fd, 10, (n + 2) * CS) == bytes(10)
        took = time.monotonic() - t0
        os.close(fd)
        for t in threads:
            t.join(30)
        assert took < 1.0, took
        assert errors == [errno.EIO] * n


def test_a_corrupt_chunk_in_the_store_is_never_returned(node):
    data = os.urandom(3 * CS)
    spec = cut(data, node.store)
    bad = node.store / "chunks" / spec["chunks"][1][2]
    bad.write_bytes(bytes(CS))  # same length, wrong bytes
    c = node.start()
    path = c.mount("corrupt", CS, {"disk": spec}) / "disk"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        with pytest.raises(OSError) as exc:
            os.pread(fd, 4096, CS)
        assert exc.value.errno == errno.EIO
        assert os.pread(fd, 4096, 0) == data[:4096]
    finally:
        os.close(fd)
    assert c.stats()["cache"]["corrupt"] >= 1


def test_restart_with_a_warm_cache_fetches_nothing(node):
    data = sample(6 * CS, seed=4)
    spec = cut(data, node.store)
    c = node.start()
    first = node.pid()
    assert (c.mount("warm", CS, {"disk": spec}) / "disk").read_bytes() == data
    node.stop()
    assert not _mounted(node.mnt) and not node.control.exists()
    shutil.rmtree(node.store / "chunks")  # nothing left to fetch from
    c = node.start()
    assert node.pid() != first
    assert c.list() == []  # mounts do not outlive the daemon
    assert (c.mount("warm", CS, {"disk": spec}) / "disk").read_bytes() == data
    s = c.stats()
    assert s["mounts"]["warm"]["fetched_chunks"] == 0 and s["cache"]["misses"] == 0


def _raw(control: Path, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(control))
        s.sendall(payload)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, "the daemon closed the connection without an answer"
            buf += chunk
    return json.loads(buf)


def test_control_socket_refuses_malformed_requests_with_an_error_object(node):
    c = node.start()
    assert stat.S_IMODE(os.stat(node.control).st_mode) == 0o600
    good = cut(os.urandom(CS), node.store)
    cases = [
        (b"not json\n", "bad_json"),
        (b"[1, 2]\n", "bad_json"),
        (b'{"op": "format-disk"}\n', "unknown_op"),
        (b'{"no": "op"}\n', "unknown_op"),
        (json.dumps({"op": "mount", "mount_id": "../etc", "chunk_size": CS, "files": {"d": good}}).encode() + b"\n",
         "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS, "files": {}}).encode() + b"\n", "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": 0, "files": {"d": good}}).encode() + b"\n",
         "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS,
                     "files": {"d": {"size": 10, "chunks": [[0, 10, "../../x"]]}}}).encode() + b"\n", "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS,
                     "files": {"d": {"size": 10, "chunks": [[0, CS, good["chunks"][0][2]]]}}}).encode() + b"\n",
         "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS, "files": {"a/b": good}}).encode() + b"\n",
         "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS, "files": {"d": good},
                     "prefetch": [["other", 0]]}).encode() + b"\n", "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS, "files": {"d": good},
                     "writable": "yes"}).encode() + b"\n", "bad_request"),
        (json.dumps({"op": "mount", "mount_id": "m", "chunk_size": CS, "files": {"d": good},
                     "pieces": [{"key": "../x", "chunks": [[good["chunks"][0][2], CS, CS, ""]]}]}).encode() + b"\n",
         "bad_request"),
        (b'{"op": "unmount", "mount_id": "nothing"}\n', "not_found"),
        (b'{"op": "stats", "mount_id": "nothing"}\n', "not_found"),
    ]
    for payload, code in cases:
        reply = _raw(node.control, payload)
        assert reply["ok"] is False and reply["error"]["code"] == code, (payload, reply)
        assert reply["error"]["message"]
    assert c.list() == []  # no refused mount left anything behind
    c.mount("m", CS, {"d": good})
    with pytest.raises(ChunkfsError) as exc:
        c.mount("m", CS, {"d": good})
    assert exc.value.code == "exists"
    assert c.ping()["pid"] == node.pid()


def test_mounts_are_gone_after_unmount(node):
    first = os.urandom(CS)
    spec = cut(first, node.store)
    c = node.start()
    c.mount("a", CS, {"f": spec})
    c.mount("b", CS, {"f": spec})
    held = os.open(node.mnt / "a" / "f", os.O_RDONLY)  # keeps the inode (and its cached pages) alive
    assert os.pread(held, CS, 0) == first
    assert sorted(os.listdir(node.mnt)) == ["a", "b"]
    assert [m["mount_id"] for m in c.list()] == ["a", "b"]
    c.unmount("a")
    assert sorted(os.listdir(node.mnt)) == ["b"]
    assert not (node.mnt / "a" / "f").exists()
    assert [m["mount_id"] for m in c.list()] == ["b"]
    with pytest.raises(ChunkfsError) as exc:
        c.unmount("a")
    assert exc.value.code == "not_found"
    # the same id mounted again with other bytes, the old inode still open: no stale page cache
    other = os.urandom(CS)
    c.mount("a", CS, {"f": cut(other, node.store)})
    assert (node.mnt / "a" / "f").read_bytes() == other
    os.close(held)


def test_one_daemon_per_pidfile_and_a_dead_daemons_mount_is_cleaned_up(node):
    node.start()
    first = node.pid()
    second = subprocess.run([sys.executable, "-m", "chunkfs", "serve", "--mountpoint", str(node.mnt), "--cache",
                             str(node.tmp / "cache2"), "--control", str(node.control), "--dir-source", str(node.store)],
                            cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert second.returncode == 3 and "already running" in second.stderr
    assert ChunkfsClient(node.control).ping()["pid"] == first
    node.stop(signal.SIGKILL)  # no cleanup: a stale FUSE mount is left behind
    assert _mounted(node.mnt)
    with pytest.raises(OSError) as exc:
        os.listdir(node.mnt)
    assert exc.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    c = node.start()  # ensure_daemon: the socket does not answer, so a new daemon starts
    assert node.pid() != first
    assert os.listdir(node.mnt) == [] and c.list() == []


def test_qemu_reads_a_qcow2_on_a_lazy_mount(node, tmp_path):
    image = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"], check=True)
    subprocess.run(["qemu-io", "-c", "write -P 0x5a 1M 3M", "-c", "write -P 0xa5 40M 64k", str(image)],
                   check=True, capture_output=True)
    spec = cut(image.read_bytes(), node.store)
    c = node.start()
    lazy = c.mount("qcow", CS, {"disk.qcow2": spec}) / "disk.qcow2"
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(lazy)], check=True,
                                     capture_output=True, text=True).stdout)
    assert info["format"] == "qcow2" and info["virtual-size"] == 64 << 20
    out = subprocess.run(["qemu-io", "-r", "-c", "read -P 0x5a 1M 3M", "-c", "read -P 0xa5 40M 64k",
                          "-c", "read -P 0 10M 1M", str(lazy)], check=True, capture_output=True, text=True)
    assert "Pattern verification failed" not in out.stdout + out.stderr
    subprocess.run(["qemu-img", "compare", "-q", str(image), str(lazy)], check=True)
    # writable: QEMU rewrites the header (a new backing file) and writes guest data, into the overlay
    base = tmp_path / "base.raw"
    base.write_bytes(bytes(64 << 20))
    rw = c.mount("qcow-rw", CS, {"disk.qcow2": spec}, writable=True) / "disk.qcow2"
    subprocess.run(["qemu-img", "rebase", "-u", "-b", str(base), "-F", "raw", str(rw)], check=True)
    subprocess.run(["qemu-io", "-c", "write -P 0x11 8M 1M", str(rw)], check=True, capture_output=True)
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(rw)], check=True,
                                     capture_output=True, text=True).stdout)
    assert info["backing-filename"] == str(base)
    out = subprocess.run(["qemu-io", "-r", "-c", "read -P 0x11 8M 1M", "-c", "read -P 0x5a 1M 3M", str(rw)],
                         check=True, capture_output=True, text=True)
    assert "Pattern verification failed" not in out.stdout + out.stderr
    subprocess.run(["qemu-img", "check", "-q", str(rw)], check=True)
    c.unmount("qcow-rw")
    subprocess.run(["qemu-img", "compare", "-q", str(image), str(lazy)], check=True)  # the chunks are untouched
