"""template_builds.system.host_venv for real: a command as root in the base image's own
root file system stage (read-only, never changed), with only its output directory and a
tmpfs /tmp writable, the wheels read-only, no network. Needs root and the base image
(scripts/setup.sh); the venv itself is built by tests/integration/test_code_interpreter_e2e.py."""
import os
import socket
from pathlib import Path

import pytest
from django.conf import settings

from template_builds.system import host_venv

GUEST_DIR = "/opt/code-interpreter"


@pytest.fixture(scope="module")
def rootfs():
    reason = host_venv.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        return host_venv.guest_rootfs(Path(settings.AENV_IMAGES_DIR))[1]
    except LookupError as exc:
        pytest.skip(str(exc))


def test_a_command_runs_in_the_guest_root_which_stays_unchanged(rootfs, tmp_path):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    out.mkdir()
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("numpy\n")
    listener = socket.create_server(("127.0.0.1", 0))  # the host's loopback: not reachable from inside
    port = listener.getsockname()[1]
    before = sorted(os.listdir(rootfs / "opt")), os.stat(rootfs).st_mtime_ns, os.stat(rootfs / "tmp").st_mtime_ns
    command = (
        f"python3 -c 'import sys; print(sys.version_info[:2])' > {GUEST_DIR}/version"
        f" && cat /etc/debian_version > {GUEST_DIR}/debian"
        f" && cat {host_venv.WHEELS_IN_ROOT}/requirements.txt > {GUEST_DIR}/seen"
        f" && echo tmp > /tmp/scratch && echo ok > /dev/null"
        f" && ! touch /usr/aenv-test 2>/dev/null && ! touch /aenv-test 2>/dev/null"
        f" && ! touch {host_venv.WHEELS_IN_ROOT}/x 2>/dev/null"
        f" && ! python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)' 2>/dev/null"
        f" && echo done")
    with listener:
        assert host_venv.run(rootfs, out, GUEST_DIR, wheels, command, timeout=60).strip() == "done"
    assert (out / "version").read_text().strip() == "(3, 11)"
    assert (out / "debian").read_text() == (rootfs / "etc" / "debian_version").read_text()  # the guest's root
    assert (out / "seen").read_text() == "numpy\n"
    assert (sorted(os.listdir(rootfs / "opt")), os.stat(rootfs).st_mtime_ns, os.stat(rootfs / "tmp").st_mtime_ns) \
        == before
    assert sorted(os.listdir(wheels)) == ["requirements.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "wheels"]  # the mount point is gone too


def test_a_failing_command_says_why(rootfs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(host_venv.BuildFailed, match="exit status 3: nope"):
        host_venv.run(rootfs, out, GUEST_DIR, tmp_path, "echo nope >&2; exit 3", timeout=60)
