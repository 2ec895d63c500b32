"""Thin ctypes binding to Linux inotify (no third-party dependency)."""

import ctypes
import ctypes.util
import errno
import os
import struct

IN_ACCESS = 0x00000001
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return _libc


def _check(result):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


class Inotify:
    """One non-blocking inotify instance; ``read()`` returns parsed events."""

    def __init__(self):
        self.fd = _check(_lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC))

    def add_watch(self, path, mask):
        return _check(_lib().inotify_add_watch(self.fd, os.fsencode(path), mask))

    def rm_watch(self, wd):
        try:
            _check(_lib().inotify_rm_watch(self.fd, wd))
        except OSError:
            pass  # already gone (deleted directory)

    def read(self):
        """Return all queued ``(wd, mask, cookie, name)`` events without blocking."""
        events = []
        while True:
            try:
                buf = os.read(self.fd, 64 * 1024)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return events
                raise
            if not buf:
                return events
            events.extend(parse_events(buf))

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def parse_events(buf):
    """Decode a buffer of ``struct inotify_event`` records."""
    out = []
    offset = 0
    while offset + _EVENT_HEADER.size <= len(buf):
        wd, mask, cookie, length = _EVENT_HEADER.unpack_from(buf, offset)
        offset += _EVENT_HEADER.size
        raw = buf[offset:offset + length]
        offset += length
        out.append((wd, mask, cookie, os.fsdecode(raw.rstrip(b"\0"))))
    return out
