"""A minimal NFSv3 + MOUNTv3 client over TCP (RFC 1813, RFC 5531 framing), for tests that
play a hostile guest: it sends whatever file handle it is given, forged or not, and returns
the server's status instead of raising, so a test can assert the exact refusal.

    with Nfs3Client("169.254.0.22") as nfs:
        status, root = nfs.mnt("/3")
        status, fh = nfs.lookup(root, "etc")

Only what the tests need: MNT, GETATTR, LOOKUP, READ, WRITE, CREATE, MKDIR, REMOVE,
READDIRPLUS. AUTH_SYS with any uid/gid (a guest chooses them freely)."""
from __future__ import annotations

import itertools
import os
import socket
import struct
import threading

NFS_PROGRAM, NFS_V3 = 100003, 3
MOUNT_PROGRAM, MOUNT_V3 = 100005, 3
OK, PERM, NOENT, ACCES, STALE, BADHANDLE, SERVERFAULT = 0, 1, 2, 13, 70, 10001, 10006
_xids = itertools.count(os.getpid() << 12)


class RpcError(Exception):
    """The server refused the call itself (not an NFS status): denied, no such program, garbage."""


class Packer:
    def __init__(self):
        self.parts: list[bytes] = []

    def uint(self, n: int) -> Packer:
        self.parts.append(struct.pack(">I", n))
        return self

    def hyper(self, n: int) -> Packer:
        self.parts.append(struct.pack(">Q", n))
        return self

    def opaque(self, data: bytes) -> Packer:
        self.parts.append(struct.pack(">I", len(data)) + data + b"\0" * (-len(data) % 4))
        return self

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class Unpacker:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def uint(self) -> int:
        (n,) = struct.unpack_from(">I", self.data, self.at)
        self.at += 4
        return n

    def hyper(self) -> int:
        (n,) = struct.unpack_from(">Q", self.data, self.at)
        self.at += 8
        return n

    def opaque(self) -> bytes:
        n = self.uint()
        out = self.data[self.at:self.at + n]
        self.at += n + (-n % 4)
        return out

    def skip(self, n: int) -> None:
        self.at += n

    def fattr(self) -> dict | None:
        """post_op_attr: the attributes a test looks at, or None."""
        return self.fattr3() if self.uint() else None

    def fattr3(self) -> dict:
        ftype, mode, nlink, uid, gid = (self.uint() for _ in range(5))
        size = self.hyper()
        self.skip(8 + 8 + 8)  # used, rdev, fsid
        fileid = self.hyper()
        self.skip(24)  # atime, mtime, ctime
        return {"type": ftype, "mode": mode, "nlink": nlink, "uid": uid, "gid": gid, "size": size, "fileid": fileid}

    def wcc(self) -> None:
        if self.uint():
            self.skip(24)
        self.fattr()

    def post_op_fh(self) -> bytes | None:
        return self.opaque() if self.uint() else None


