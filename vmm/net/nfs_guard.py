"""The guard between a guest and its volume server: signs every NFS file handle the server
hands out and lets through only handles it signed, so a guest can name nothing but what it
reached by lookups from its own exports.

Why: nfs-ganesha's VFS backend turns a handle into a file with ``open_by_handle_at``, which
reaches any inode of the filesystem that holds the export, and ganesha checks only that the
handle's filesystem is one the export uses — not that the inode lies under the export.
On ext4 a handle with generation 0 matches any inode, so a forged handle (inode 2) opened the
node's ``/`` and another team's volume (tests/unit/test_volume_server_confinement.py shows it).
Here every handle in a reply (MNT, LOOKUP, CREATE, MKDIR, SYMLINK, MKNOD, READDIRPLUS) gets an
HMAC-SHA256 tag (16 bytes) under the key of the volume it belongs to, and every handle in a
call must carry a good tag (else ``NFS3ERR_BADHANDLE``, never forwarded). Keys are per volume
and stable (``volume_key``): a resumed or forked guest's handles stay good with a new server.

Runs as its own small process (stdlib only, ``python3 -I nfs_guard.py``, no privilege) in the
slot: it listens where the guest connects and forwards to ganesha on the slot's loopback.
Keys arrive on stdin as JSON ``{"<mount path>": "<hex key>"}``. Only NFSv3 and MOUNTv3 pass."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import hmac
import json
import struct
import sys

NFS_PROGRAM, MOUNT_PROGRAM = 100003, 100005
TAG_LEN = 16
FH_MAX = 64  # NFS3_FHSIZE
NFS3ERR_BADHANDLE, MNT3ERR_NOENT = 10001, 2
PROG_UNAVAIL, PROG_MISMATCH, PROC_UNAVAIL, GARBAGE_ARGS = 1, 2, 3, 4
MAX_RECORD = 2 << 20  # a WRITE or READ of 1 MiB (ganesha's largest) and its header, with room
MAX_PENDING = 1024  # calls in flight on one connection: past that the guest waits for answers
STALL_SECONDS = 60.0  # ... at most this long; then the connection is closed (the client reconnects)
MAX_CONNECTIONS = 16  # per port: the guest's client needs one or two; each may buffer a record
# How many booleans an NFSv3 failure result carries after its status (RFC 1813 resfail):
# post_op_attr is one FALSE, wcc_data two.
_FAIL_BOOLS = {1: 0, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 2, 8: 2, 9: 2, 10: 2, 11: 2, 12: 2, 13: 2, 14: 4, 15: 3,
               16: 1, 17: 1, 18: 1, 19: 1, 20: 1, 21: 2}
_SIGNED_RESULTS = {3, 8, 9, 10, 11, 17}  # procedures whose results carry handles


def volume_key(secret: bytes, volume: str) -> bytes:
    """The handle key of one volume (``<team>/<volume>``), the same on every node."""
    return hmac.new(secret, b"aenv-nfs-handle\0" + volume.encode(), hashlib.sha256).digest()


def sign(key: bytes, handle: bytes) -> bytes:
    if len(handle) + TAG_LEN > FH_MAX:
        raise Garbage(f"a server handle of {len(handle)} bytes leaves no room for a tag")
    return handle + hmac.new(key, handle, hashlib.sha256).digest()[:TAG_LEN]


def unsign(keys: list[bytes], handle: bytes) -> tuple[bytes, bytes] | None:
    """(key, server handle) if some key tagged ``handle``, else None."""
    if len(handle) <= TAG_LEN:
        return None
    inner, tag = handle[:-TAG_LEN], handle[-TAG_LEN:]
    for key in keys:
        if hmac.compare_digest(hmac.new(key, inner, hashlib.sha256).digest()[:TAG_LEN], tag):
            return key, inner
    return None


class Garbage(Exception):
    """Bytes that are no well-formed RPC: the connection is closed."""


class Reader:
    def __init__(self, data: bytes, at: int = 0):
        self.data, self.at = data, at

    def uint(self) -> int:
        if self.at + 4 > len(self.data):
            raise Garbage("short record")
        (n,) = struct.unpack_from(">I", self.data, self.at)
        self.at += 4
        return n

    def skip(self, n: int) -> None:
        if self.at + n > len(self.data):
            raise Garbage("short record")
        self.at += n

    def opaque(self, limit: int) -> bytes:
        n = self.uint()
        if n > limit:
            raise Garbage(f"an opaque of {n} bytes")
        out = self.data[self.at:self.at + n]
        self.skip(n + (-n % 4))
        return out

    def post_op_attr(self) -> None:
        if self.uint():
            self.skip(84)  # fattr3


def _readdirplus_room(maxcount: int) -> int:
    """The reply size to ask ganesha for so that, tags added, it fits the guest's ``maxcount``:
    an entry with a handle of 8 bytes or more is at least 48 bytes and grows by 16, so 3/4 fits."""
    return max(maxcount * 3 // 4, 512)


def _opaque(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data + b"\0" * (-len(data) % 4)


def _accepted(xid: int, stat: int, body: bytes = b"") -> bytes:
    return struct.pack(">IIIII", xid, 1, 0, 0, 0) + struct.pack(">I", stat) + body


class Guard:
    """Rewrites one connection's calls and replies. ``exports``: mount path -> key."""

    def __init__(self, program: int, exports: dict[str, bytes]):
        self.program, self.exports, self.keys = program, exports, list(exports.values())
        self.pending: dict[int, tuple[int, bytes | None]] = {}  # xid -> (procedure, key of its handles)
        # a reply is forwarded only to a call in flight: one ganesha sent unasked is dropped

    def call(self, record: bytes) -> tuple[bytes | None, bytes | None]:
        """(record for the server, or None; reply for the guest, or None)."""
        r = Reader(record)
        xid, mtype, rpcvers, prog, vers, proc = (r.uint() for _ in range(6))
        if mtype != 0 or rpcvers != 2:
            raise Garbage("not an RPC call")
        r.uint()
        r.opaque(400)  # credentials
        r.uint()
        r.opaque(400)  # verifier
        if prog != self.program:
            return None, _accepted(xid, PROG_UNAVAIL)
        if vers != 3:
            return None, _accepted(xid, PROG_MISMATCH, struct.pack(">II", 3, 3))
        if proc == 0:  # NULL: a ping
            self._remember(xid, 0, None)
            return record, None
        if self.program == MOUNT_PROGRAM:
            return self._mount_call(record, r, xid, proc)
        if proc not in _FAIL_BOOLS:
            return None, _accepted(xid, PROC_UNAVAIL)
        head = record[:r.at]
        try:
            key, args = self._unsign_args(r, proc)
        except Garbage:
            return None, _accepted(xid, GARBAGE_ARGS)
        if key is None:
            return None, _accepted(xid, 0, struct.pack(">I", NFS3ERR_BADHANDLE) + b"\0\0\0\0" * _FAIL_BOOLS[proc])
        self._remember(xid, proc, key)
        return head + args, None

    def _remember(self, xid: int, proc: int, key: bytes | None) -> None:
        """A retransmission reuses its xid with the same call; another call under an xid in
        flight could get its reply's handles tagged with the wrong volume's key."""
        if self.pending.get(xid, (proc, key)) != (proc, key):
            raise Garbage(f"xid {xid:#x} reused for another call while in flight")
        if len(self.pending) > MAX_PENDING and xid not in self.pending:
            raise Garbage(f"more than {MAX_PENDING} calls in flight")  # the connection holds it back first
        self.pending[xid] = (proc, key)

    def _unsign_args(self, r: Reader, proc: int) -> tuple[bytes | None, bytes]:
        """The call's arguments with their handles unwrapped, and the key that tagged them
        (None if any handle has no good tag, or handles of two volumes are mixed)."""
        out, key = [], None
        # RENAME: from (fh, name), to (fh, name); LINK: fh, then (fh, name); the rest: fh first.
        layout = {14: ("fh", "name", "fh"), 15: ("fh", "fh")}.get(proc, ("fh",))
        for part in layout:
            at = r.at
            if part == "name":
                r.opaque(255)
                out.append(r.data[at:r.at])
                continue
            opened = unsign(self.keys, r.opaque(FH_MAX))
            if opened is None or (key is not None and opened[0] != key):
                return None, b""
            key = opened[0]
            out.append(_opaque(opened[1]))
        rest = r.data[r.at:]
        if proc == 17 and len(rest) >= 24:  # READDIRPLUS: cookie, verifier, dircount, maxcount
            rest = rest[:20] + struct.pack(">I", _readdirplus_room(struct.unpack_from(">I", rest, 20)[0])) + rest[24:]
        return key, b"".join(out) + rest

    def _mount_call(self, record: bytes, r: Reader, xid: int, proc: int) -> tuple[bytes | None, bytes | None]:
        if proc == 1:  # MNT: only this sandbox's mount paths
            try:
                path = r.opaque(1024).decode()
            except (Garbage, UnicodeDecodeError):
                return None, _accepted(xid, GARBAGE_ARGS)
            if path not in self.exports:
                return None, _accepted(xid, 0, struct.pack(">I", MNT3ERR_NOENT))
            self._remember(xid, 1, self.exports[path])
            return record, None
        if proc in (3, 4, 5):  # UMNT, UMNTALL, EXPORT carry no handle
            self._remember(xid, proc, None)
            return record, None
        return None, _accepted(xid, PROC_UNAVAIL)  # DUMP and anything else

    def reply(self, record: bytes) -> bytes | None:
        """The reply for the guest with its handles tagged; None drops a reply to no call."""
        r = Reader(record)
        xid, mtype = r.uint(), r.uint()
        if mtype != 1:
            raise Garbage("not an RPC reply")
        proc, key = self.pending.pop(xid, (None, None))
        if proc is None:
            return None
        if r.uint() != 0:
            return record  # denied: no results
        r.uint()
        r.opaque(400)  # verifier
        if r.uint() != 0:
            return record  # not executed: no results
        if key is None:
            return record  # NULL, UMNT, UMNTALL, EXPORT: nothing to tag
        if self.program == MOUNT_PROGRAM:
            status_at = r.at
            if r.uint() != 0:
                return record
            fh = r.opaque(FH_MAX)
            return record[:status_at] + struct.pack(">I", 0) + _opaque(sign(key, fh)) + record[r.at:]
        if proc not in _SIGNED_RESULTS:
            return record
        return self._sign_results(record, r, proc, key)

    def _sign_results(self, record: bytes, r: Reader, proc: int, key: bytes) -> bytes:
        out, copied = [], 0

        def handle() -> None:
            nonlocal copied
            at = r.at
            fh = r.opaque(FH_MAX)
            out.append(record[copied:at])
            out.append(_opaque(sign(key, fh)))
            copied = r.at

        if r.uint() != 0:
            return record  # a failure carries no handle
        if proc == 3:  # LOOKUP: object
            handle()
        elif proc in (8, 9, 10, 11):  # CREATE, MKDIR, SYMLINK, MKNOD: post_op_fh3
            if r.uint():
                handle()
        else:  # READDIRPLUS: dir attributes, verifier, entries with their handles
            r.post_op_attr()
            r.skip(8)
            while r.uint():
                r.skip(8)
                r.opaque(1024)
                r.skip(8)
                r.post_op_attr()
                if r.uint():
                    handle()
        out.append(record[copied:])
        return b"".join(out)


