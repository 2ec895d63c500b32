"""The template builder's helper scripts (agent.builder.guest) run as the build VM runs
them, by the tools drive's busybox ``sh`` as root, here in a chroot of a minimal image
tree: busybox at /opt/aenv/bin/busybox as on the drive, and of the image's own userland
only what a test puts there. Why: the scripts must need nothing from the image (no bash,
no ``dirname``, no ``useradd``), and a chroot shows that in milliseconds, where a VM build
takes a minute (tests/integration/test_template_build_minimal.py does those)."""
from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from agent.builder import guest, plan

BUSYBOX = Path("/bin/busybox")
CHROOT = shutil.which("chroot") or shutil.which("chroot", path="/usr/sbin:/sbin") or "chroot"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not BUSYBOX.exists() or not os.path.isabs(CHROOT),
                                reason="needs root, chroot and busybox-static")


@pytest.fixture
def image(tmp_path):
    """An image tree with nothing but the tools drive's busybox and a root account."""
    root = tmp_path / "root"
    (root / "opt/aenv/bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / guest.BUSYBOX.lstrip("/"))
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "tmp").mkdir(mode=0o1777)
    (root / "dev").mkdir()
    os.mknod(root / "dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return root


def run(root: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` as BuildGuest.root_script runs it (drive busybox sh, the standard PATH)."""
    return subprocess.run([CHROOT, str(root), guest.BUSYBOX, "sh", "-c", script, "sh", *args],
                          env={"PATH": ":".join(plan.STANDARD_PATH), **env}, capture_output=True, text=True,
                          timeout=30)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr
    return proc


def test_defaults_need_nothing_of_the_image(image):
    """The reported failure: no dirname in the image gave ``mkdir: can't create directory ''``."""
    ok(run(image, guest.DEFAULTS_SCRIPT, FILE="/etc/aenv/template.json", DEFAULTS_JSON='{"defaultUser": "user"}'))
    written = image / "etc/aenv/template.json"
    assert written.read_text() == '{"defaultUser": "user"}\n' and written.stat().st_mode & 0o777 == 0o644


def test_user_without_useradd_is_written_as_useradd_would(image):
    root = image
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nsvc:x:1000:1000::/srv:/bin/sh")  # no \n
    (root / "etc/group").write_text("root:x:0:\nsvc:x:1000:\nweb:x:1001:\nops:x:1500:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc/skel").mkdir()
    (root / "etc/skel/.profile").write_text("# skel\n")
    (root / "etc/sudoers.d").mkdir()
    ok(run(root, guest.USER_SCRIPT, NAME="app", SUDO="1"))
    ok(run(root, guest.USER_SCRIPT, NAME="ops", SUDO="0"))  # its group exists: keeps gid 1500
    passwd = (root / "etc/passwd").read_text().splitlines()
    assert passwd[1:] == ["svc:x:1000:1000::/srv:/bin/sh", "app:x:1002:1002::/home/app:/bin/sh",
                          "ops:x:1003:1500::/home/ops:/bin/sh"]  # 1000 and 1001 are taken (uid, gid)
    assert (root / "etc/group").read_text().endswith("ops:x:1500:\napp:x:1002:\n")
    assert [line.split(":")[:2] for line in (root / "etc/shadow").read_text().splitlines()[1:]] == \
        [["app", "!"], ["ops", "!"]]
    home = root / "home/app"
    assert (home.stat().st_uid, home.stat().st_gid, home.stat().st_mode & 0o777) == (1002, 1002, 0o755)
    assert (home / ".profile").read_text() == "# skel\n" and (home / ".profile").stat().st_uid == 1002
    assert (root / "etc/sudoers.d/aenv-app").read_text() == "app ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert not (root / "etc/sudoers.d/aenv-ops").exists()
    before = (root / "etc/passwd").read_text()
    ok(run(root, guest.USER_SCRIPT, NAME="app", SUDO="1"))  # there: nothing changes
    assert (root / "etc/passwd").read_text() == before


def test_user_gets_bash_as_shell_when_the_image_has_it_and_useradd_when_it_has_that(image):
    (image / "bin").mkdir()
    shutil.copy2(BUSYBOX, image / "bin/bash")
    ok(run(image, guest.USER_SCRIPT, NAME="dev", SUDO="0"))
    assert "dev:x:1000:1000::/home/dev:/bin/bash" in (image / "etc/passwd").read_text()
    (image / "usr/sbin").mkdir(parents=True)
    (image / "usr/sbin/useradd").write_text(f'#!{guest.BUSYBOX} sh\necho "$*" > /tmp/useradd-args\n')
    (image / "usr/sbin/useradd").chmod(0o755)
    ok(run(image, guest.USER_SCRIPT, NAME="other", SUDO="0"))
    assert (image / "tmp/useradd-args").read_text() == "--create-home --shell /bin/bash other\n"


def test_workdir_creates_the_missing_parts_for_the_user(image):
    (image / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (image / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    (image / "srv").mkdir()
    (image / "data").mkdir()
    (image / "link").symlink_to("data")
    ok(run(image, guest.WORKDIR_SCRIPT, DIR="/srv/app/deep", OWNER="user:user"))
    ok(run(image, guest.WORKDIR_SCRIPT, DIR="/link/inside", OWNER="user:user"))
    assert (image / "srv").stat().st_uid == 0  # existing parts keep their owner
    assert (image / "srv/app").stat().st_uid == 1000 and (image / "srv/app/deep").stat().st_uid == 1000
    assert (image / "data/inside").is_dir() and (image / "link").is_symlink()
    (image / "srv/file").write_text("x")
    failed = run(image, guest.WORKDIR_SCRIPT, DIR="/srv/file", OWNER="user:user")
    assert failed.returncode == 2 and "/srv/file exists and is not a directory" in failed.stderr


def _archive(files: dict[str, str], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:  # as the E2B SDK makes it (PAX)
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(text.encode()), 0o600, 1700000000.5
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


@pytest.mark.parametrize("src,dest,into,expect", [
    ("site", "/srv/www", "0", {"srv/www/index.html": "home", "srv/www/" + "n" * 120 + "/deep.txt": "deep"}),
    ("site/index.html", "/srv/www/", "1", {"srv/www/index.html": "home"}),
    ("site/index.html", "/srv/renamed.html", "0", {"srv/renamed.html": "home"}),
])
def test_copy_with_the_drive_tools(image, src, dest, into, expect):
    """A new directory destination (the first case) is the unpacked tree moved into place;
    the others copy into what exists."""
    (image / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (image / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    (image / "tmp/up.tar").write_bytes(_archive({"site/index.html": "home",
                                                 "site/" + "n" * 120 + "/deep.txt": "deep"}))
    ok(run(image, guest.COPY_SCRIPT, ARCHIVE="/tmp/up.tar", GZ="1", SRC=src, DEST=dest, INTO=into,
           OWNER="user:user", MODE="0640", WORK="/tmp/work"))
    for rel, text in expect.items():
        path = image / rel
        assert path.read_text() == text and path.stat().st_uid == 1000 and path.stat().st_mode & 0o777 == 0o640
    assert not (image / "tmp/work").exists() and not (image / "tmp/up.tar").exists()


def test_the_shell_is_bash_else_sh_else_none(image):
    assert ok(run(image, guest.SHELL_SCRIPT, *guest.SHELLS)).stdout == ""
    (image / "bin").mkdir()
    shutil.copy2(BUSYBOX, image / "bin/sh")
    assert ok(run(image, guest.SHELL_SCRIPT, *guest.SHELLS)).stdout == "/bin/sh\n"
    (image / "bin/bash").write_text("not executable")
    assert ok(run(image, guest.SHELL_SCRIPT, *guest.SHELLS)).stdout == "/bin/sh\n"
    (image / "bin/bash").chmod(0o755)
    assert ok(run(image, guest.SHELL_SCRIPT, *guest.SHELLS)).stdout == "/bin/bash\n"


def test_root_env_is_what_the_login_shell_exports(image):
    """ENV values expand against it; read without bash's compgen."""
    (image / "bin").mkdir()
    shutil.copy2(BUSYBOX, image / "bin/sh")
    (image / "etc/profile").write_text("export FROM_PROFILE='a b'\nNOT_EXPORTED=1\n")
    proc = subprocess.run([CHROOT, str(image), "/bin/sh", "-l", "-c", guest.ROOT_ENV],
                          env={"HOME": "/root", "PATH": "/bin"}, capture_output=True, timeout=30)
    env = dict(item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)
    assert env["FROM_PROFILE"] == "a b" and env["HOME"] == "/root" and "NOT_EXPORTED" not in env



@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_a_directory_copied_to_a_new_or_an_existing_destination(image, exists):
    """The same files, owners and modes either way; an existing destination keeps its own
    owner and mode and what it held, a new one is made with the parents it lacks."""
    (image / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (image / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    if exists:
        (image / "srv/app").mkdir(parents=True, mode=0o700)
        (image / "srv/app/old.txt").write_text("old")
    (image / "tmp/up.tar").write_bytes(_archive({"venv/bin/python": "py", "venv/lib/m.py": "m"}))
    ok(run(image, guest.COPY_SCRIPT, ARCHIVE="/tmp/up.tar", GZ="1", SRC="venv", DEST="/srv/app/", INTO="0",
           OWNER="user:user", MODE="", WORK="/tmp/work"))
    app = image / "srv/app"
    assert (app / "bin/python").read_text() == "py" and (app / "lib/m.py").read_text() == "m"
    assert (app / "lib/m.py").stat().st_uid == 1000 and (app / "lib/m.py").stat().st_mode & 0o777 == 0o600
    assert int((app / "lib/m.py").stat().st_mtime) == 1700000000
    if exists:
        assert (app / "old.txt").read_text() == "old"
        assert app.stat().st_uid == 0 and app.stat().st_mode & 0o777 == 0o700
    else:
        assert app.stat().st_uid == 1000 and (image / "srv").stat().st_uid == 1000
    assert not (image / "tmp/work").exists() and not (image / "tmp/up.tar").exists()
