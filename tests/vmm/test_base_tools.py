"""The `base` image has what E2B's base image gives its users (issue 11, item 6).

One VM booted from `base` for the whole module; every check runs as `user` through envd in a
login shell (`bash -l -c`, as the SDK's `commands.run` does), so PATH and HOME are what a
sandbox user gets. Nothing here needs the internet: the pip check builds its package inside
the guest and installs it with `--no-index`.
"""

import pytest

from envd import ENVD_PORT
from envd_client import EnvdClient
from tests.vmm.test_lifecycle_vm import real_driver
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec

pytestmark = pytest.mark.vm

# A project with a module and a console script; pip builds it with the image's setuptools.
PROJECT = """\
mkdir -p /tmp/aenvprobe/aenvprobe && cd /tmp/aenvprobe
cat > pyproject.toml <<'EOF'
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "aenvprobe"
version = "1.0"

[project.scripts]
aenvprobe = "aenvprobe:main"
EOF
cat > aenvprobe/__init__.py <<'EOF'
def main():
    print("aenvprobe says", 6 * 7)
EOF
"""


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    """envd of one VM booted from `base`: call it with a command, get (exit code, stdout, stderr)."""
    with real_driver(tmp_path_factory.mktemp("base-tools") / "home") as driver:
        info = driver.boot(BootSpec("base-tools", image="base", cpu_count=2, memory_mb=512))
        host, port = endpoint(info)
        with EnvdClient.at(host, port, timeout=120, stream_idle_timeout=300) as envd:
            def run(command: str, user: str = "user") -> tuple[int, str, str]:
                result = envd.run(command, user=user, stdin=None)
                return result.exit_code, result.stdout.decode(), result.stderr.decode()

            yield run


def ok(guest, command: str, user: str = "user") -> str:
    """stdout of a command that must succeed."""
    code, out, err = guest(command, user)
    assert code == 0, f"{command!r} exited {code}\nstdout: {out}\nstderr: {err}"
    return out.strip()


def test_user_account(guest):
    assert ok(guest, "whoami; id -u; echo $HOME") == "user\n1000\n/home/user"
    assert ok(guest, "sudo -n true && sudo -n whoami") == "root"


def test_python_is_python3_with_venv(guest):
    assert ok(guest, "python --version").startswith("Python 3.")
    assert ok(guest, "readlink -f $(command -v python)") == ok(guest, "readlink -f $(command -v python3)")
    # `python -m venv` needs ensurepip's bundled pip (Debian's python3-venv); the venv itself is
    # made without it here, since installing pip into it takes a minute under TCG: pip in the
    # venv is the system one, seen through --system-site-packages.
    assert ok(guest, "python -c 'import ensurepip; print(ensurepip.version())'")[:1].isdigit()
    out = ok(guest, "python -m venv --without-pip --system-site-packages /tmp/v && /tmp/v/bin/python -m pip --version"
                    " && /tmp/v/bin/python -c 'import sys; print(sys.prefix)'")
    assert out.startswith("pip ") and out.endswith("/tmp/v"), out


def test_pip_install_as_user_without_network(guest):
    """Debian marks its Python externally managed (PEP 668); the image's /etc/pip.conf lets a
    plain `pip install` through, which as `user` goes to ~/.local (site-packages is root's)."""
    assert ok(guest, "ls /usr/lib/python3*/EXTERNALLY-MANAGED").endswith("EXTERNALLY-MANAGED")  # still marked
    assert "global.break-system-packages='true'" in ok(guest, "pip config list")
    ok(guest, PROJECT)
    ok(guest, "cd /tmp && pip install --no-index --no-build-isolation ./aenvprobe")
    path = ok(guest, "cd / && python -c 'import aenvprobe; print(aenvprobe.__file__)'")
    assert path.startswith("/home/user/.local/lib/python3"), path
    # The console script lands in ~/.local/bin, which the next login shell has on PATH.
    assert ok(guest, "command -v aenvprobe") == "/home/user/.local/bin/aenvprobe"
    assert ok(guest, "aenvprobe") == "aenvprobe says 42"
    ok(guest, "pip uninstall -y aenvprobe")
    code, _, err = guest("cd / && python -c 'import aenvprobe'")
    assert code != 0 and "No module named 'aenvprobe'" in err


def test_pip_install_as_root_is_system_wide(guest):
    ok(guest, PROJECT)
    ok(guest, "cd /tmp && sudo -n pip install --no-index --no-build-isolation ./aenvprobe")
    try:
        path = ok(guest, "cd / && python -c 'import aenvprobe; print(aenvprobe.__file__)'")
        assert path.startswith("/usr/local/lib/python3"), path
    finally:
        ok(guest, "sudo -n pip uninstall -y aenvprobe")


def test_node_and_npm(guest):
    assert ok(guest, "node -e 'console.log(1+1)'") == "2"
    assert ok(guest, "npm --version").split(".")[0].isdigit()


HELLO_C = r"""
cd /tmp && cat > hello.c <<'EOF'
#include <stdio.h>
int main(void) { printf("hello %d\n", 6 * 7); return 0; }
EOF
gcc -O2 -Wall -Werror -o hello hello.c && ./hello
"""


def test_c_toolchain(guest):
    assert ok(guest, HELLO_C) == "hello 42"
    assert ok(guest, "make --version").startswith("GNU Make")
    assert ok(guest, "g++ --version").startswith("g++")


@pytest.mark.parametrize("command, starts", [
    ("git --version", "git version"),
    ("curl --version", "curl "),
    ("wget --version", "GNU Wget"),
    ("jq --version", "jq-"),
    ("socat -V | grep '^socat version'", "socat version"),
    ("unzip -v", "UnZip"),
    ("xz --version", "xz (XZ Utils)"),
    ("tar --version", "tar (GNU tar)"),
    ("gzip --version", "gzip"),
    ("ping -V", "ping from iputils"),
    ("less --version", "less "),
])
def test_cli_tools(guest, command, starts):
    assert ok(guest, command).startswith(starts)


def test_jq_filters(guest):
    assert ok(guest, """echo '{"a": [1, 2, 3]}' | jq -c '[.a[] * 2]'""") == "[2,4,6]"


def test_sdk_ready_check_helpers(guest):
    """What E2B's SDK helpers call: `ss` lists envd's listening port, `pgrep` finds processes."""
    listening = ok(guest, "ss -Htuln")
    assert f":{ENVD_PORT} " in listening, listening
    assert ok(guest, "sleep 30 & pgrep -x sleep && kill $!").split()[0].isdigit()


def test_room_left_for_users(guest):
    """The tools must not crowd out users' own installs: blocks and inodes (node_modules and
    site-packages are many small files) both left on the template-sized root disk."""
    fields = ok(guest, "df --output=size,avail,iavail -B1M / | tail -1").split()
    size_mb, avail_mb, avail_inodes = map(int, fields)
    print(f"\nroot filesystem: {size_mb} MiB, {avail_mb} MiB and {avail_inodes} inodes free")
    assert avail_mb >= 768, fields
    assert avail_inodes >= 150_000, fields