async def _read_record(reader: asyncio.StreamReader) -> bytes | None:
    """One RPC record (its fragments joined), or None at the end of the stream."""
    parts, size = [], 0
    while True:
        try:
            (mark,) = struct.unpack(">I", await reader.readexactly(4))
        except asyncio.IncompleteReadError as e:
            if e.partial or parts:
                raise Garbage("cut record") from None
            return None
        size += mark & 0x7FFFFFFF
        if size > MAX_RECORD:
            raise Garbage(f"a record of more than {MAX_RECORD} bytes")
        parts.append(await reader.readexactly(mark & 0x7FFFFFFF))
        if mark & 0x80000000:
            return b"".join(parts)


def _frame(record: bytes) -> bytes:
    return struct.pack(">I", 0x80000000 | len(record)) + record


async def _serve(program: int, upstream: tuple[str, int], exports: dict[str, bytes],
                 guest_r: asyncio.StreamReader, guest_w: asyncio.StreamWriter) -> None:
    guard = Guard(program, exports)
    try:
        server_r, server_w = await asyncio.open_connection(*upstream)
    except OSError:
        guest_w.close()
        return

    room = asyncio.Event()

    async def calls() -> None:
        while True:
            while len(guard.pending) >= MAX_PENDING:  # hold the guest back until ganesha answers
                room.clear()
                await asyncio.wait_for(room.wait(), STALL_SECONDS)  # none for that long: start over
            if (record := await _read_record(guest_r)) is None:
                return
            to_server, to_guest = guard.call(record)
            if to_server is not None:
                server_w.write(_frame(to_server))
                await server_w.drain()
            if to_guest is not None:
                guest_w.write(_frame(to_guest))
                await guest_w.drain()

    async def replies() -> None:
        while (record := await _read_record(server_r)) is not None:
            out = guard.reply(record)
            room.set()
            if out is not None:
                guest_w.write(_frame(out))
                await guest_w.drain()

    tasks = [asyncio.create_task(calls()), asyncio.create_task(replies())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for side, outcome in zip(("guest", "server"), await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(outcome, (Garbage, TimeoutError, asyncio.TimeoutError)):  # resets and EOFs are ordinary
                print(f"nfs_guard: closing a connection ({side}): {outcome or type(outcome).__name__}",
                      file=sys.stderr, flush=True)
        for w in (guest_w, server_w):
            w.close()


async def run(listen: str, ports: list[tuple[int, int, int]], upstream_host: str,
              exports: dict[str, bytes]) -> None:
    """``ports``: (program, port to listen on, ganesha's port)."""
    servers = []
    for program, port, up in ports:
        open_now = [0]

        async def handler(r, w, program=program, up=up, open_now=open_now):
            if open_now[0] >= MAX_CONNECTIONS:
                w.close()
                return
            open_now[0] += 1
            try:
                await _serve(program, (upstream_host, up), exports, r, w)
            finally:
                open_now[0] -= 1

        servers.append(await asyncio.start_server(handler, listen, port, reuse_address=True))
    print("listening", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def _not_dumpable() -> None:
    """Other processes of the same uid (other slots' guards) may not read this one's keys."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True)
    p.add_argument("--upstream", default="127.0.0.1")
    p.add_argument("--nfs", required=True, help="PORT:GANESHA_PORT")
    p.add_argument("--mount", required=True, help="PORT:GANESHA_PORT")
    args = p.parse_args(argv)
    _not_dumpable()
    exports = {path: bytes.fromhex(key) for path, key in json.load(sys.stdin).items()}
    sys.stdin.close()
    ports = [(prog, *map(int, spec.split(":"))) for prog, spec in ((NFS_PROGRAM, args.nfs),
                                                                    (MOUNT_PROGRAM, args.mount))]
    asyncio.run(run(args.listen, ports, args.upstream, exports))


if __name__ == "__main__":
    main()
