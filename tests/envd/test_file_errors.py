"""The kernel's refusals of a file operation, as envd answers them (``envd.oserrors``): the caller's
to act on, never a 500. Found by tests/integration/test_fuzz_envd.py: an upload as root under
``/proc`` was a 500 (``EPERM`` from chmod, ``EINVAL`` from the write, unmapped).

Each case makes its refusal for real on the host (a ``/proc`` file of envd's own process, an
immutable file, a read-only and a full tmpfs, ``/dev/full``) and checks that a device or a
``/proc`` file keeps its owner and mode: an upload chowns only the regular files it writes.
"""
import errno
import json
import os
import subprocess
from contextlib import contextmanager

import httpx
import pytest

from envd import oserrors
from envd_client import protocol


@pytest.mark.parametrize(("code", "status", "connect"), [
    (errno.EPERM, 403, "permission_denied"), (errno.EACCES, 403, "permission_denied"),
    (errno.EROFS, 403, "permission_denied"), (errno.ENOSPC, 507, "failed_precondition"),
    (errno.EDQUOT, 507, "failed_precondition"), (errno.EFBIG, 413, "failed_precondition"),
    (errno.EINVAL, 400, "invalid_argument"), (errno.ENOTDIR, 400, "invalid_argument"),
    (errno.EISDIR, 400, "invalid_argument"), (errno.ENAMETOOLONG, 400, "invalid_argument"),
    (errno.ELOOP, 400, "invalid_argument"), (errno.E2BIG, 400, "invalid_argument"),
    (errno.ENXIO, 400, "invalid_argument"), (errno.ENOENT, 404, "not_found"),
    (errno.EEXIST, 409, "already_exists"), (errno.ENOTEMPTY, 409, "failed_precondition"),
    (errno.EBUSY, 409, "failed_precondition"),
])
def test_the_table(code, status, connect):
    exc = OSError(code, os.strerror(code), "/some/path")
    assert oserrors.classify(exc) == (status, connect)
    assert oserrors.http_status(exc) == status
    assert oserrors.message(exc) == f"{os.strerror(code)}: '/some/path'"


def test_envds_own_failures_stay_500():
    for code in (errno.EIO, errno.EMFILE, errno.ENOMEM):
        assert oserrors.classify(OSError(code, os.strerror(code))) is None
        assert oserrors.http_status(OSError(code, os.strerror(code))) == 500
    assert oserrors.classify(PermissionError("permission denied: cannot write '/x'")) == (403, "permission_denied")
    assert oserrors.classify(ValueError("x")) is None


def upload(envd, path, user="root", data=b"hostile"):
    return httpx.post(f"{envd.url}/files", params={"path": path, "username": user},
                      files={"file": ("x", data)}, timeout=30)


def refused(resp, status):
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"], body
    assert "[Errno" not in body["message"], body
    return body


def owner_and_mode(path):
    st = os.stat(path)
    return st.st_uid, st.st_gid, st.st_mode


@contextmanager
def tmpfs(where, options):
    os.mkdir(where)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "aenv-test", where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=True)
        os.rmdir(where)


def test_a_write_the_kernel_refuses_under_proc_is_400_and_changes_nothing(envd):
    """The finding: was a 500 (chmod of a /proc file is EPERM; the write of text to a number EINVAL)."""
    target = f"/proc/{envd.proc.pid}/oom_score_adj"  # envd's own: a wrong value changes nothing
    before = owner_and_mode(target), open(target).read()
    refused(upload(envd, target), 400)
    assert (owner_and_mode(target), open(target).read()) == before


def test_a_proc_file_without_a_write_is_403(envd):
    """/proc/version has no write: the kernel's EIO there means "not writable", not a failing disk
    (found on a real VM with /proc/kcore)."""
    before = owner_and_mode("/proc/version"), open("/proc/version").read()
    refused(upload(envd, "/proc/version"), 403)
    assert (owner_and_mode("/proc/version"), open("/proc/version").read()) == before


def test_a_read_only_setting_under_proc_is_403(envd):
    target = "/proc/sys/kernel/ostype"  # 0444 even for root: EACCES at open
    before = owner_and_mode(target)
    refused(upload(envd, target), 403)
    assert owner_and_mode(target) == before


def test_an_immutable_file_is_403(envd, workdir):
    target = os.path.join(workdir, "immutable")
    with open(target, "wb") as f:
        f.write(b"kept")
    subprocess.run(["chattr", "+i", target], check=True)
    try:
        refused(upload(envd, target), 403)  # EPERM at open, even for root
    finally:
        subprocess.run(["chattr", "-i", target], check=True)
    assert open(target, "rb").read() == b"kept"


def test_a_read_only_file_system_is_403(envd, workdir):
    with tmpfs(os.path.join(workdir, "ro"), "ro,size=1m") as ro:
        refused(upload(envd, os.path.join(ro, "new.txt")), 403)
        resp = httpx.post(f"{envd.url}/filesystem.Filesystem/MakeDir", json={"path": os.path.join(ro, "d")},
                          headers={"Authorization": protocol.basic_auth("root")}, timeout=30)
        assert resp.status_code == 403 and resp.json()["code"] == "permission_denied", resp.text


def test_a_full_file_system_is_507_and_keeps_no_partial_file(envd, workdir):
    with tmpfs(os.path.join(workdir, "small"), "size=64k") as small:
        target = os.path.join(small, "big.bin")
        body = refused(upload(envd, target, data=os.urandom(1 << 20)), 507)
        assert body["message"] == "not enough disk space"
        assert not os.path.exists(target)


def test_dev_full_is_507_and_stays(envd):
    before = owner_and_mode("/dev/full")
    refused(upload(envd, "/dev/full"), 507)
    assert owner_and_mode("/dev/full") == before  # neither unlinked nor chowned nor chmodded


def test_an_upload_to_dev_null_keeps_its_owner_and_mode(envd):
    before = owner_and_mode("/dev/null")
    resp = upload(envd, "/dev/null", user="user")
    assert resp.status_code == 200, resp.text
    assert owner_and_mode("/dev/null") == before


def test_a_fifo_is_400_without_a_wait(envd, workdir):
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    refused(upload(envd, fifo), 400)  # nobody reads it
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    try:
        refused(upload(envd, fifo), 400)
    finally:
        os.close(fd)
    assert os.path.exists(fifo)


def test_paths_that_cannot_be_files_are_400(envd, workdir):
    plain = os.path.join(workdir, "plain")
    with open(plain, "wb") as f:
        f.write(b"x")
    os.symlink(os.path.join(workdir, "loop-b"), os.path.join(workdir, "loop-a"))
    os.symlink(os.path.join(workdir, "loop-a"), os.path.join(workdir, "loop-b"))
    for target in (os.path.join(plain, "under-a-file"),           # ENOTDIR
                   workdir,                                         # EISDIR
                   os.path.join(workdir, "n" * 300),                # ENAMETOOLONG (a name past NAME_MAX)
                   os.path.join(workdir, "loop-a")):                # ELOOP
        refused(upload(envd, target), 400)


def test_rpc_errors_use_the_same_table(envd, workdir):
    """A Connect call that the kernel refuses: its code by the table, its HTTP status by the code."""
    plain = os.path.join(workdir, "plain")
    with open(plain, "wb") as f:
        f.write(b"x")
    resp = httpx.post(f"{envd.url}/filesystem.Filesystem/MakeDir", json={"path": os.path.join(plain, "d")},
                      headers={"Authorization": protocol.basic_auth("root")}, timeout=30)
    assert resp.status_code == 400 and json.loads(resp.text)["code"] == "invalid_argument", resp.text
