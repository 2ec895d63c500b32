"""What this host's kernel allows of userfaultfd write-protection, per guest RAM backend.

Why: QEMU's ``background-snapshot`` (a memory capture with the vCPUs stopped only for the
device state) write-protects the guest's RAM with userfaultfd and copies each page before the
guest's first write to it. Whether that works depends on the kernel (uffd-wp on anonymous
memory since 5.7, on shmem / tmpfs since 5.19, unpopulated pages since 6.4) and on who may
open a userfaultfd (root, or ``vm.unprivileged_userfaultfd``). This module asks the kernel
directly, with a real write fault caught per backend, so the capture code and
``bench/capture_window.py --probe`` report what works here rather than what a version number
promises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import select
import struct
import tempfile
import threading
from pathlib import Path

SYS_USERFAULTFD = 323  # x86_64
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
UFFDIO_UNREGISTER = 0x8010AA01  # _IOR(0xAA, 0x01, struct uffdio_range)
UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
UFFDIO_REGISTER_MODE_WP = 2
UFFDIO_WRITEPROTECT_MODE_WP = 1
UFFD_EVENT_PAGEFAULT = 0x12
UFFD_PAGEFAULT_FLAG_WP = 2
_UFFDIO_WRITEPROTECT_BIT = 6
O_CLOEXEC_NONBLOCK = os.O_CLOEXEC | os.O_NONBLOCK

FEATURES = {  # linux/userfaultfd.h
    "PAGEFAULT_FLAG_WP": 1 << 0, "EVENT_FORK": 1 << 1, "EVENT_REMAP": 1 << 2, "EVENT_REMOVE": 1 << 3,
    "MISSING_HUGETLBFS": 1 << 4, "MISSING_SHMEM": 1 << 5, "EVENT_UNMAP": 1 << 6, "SIGBUS": 1 << 7,
    "THREAD_ID": 1 << 8, "MINOR_HUGETLBFS": 1 << 9, "MINOR_SHMEM": 1 << 10, "EXACT_ADDRESS": 1 << 11,
    "WP_HUGETLBFS_SHMEM": 1 << 12, "WP_UNPOPULATED": 1 << 13, "POISON": 1 << 14, "WP_ASYNC": 1 << 15,
    "MOVE": 1 << 16,
}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_libc.memset.restype = ctypes.c_void_p


def _open_uffd() -> int:
    fd = _libc.syscall(SYS_USERFAULTFD, O_CLOEXEC_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"userfaultfd: {os.strerror(err)}")
    return fd


def _ioctl(fd: int, request: int, buf: bytearray) -> None:
    import fcntl

    fcntl.ioctl(fd, request, buf, True)


def kernel_features() -> dict:
    """{"available": bool, "error": str, "features": [names], "unprivileged": sysctl value}."""
    out = {"available": False, "error": "", "features": [], "unprivileged": _sysctl("vm/unprivileged_userfaultfd"),
           "dev_userfaultfd": os.path.exists("/dev/userfaultfd")}
    try:
        fd = _open_uffd()
    except OSError as e:
        out["error"] = str(e)
        return out
    try:
        buf = bytearray(struct.pack("QQQ", UFFD_API, 0, 0))
        _ioctl(fd, UFFDIO_API, buf)
        _, features, _ = struct.unpack("QQQ", buf)
        out["available"] = True
        out["features"] = [name for name, bit in FEATURES.items() if features & bit]
    except OSError as e:
        out["error"] = f"UFFDIO_API: {e}"
    finally:
        os.close(fd)
    return out


def _sysctl(name: str) -> str:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return ""


def _backend_mapping(kind: str, size: int, tmp_dir: Path):
    """(mmap, cleanup) for one guest RAM backend: anonymous private, memfd shared, or a file in
    tmp_dir shared (aenv's memory-backend-file on /dev/shm)."""
    if kind == "anonymous":
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), lambda: None
    if kind == "memfd":
        fd = os.memfd_create("aenv-uffd-probe", os.MFD_CLOEXEC)
    elif kind == "tmpfs-file":
        fd, name = tempfile.mkstemp(prefix="aenv-uffd-probe-", dir=tmp_dir)
        os.unlink(name)
    else:
        raise ValueError(kind)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return m, lambda: None