class Nfs3Client:
    def __init__(self, host: str, nfs_port: int = 2049, mount_port: int = 20048, *, uid: int = 1000,
                 gid: int = 1000, timeout: float = 10.0):
        self.host, self.ports, self.uid, self.gid, self.timeout = host, {NFS_PROGRAM: nfs_port,
                                                                          MOUNT_PROGRAM: mount_port}, uid, gid, timeout
        self.socks: dict[int, socket.socket] = {}

    def __enter__(self) -> Nfs3Client:
        return self

    def __exit__(self, *exc) -> None:
        for s in self.socks.values():
            s.close()

    def _sock(self, prog: int) -> socket.socket:
        if prog not in self.socks:
            self.socks[prog] = socket.create_connection((self.host, self.ports[prog]), timeout=self.timeout)
        return self.socks[prog]

    def _record(self, xid: int, prog: int, proc: int, args: bytes, vers: int | None) -> bytes:
        cred = Packer().uint(0).opaque(b"aenv-test").uint(self.uid).uint(self.gid).uint(0).bytes()
        msg = (Packer().uint(xid).uint(0).uint(2).uint(prog).uint(vers or 3).uint(proc)
               .uint(1).opaque(cred).uint(0).opaque(b"").bytes()) + args
        return struct.pack(">I", 0x80000000 | len(msg)) + msg

    def _reply(self, sock: socket.socket) -> bytes:
        reply = b""
        while True:
            (mark,) = struct.unpack(">I", self._read(sock, 4))
            reply += self._read(sock, mark & 0x7FFFFFFF)
            if mark & 0x80000000:
                return reply

    def call(self, prog: int, proc: int, args: bytes, *, vers: int | None = None) -> Unpacker:
        """One RPC; returns the results after ``accept_stat == SUCCESS``."""
        xid = next(_xids) & 0xFFFFFFFF
        sock = self._sock(prog)
        sock.sendall(self._record(xid, prog, proc, args, vers))
        return self._accepted(xid, self._reply(sock))

    def pipeline(self, prog: int, proc: int, args: bytes, count: int) -> list[Unpacker]:
        """``count`` calls sent before any reply is read (as a busy kernel client does);
        their results, in the order they come."""
        xids = [next(_xids) & 0xFFFFFFFF for _ in range(count)]
        sock = self._sock(prog)
        sender = threading.Thread(target=lambda: sock.sendall(b"".join(self._record(x, prog, proc, args, None)
                                                                        for x in xids)))
        sender.start()
        replies = [self._reply(sock) for _ in xids]
        sender.join()
        return [self._accepted(int.from_bytes(r[:4], "big"), r) for r in replies]

    @staticmethod
    def _accepted(xid: int, reply: bytes) -> Unpacker:
        u = Unpacker(reply)
        if u.uint() != xid or u.uint() != 1:
            raise RpcError("not the reply to this call")
        if u.uint() != 0:
            raise RpcError("call denied")
        u.uint()
        u.opaque()  # verifier
        accept = u.uint()
        if accept != 0:
            raise RpcError(f"call not accepted ({accept})")
        return u

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise RpcError("connection closed")
            out += chunk
        return out

    def mnt(self, path: str) -> tuple[int, bytes | None]:
        u = self.call(MOUNT_PROGRAM, 1, Packer().opaque(path.encode()).bytes())
        status = u.uint()
        return status, (u.opaque() if status == OK else None)

    def getattr(self, fh: bytes) -> tuple[int, dict | None]:
        u = self.call(NFS_PROGRAM, 1, Packer().opaque(fh).bytes())
        status = u.uint()
        return status, (u.fattr3() if status == OK else None)

    def lookup(self, dir_fh: bytes, name: str) -> tuple[int, bytes | None]:
        u = self.call(NFS_PROGRAM, 3, Packer().opaque(dir_fh).opaque(name.encode()).bytes())
        status = u.uint()
        return status, (u.opaque() if status == OK else None)

    def read(self, fh: bytes, offset: int = 0, count: int = 65536) -> tuple[int, bytes | None]:
        u = self.call(NFS_PROGRAM, 6, Packer().opaque(fh).hyper(offset).uint(count).bytes())
        status = u.uint()
        u.fattr()
        if status != OK:
            return status, None
        u.uint()  # count
        u.uint()  # eof
        return status, u.opaque()

    def write(self, fh: bytes, data: bytes, offset: int = 0) -> int:
        u = self.call(NFS_PROGRAM, 7, Packer().opaque(fh).hyper(offset).uint(len(data)).uint(2).opaque(data).bytes())
        return u.uint()

    def create(self, dir_fh: bytes, name: str, mode: int = 0o644) -> tuple[int, bytes | None]:
        # UNCHECKED, set mode only
        attrs = Packer().uint(1).uint(mode).uint(0).uint(0).uint(0).uint(0).uint(0).bytes()
        u = self.call(NFS_PROGRAM, 8, Packer().opaque(dir_fh).opaque(name.encode()).uint(0).bytes() + attrs)
        status = u.uint()
        return status, (u.post_op_fh() if status == OK else None)

    def mkdir(self, dir_fh: bytes, name: str, mode: int = 0o755) -> tuple[int, bytes | None]:
        attrs = Packer().uint(1).uint(mode).uint(0).uint(0).uint(0).uint(0).uint(0).bytes()
        u = self.call(NFS_PROGRAM, 9, Packer().opaque(dir_fh).opaque(name.encode()).bytes() + attrs)
        status = u.uint()
        return status, (u.post_op_fh() if status == OK else None)

    def remove(self, dir_fh: bytes, name: str) -> int:
        return self.call(NFS_PROGRAM, 12, Packer().opaque(dir_fh).opaque(name.encode()).bytes()).uint()

    def readdirplus(self, dir_fh: bytes, maxcount: int = 65536) -> tuple[int, dict[str, bytes | None]]:
        """The directory's entries, page after page until EOF: name -> handle; a reply larger
        than ``maxcount`` (what the client asked for) is an error here, as for a kernel."""
        entries: dict[str, bytes | None] = {}
        cookie, verifier = 0, 0
        while True:
            u = self.call(NFS_PROGRAM, 17, Packer().opaque(dir_fh).hyper(cookie).hyper(verifier).uint(maxcount // 2)
                          .uint(maxcount).bytes())
            start = u.at
            status = u.uint()
            u.fattr()
            if status != OK:
                return status, entries
            verifier = u.hyper()
            while u.uint():
                u.hyper()
                name = u.opaque().decode(errors="replace")
                cookie = u.hyper()
                u.fattr()
                entries[name] = u.post_op_fh()
            eof = u.uint()
            if u.at - start > maxcount:
                raise RpcError(f"a READDIRPLUS reply of {u.at - start} bytes for a maxcount of {maxcount}")
            if eof:
                return status, entries
