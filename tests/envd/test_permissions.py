"""envd runs as root but acts with the requesting user's Unix permissions."""
import pytest
from e2b.exceptions import SandboxException


def test_user_cannot_read_shadow_via_traversal(sandbox):
    with pytest.raises(SandboxException) as exc:
        sandbox.files.read("../../etc/shadow")
    assert "403" in str(exc.value) or "permission" in str(exc.value).lower()
    assert sandbox.files.read("../../etc/shadow", user="root")


def test_user_cannot_write_or_list_root_only_places(sandbox):
    with pytest.raises(SandboxException):
        sandbox.files.write("/etc/aenv-should-not-exist", "x")
    with pytest.raises(SandboxException):
        sandbox.files.list("/root")
    with pytest.raises(SandboxException):
        sandbox.files.make_dir("/usr/aenv-nope")
    with pytest.raises(SandboxException):
        sandbox.files.remove("/etc/hostname")
    assert sandbox.files.list("/root", user="root") is not None


def test_user_works_in_home_and_tmp(sandbox):
    sandbox.files.write("/tmp/perm-ok/a.txt", "ok")
    assert sandbox.files.read("/tmp/perm-ok/a.txt") == "ok"
    sandbox.files.rename("/tmp/perm-ok/a.txt", "/home/user/perm-b.txt")
    assert sandbox.files.read("perm-b.txt") == "ok"
    sandbox.files.remove("perm-b.txt")
