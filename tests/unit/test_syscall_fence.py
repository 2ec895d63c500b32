"""``vmm.net.syscall_fence``: a process under it (and what it execs) cannot make namespaces
(``unshare``, ``clone`` with a namespace flag, ``setns``), mount, trace, load BPF, or set up
io_uring; ``clone3`` says ENOSYS so threads fall back to ``clone``; threads, forks, files and
sockets work. Without the filter the same calls succeed, so the test can fail."""
import json
import platform
import subprocess
import sys

import pytest

from vmm.net import syscall_fence

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is for x86_64")

PROBE = r"""
import ctypes, json, os, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return 0 if r >= 0 else ctypes.get_errno()
out = {}
pid = libc.syscall(56, ctypes.c_long(0x10000000 | 17), 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
out["clone_newuser"] = 0 if pid > 0 else ctypes.get_errno()
if pid > 0:
    os.waitpid(pid, 0)
out["unshare_user"] = call(272, 0x10000000)  # unshare(CLONE_NEWUSER); after the clone: it changes our uid
out["clone3"] = call(435, 0, 0)
out["mount"] = call(165, 0, 0, 0, 0, 0)
out["bpf"] = call(321, 0, 0, 0)
out["io_uring_setup"] = call(425, 1, 0)
out["ptrace"] = call(101, 0x4206, os.getppid(), 0, 0)              # PTRACE_SEIZE the parent
t = threading.Thread(target=lambda: out.setdefault("thread", 0)); t.start(); t.join()
child = os.fork()
if child == 0:
    os._exit(7)
out["fork"] = os.waitpid(child, 0)[1] >> 8
socket.socket().close()
out["files"] = len(os.listdir("/"))> 0
print(json.dumps(out))
"""


def probe(*prefix):
    done = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_fence_refuses_namespaces_mounts_and_tracing_and_keeps_the_rest():
    fenced = probe(sys.executable, "-I", "-S", syscall_fence.__file__)
    assert fenced == {"unshare_user": 1, "clone_newuser": 1, "clone3": 38, "mount": 1, "bpf": 1, "io_uring_setup": 1,
                      "ptrace": 1, "thread": 0, "fork": 7, "files": True}, fenced


def test_without_the_fence_the_same_calls_get_past_the_filter():
    free = probe()
    assert free["unshare_user"] == 0 and free["clone_newuser"] == 0  # a user namespace: anyone may
    assert free["clone3"] != 38 and free["io_uring_setup"] != 1 and free["fork"] == 7


def test_no_ipv6_refuses_ipv6_sockets_only():
    probe_v6 = ("import socket\nfor family in (socket.AF_INET6, socket.AF_INET):\n    try:\n"
                "        socket.socket(family).close(); print('ok')\n"
                "    except OSError as e:\n        print(e.errno)\n")
    out = subprocess.run([sys.executable, "-I", "-S", syscall_fence.__file__, "--no-ipv6", sys.executable, "-c",
                          probe_v6], capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["97", "ok"]  # EAFNOSUPPORT: ganesha binds IPv4, where it is told
    plain = subprocess.run([sys.executable, "-I", "-S", syscall_fence.__file__, sys.executable, "-c", probe_v6],
                           capture_output=True, text=True, timeout=60).stdout.split()
    assert plain[1] == "ok" and plain[0] != "97"


def test_the_program_is_well_formed():
    for ipv6 in (True, False):
        code = syscall_fence.program(ipv6=ipv6)
        assert len(code) % 8 == 0 and len(code) // 8 == 7 + len(syscall_fence.DENIED) + 10