def probe_backend(kind: str, tmp_dir: Path = Path("/dev/shm"), populate: bool = True) -> dict:
    """Registers a 16-page mapping of ``kind`` for write-protect faults, protects it and writes
    one byte from another thread: works only if that write stops, arrives as a WP fault at the
    right address and goes through once unprotected. ``populate=False`` leaves the pages
    unpopulated (needs WP_UNPOPULATED to be caught, else the write silently passes)."""
    pages, page = 16, mmap.PAGESIZE
    result = {"backend": kind, "populated": populate, "register": False, "writeprotect_ioctl": False,
              "fault_caught": False, "error": ""}
    try:
        m, cleanup = _backend_mapping(kind, pages * page, tmp_dir)
    except OSError as e:
        result["error"] = f"mapping: {e}"
        return result
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    fd = -1
    writer = None
    try:
        if populate:
            for i in range(pages):
                m[i * page] = 0  # a write: the page exists in this process
        fd = _open_uffd()
        api = bytearray(struct.pack("QQQ", UFFD_API, FEATURES["PAGEFAULT_FLAG_WP"]
                                    | (0 if populate else _feature_if_any("WP_UNPOPULATED")), 0))
        _ioctl(fd, UFFDIO_API, api)
        reg = bytearray(struct.pack("QQQQ", addr, pages * page, UFFDIO_REGISTER_MODE_WP, 0))
        _ioctl(fd, UFFDIO_REGISTER, reg)
        result["register"] = True
        ioctls = struct.unpack("QQQQ", reg)[3]
        result["writeprotect_ioctl"] = bool(ioctls & (1 << _UFFDIO_WRITEPROTECT_BIT))
        if not result["writeprotect_ioctl"]:
            return result
        _ioctl(fd, UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", addr, pages * page,
                                                              UFFDIO_WRITEPROTECT_MODE_WP)))
        target = addr + 5 * page + 7
        done = threading.Event()

        def write() -> None:
            _libc.memset(target, 0x5A, 1)  # ctypes drops the GIL: this thread may block here
            done.set()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        ready, _, _ = select.select([fd], [], [], 2.0)
        if not ready:
            result["error"] = "the write to a protected page was not caught" + (
                "" if done.is_set() else " and did not finish")
            return result
        msg = os.read(fd, 32)
        event, flags, fault_addr = msg[0], *struct.unpack_from("QQ", msg, 8)
        result["fault_caught"] = (event == UFFD_EVENT_PAGEFAULT and bool(flags & UFFD_PAGEFAULT_FLAG_WP)
                                  and fault_addr // page == target // page)
        # unprotect: the kernel wakes the blocked writer
        _ioctl(fd, UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", target // page * page, page, 0)))
        if not done.wait(2.0):
            result["fault_caught"] = False
            result["error"] = "the writer stayed blocked after the page was unprotected"
        elif m[5 * page + 7] != 0x5A:
            result["fault_caught"] = False
            result["error"] = "the write was lost"
    except OSError as e:
        result["error"] = str(e)
    finally:
        if fd >= 0:
            os.close(fd)  # closing the uffd drops the protection and wakes any blocked writer
        if writer is not None:
            writer.join(2.0)
        if writer is None or not writer.is_alive():
            m.close()
            cleanup()
    return result


def _feature_if_any(name: str) -> int:
    return FEATURES[name] if name in kernel_features()["features"] else 0


def probe_all(tmp_dir: Path = Path("/dev/shm")) -> dict:
    """The kernel's userfaultfd features and a write-protect fault per backend (populated pages,
    and unpopulated ones where the kernel has WP_UNPOPULATED)."""
    kernel = kernel_features()
    backends = []
    if kernel["available"]:
        for kind in ("anonymous", "memfd", "tmpfs-file"):
            backends.append(probe_backend(kind, tmp_dir))
            if "WP_UNPOPULATED" in kernel["features"]:
                backends.append(probe_backend(kind, tmp_dir, populate=False))
    return {"kernel": os.uname().release, "userfaultfd": kernel, "backends": backends}


_tmpfs_wp: dict[str, bool] = {}


def tmpfs_write_protect(shm_dir: Path = Path("/dev/shm")) -> bool:
    """A write to a write-protected page of a shared file in ``shm_dir`` (a guest RAM file) is
    caught here: probed once per directory and process."""
    key = str(shm_dir)
    if key not in _tmpfs_wp:
        try:
            _tmpfs_wp[key] = probe_backend("tmpfs-file", Path(shm_dir))["fault_caught"]
        except Exception:  # noqa: BLE001 - any failure means: not available
            _tmpfs_wp[key] = False
    return _tmpfs_wp[key]
