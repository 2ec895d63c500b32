"""A volume's files as the content API sees them: stat, list, mkdir, read, write, remove,
chmod/chown, all confined to the volume's directory.

Why so careful: sandboxes write into the same directory through their mounts, so a guest
can plant symlinks (``/data/x -> /etc``) or swap a directory for one while a request runs.
Every path is therefore walked one component at a time from the volume's root with
``O_NOFOLLOW`` on each ``openat`` (Linux's ``RESOLVE_NO_SYMLINKS`` done by hand): no
symlink is ever followed, and ``..`` is refused before anything is opened. A symlink in a
volume is listed and stat'ed as a symlink (with its target) and never read or written
through. No Django here: the API serves it, a node or a test can use it alike.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import AsyncIterator, Iterable, Iterator

from asgiref.sync import sync_to_async

MAX_PATH = 4096
MAX_NAME = 255
CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_PREFIX = ".aenv-upload-"


class ContentError(Exception):
    """A request the volume cannot do; ``status`` is the HTTP answer."""

    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Invalid(ContentError):
    status = 400


class Forbidden(ContentError):
    status = 403


class NotFound(ContentError):
    status = 404


class Conflict(ContentError):
    status = 409


class TooLarge(ContentError):
    status = 413


class NoSpace(ContentError):
    status = 507


class VolumeFull(ContentError):
    """The volume's own limit (not the node's disk): the client can free room or write less."""

    status = 413


@dataclass(frozen=True)
class Owner:
    """Who new entries belong to when the request names nobody (None: the server's user)."""

    uid: int | None = None
    gid: int | None = None


def split(path: object) -> list[str]:
    """The components of a volume path (``/`` or ``""`` is the root, ``[]``)."""
    if not isinstance(path, str):
        raise Invalid("path must be a string")
    if len(path) > MAX_PATH or "\x00" in path:
        raise Invalid(f"path must be at most {MAX_PATH} characters, without NUL")
    parts = [p for p in path.split("/") if p]
    for part in parts:
        if part in (".", ".."):
            raise Invalid("path must not contain '.' or '..' components")
        if len(part.encode()) > MAX_NAME:
            raise Invalid(f"a path component is longer than {MAX_NAME} bytes")
    return parts


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _os_error(exc: OSError, path: str) -> ContentError:
    if exc.errno == errno.ENOENT:
        return NotFound(f"path {path} not found")
    if exc.errno == errno.ELOOP:
        return Invalid(f"path {path} goes through a symlink; the content API never follows one")
    if exc.errno == errno.ENOTDIR:
        return Invalid(f"a component of {path} is not a directory")
    if exc.errno == errno.EISDIR:
        return Invalid(f"path {path} is a directory")
    if exc.errno == errno.EEXIST:
        return Conflict(f"path {path} already exists")
    if exc.errno == errno.ENOTEMPTY:
        return Conflict(f"directory {path} is not empty")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace("the volume store is full")
    if exc.errno in (errno.EPERM, errno.EACCES):
        return Forbidden(f"not permitted on {path}: {exc.strerror}")
    if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):
        return Invalid(f"path {path} is not a regular file or directory")
    raise exc


