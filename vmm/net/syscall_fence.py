"""Runs a command under a seccomp filter that refuses the system calls a file server never
needs: new namespaces (the one kernel surface an unprivileged process can still grow),
mounts, tracing other processes, BPF, perf, io_uring, userfaultfd, keyrings, modules, kexec,
clocks, reboot; with ``--no-ipv6``, IPv6 sockets. ``python3 -I syscall_fence.py [--no-ipv6]
ganesha.nfsd ...``: installs it, then execs.

Why: the volume server (nfs-ganesha) faces hostile guests; if a flaw ever ran code in it, that
code should find as little of the kernel as it can reach. Refused calls fail with EPERM
(``clone3`` with ENOSYS, so threads fall back to ``clone``, whose flags are checked).
Needs ``no_new_privs`` (the launcher's setpriv sets it). On an architecture other than x86_64
it runs the command unfiltered and says so on stderr."""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
CLONE_NAMESPACES = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE, CLONE3, SOCKET = 56, 435, 41
AF_INET6 = 10
# x86_64 numbers of what is refused outright.
DENIED = {
    "unshare": 272, "setns": 308,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103, "vhangup": 153,
    "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "uselib": 134, "personality": 135,
}

_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program(*, ipv6: bool = True) -> bytes:
    """The filter, as the kernel's sock_filter array; ``ipv6=False`` also makes
    ``socket(AF_INET6, ...)`` fail with EAFNOSUPPORT (ganesha then binds IPv4 only, where it
    is told: an IPv6 socket of its listens on every address)."""
    denied = sorted(DENIED.values())
    # Layout: arch check, load nr, x32 check, clone, clone3, socket, one JEQ per denied call,
    # ALLOW, then the clone flags check, the socket family check, ENOSYS, EAFNOSUPPORT, EPERM.
    n = len(denied)
    allow_at = 7 + n
    clone_at = allow_at + 1
    socket_at = clone_at + 3
    enosys_at, eafnosupport_at, eperm_at = socket_at + 3, socket_at + 4, socket_at + 5
    ops = [
        _op(_LD_ABS, 4),
        _op(_JEQ, AUDIT_ARCH_X86_64, 0, eperm_at - 2),
        _op(_LD_ABS, 0),
        _op(_JGE, X32_BIT, eperm_at - 4, 0),
        _op(_JEQ, CLONE, clone_at - 5, 0),
        _op(_JEQ, CLONE3, enosys_at - 6, 0),
        _op(_JEQ, SOCKET, socket_at - 7, 0) if not ipv6 else _op(_JEQ, 0xFFFFFFFF, 0, 0),
    ]
    for i, nr in enumerate(denied):
        ops.append(_op(_JEQ, nr, eperm_at - (8 + i), 0))
    ops += [
        _op(_RET, RET_ALLOW),
        _op(_LD_ABS, 16),  # clone's flags (args[0], low half)
        _op(_JSET, CLONE_NAMESPACES, eperm_at - (clone_at + 2), 0),
        _op(_RET, RET_ALLOW),
        _op(_LD_ABS, 16),  # socket's family
        _op(_JEQ, AF_INET6, eafnosupport_at - (socket_at + 2), 0),
        _op(_RET, RET_ALLOW),
        _op(_RET, RET_ERRNO | ENOSYS),
        _op(_RET, RET_ERRNO | EAFNOSUPPORT),
        _op(_RET, RET_ERRNO | EPERM),
    ]
    assert len(ops) == eperm_at + 1
    return b"".join(ops)


def install(*, ipv6: bool = True) -> bool:
    """Installs the filter on this process (and what it execs); False where it has none."""
    if platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    code = program(ipv6=ipv6)
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    return True


def main() -> None:
    argv = sys.argv[1:]
    ipv6 = argv[:1] != ["--no-ipv6"]
    argv = argv if ipv6 else argv[1:]
    if not argv:
        sys.exit("usage: syscall_fence.py [--no-ipv6] COMMAND [ARG...]")
    if not install(ipv6=ipv6):
        print(f"syscall_fence: no filter for {platform.machine()}: running unfiltered", file=sys.stderr, flush=True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