class VolumeFiles:
    """The files of one volume, rooted at ``root`` (a directory the server made)."""

    def __init__(self, root: Path, owner: Owner = Owner(), limit_mb: int = 0):
        self.root = Path(root)
        self.owner = owner
        self.limit_mb = limit_mb  # a filesystem of that size of its own (volumes.image); 0: none

    def _full(self, exc: ContentError) -> ContentError:
        """On a volume with a limit, no space is the volume's, and the client's to fix (4xx)."""
        if self.limit_mb and isinstance(exc, NoSpace):
            return VolumeFull(f"the volume is full: its limit is {self.limit_mb} MiB (AENV_VOLUME_MAX_MB when it "
                              f"was made), {self.free_bytes()} bytes are free")
        return exc

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ------------------------------------------------------------------ walking

    def _root_fd(self) -> int:
        try:
            return os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            raise NotFound("the volume has no files (it is being deleted)") from None

    def _walk(self, parts: list[str], *, create: bool = False, mode: int = 0o755,
              uid: int | None = None, gid: int | None = None) -> int:
        """An fd of the directory ``parts`` names, never through a symlink; ``create``
        makes missing directories (owned like new entries)."""
        fd = self._root_fd()
        shown = ""
        try:
            for part in parts:
                shown += "/" + part
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, mode, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile: open it (still without following anything)
                    else:
                        self._own(part, fd, uid, gid, mode, follow=False)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except OSError as exc:
            os.close(fd)
            raise _os_error(exc, shown or "/") from None

    def _own(self, name: str, dir_fd: int, uid: int | None, gid: int | None, mode: int | None,
             *, follow: bool) -> None:
        uid = self.owner.uid if uid is None else uid
        gid = self.owner.gid if gid is None else gid
        if uid is not None or gid is not None:
            os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid, dir_fd=dir_fd,
                     follow_symlinks=follow)
        if mode is not None:  # chmod has no no-follow form on Linux: callers pass real entries only
            os.chmod(name, mode, dir_fd=dir_fd)

    def _entry(self, parts: list[str], st: os.stat_result, dir_fd: int | None = None) -> dict:
        path = "/" + "/".join(parts)
        entry = {
            "name": parts[-1] if parts else "", "type": _kind(st.st_mode), "path": path, "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
            "atime": _iso(st.st_atime), "mtime": _iso(st.st_mtime), "ctime": _iso(st.st_ctime),
        }
        if stat.S_ISLNK(st.st_mode) and dir_fd is not None:
            entry["target"] = os.readlink(parts[-1], dir_fd=dir_fd)
        return entry

    def _lstat(self, parts: list[str]) -> tuple[dict, os.stat_result]:
        if not parts:
            fd = self._root_fd()
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            return self._entry(parts, st), st
        pfd = self._walk(parts[:-1])
        try:
            st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
            return self._entry(parts, st, pfd), st
        except OSError as exc:
            raise _os_error(exc, "/" + "/".join(parts)) from None
        finally:
            os.close(pfd)

    # ------------------------------------------------------------------ verbs

    def stat(self, path: str) -> dict:
        return self._lstat(split(path))[0]

    def list(self, path: str, depth: int = 1, max_entries: int = 10_000) -> list[dict]:
        """The entries under a directory, ``depth`` levels down (symlinked directories are
        listed, never entered); more than ``max_entries`` is a 400, not a huge answer."""
        parts = split(path)
        out: list[dict] = []
        fd = self._walk(parts)
        try:
            self._list_into(fd, parts, depth, out, max_entries)
        finally:
            os.close(fd)
        return out

    def _list_into(self, fd: int, parts: list[str], depth: int, out: list[dict], limit: int) -> None:
        with os.scandir(fd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            if name.startswith(_TMP_PREFIX):
                continue  # an upload in progress
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            if len(out) >= limit:
                raise Invalid(f"more than {limit} entries; list a smaller depth or a subdirectory")
            out.append(self._entry(parts + [name], st, fd))
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # replaced by a symlink or removed meanwhile: not entered
                try:
                    self._list_into(sub, parts + [name], depth - 1, out, limit)
                finally:
                    os.close(sub)

    def mkdir(self, path: str, *, parents: bool = False, uid: int | None = None, gid: int | None = None,
              mode: int | None = None) -> dict:
        parts = split(path)
        if not parts:
            raise Conflict("the volume root already exists")
        try:
            pfd = self._walk(parts[:-1], create=parents, uid=uid, gid=gid)
        except NoSpace as exc:
            raise self._full(exc) from None
        try:
            try:
                os.mkdir(parts[-1], 0o755 if mode is None else mode, dir_fd=pfd)
            except FileExistsError:
                st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
                if not (parents and stat.S_ISDIR(st.st_mode)):
                    raise
            else:
                self._own(parts[-1], pfd, uid, gid, mode, follow=False)
        except OSError as exc:
            raise self._full(_os_error(exc, path)) from None
        finally:
            os.close(pfd)
        return self.stat(path)

    def open_file(self, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, opened without following a symlink."""
        parts = split(path)
        if not parts:
            raise Invalid("path / is a directory")
        pfd = self._walk(parts[:-1])
        try:
            # Looked at before it is opened: a device node or a FIFO a guest made is never opened.
            before = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISLNK(before.st_mode):
                raise Invalid(f"path {path} is a symlink; the content API never follows one")
            if not stat.S_ISREG(before.st_mode):
                raise Invalid(f"path {path} is not a regular file")
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            raise _os_error(exc, path) from None
        finally:
            os.close(pfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise Invalid(f"path {path} changed while it was opened")
        return fd, st.st_size

    @staticmethod
    def chunks(fd: int) -> Iterator[bytes]:
        """The file's bytes; closes ``fd`` when done or abandoned."""
        try:
            while True:
                data = os.read(fd, CHUNK)
                if not data:
                    return
                yield data
        finally:
            os.close(fd)

    @staticmethod
    async def async_chunks(fd: int) -> AsyncIterator[bytes]:
        """``chunks`` for an async response (the API's and the dashboard's downloads): each
        chunk read in a worker thread, since a sync iterator would be read whole into memory
        first; ``fd`` is closed at the end."""
        chunks = VolumeFiles.chunks(fd)
        read = sync_to_async(next, thread_sensitive=False)
        try:
            while (chunk := await read(chunks, None)) is not None:
                yield chunk
        finally:
            chunks.close()

    def write(self, path: str, body: Iterable[bytes], *, max_bytes: int, uid: int | None = None,
              gid: int | None = None, mode: int | None = None) -> dict:
        """Writes a file whole (created, or replaced atomically: readers see the old bytes or
        the new, never half), making missing parent directories. More than ``max_bytes``
        is a 413 and leaves the old file as it was."""
        parts = split(path)
        if not parts:
            raise Invalid("path / is a directory")
        try:
            pfd = self._walk(parts[:-1], create=True, uid=uid, gid=gid)
        except NoSpace as exc:
            raise self._full(exc) from None
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        # a volume with a limit refuses a body that cannot fit as soon as it is known not to
        # (the file it replaces stays until the rename: it does not count as room)
        room = self.free_bytes() if self.limit_mb else None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644 if mode is None else mode, dir_fd=pfd)
            try:
                written = 0
                for data in body:
                    written += len(data)
                    if written > max_bytes:
                        raise TooLarge(f"the file is larger than the limit of {max_bytes} bytes")
                    if room is not None and written > room:
                        raise VolumeFull(f"the file does not fit in the volume: its limit is {self.limit_mb} MiB "
                                         f"(AENV_VOLUME_MAX_MB when it was made), {room} bytes were free")
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._own(tmp, pfd, uid, gid, mode, follow=False)
            try:
                if stat.S_ISDIR(os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False).st_mode):
                    raise Invalid(f"path {path} is a directory")
            except FileNotFoundError:
                pass
            os.rename(tmp, parts[-1], src_dir_fd=pfd, dst_dir_fd=pfd)  # replaces a symlink, never follows it
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=pfd)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise self._full(_os_error(exc, path)) from None
            raise
        finally:
            os.close(pfd)
        return self.stat(path)

    def remove(self, path: str) -> None:
        """Removes a file, a symlink (not its target) or a directory tree."""
        parts = split(path)
        if not parts:
            raise Invalid("the volume root cannot be removed (delete the volume instead)")
        pfd = self._walk(parts[:-1])
        try:
            st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=pfd)  # the fd-based walk: never follows symlinks
            else:
                os.unlink(parts[-1], dir_fd=pfd)
        except OSError as exc:
            raise _os_error(exc, path) from None
        finally:
            os.close(pfd)

    def set_meta(self, path: str, *, uid: int | None = None, gid: int | None = None,
                 mode: int | None = None) -> dict:
        """chown / chmod of an entry (a symlink itself is refused: chmod would follow it)."""
        parts = split(path)
        pfd = self._walk(parts[:-1]) if parts else None
        try:
            if parts:
                st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise Invalid(f"path {path} is a symlink")
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
            else:
                fd = self._root_fd()
            try:
                if uid is not None or gid is not None:
                    os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                if mode is not None:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_error(exc, path) from None
        finally:
            if pfd is not None:
                os.close(pfd)
        return self.stat(path)


def make_root(root: Path, owner: Owner = Owner()) -> None:
    """Creates a new volume's (empty) directory, owned like its future entries."""
    root.mkdir(parents=True, exist_ok=False, mode=0o755)
    if owner.uid is not None or owner.gid is not None:
        os.chown(root, -1 if owner.uid is None else owner.uid, -1 if owner.gid is None else owner.gid)


def remove_root(root: Path) -> None:
    """Deletes a volume's directory and everything in it (fd-based: symlinks not followed)."""
    try:
        shutil.rmtree(root)
    except FileNotFoundError:
        pass
