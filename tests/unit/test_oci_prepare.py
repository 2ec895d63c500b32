"""vmm.oci.prepare on real trees: what an aenv guest gets, the `user` decision, hostile symlinks, determinism."""

import os
import stat
from pathlib import Path

import pytest

from vmm.oci import prepare
from vmm.oci.errors import OciError

EPOCH = 1_700_000_000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="prepare() sets file owners: needs root")


def _tree(root: Path, passwd: str = "root:x:0:0:root:/root:/bin/sh\n", group: str = "root:x:0:\n") -> Path:
    (root / "etc/skel/.config").mkdir(parents=True)
    (root / "etc/skel/.profile").write_text("PS1=x\n")
    (root / "etc/skel/.config/app").write_text("y\n")
    (root / "etc/skel/.link").symlink_to("/etc/passwd")
    (root / "etc/passwd").write_text(passwd)
    (root / "etc/group").write_text(group)
    (root / "bin").mkdir()
    (root / "bin/bash").write_text("")
    return root


def _listing(root: Path) -> list:
    out = []
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
        out.append((str(p.relative_to(root)), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, data))
    return out


def test_adds_mount_points_hostname_hosts_and_user(tmp_path):
    root = _tree(tmp_path / "r")
    done = prepare.prepare(root, EPOCH)
    for d in ("dev", "proc", "sys", "run", "tmp", "opt/aenv", "home", "root"):
        assert (root / d).is_dir(), d
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert (root / "etc/hostname").read_text() == "aenv\n"
    assert "127.0.0.1 localhost" in (root / "etc/hosts").read_text()
    assert done["user"] == {"name": "user", "uid": 1000, "gid": 1000, "home": "/home/user", "shell": "/bin/bash",
                            "created": True}
    assert (root / "etc/passwd").read_text().endswith("user:x:1000:1000::/home/user:/bin/bash\n")
    assert (root / "etc/group").read_text().endswith("user:x:1000:\n")
    home = root / "home/user"
    assert (home.stat().st_uid, home.stat().st_gid, stat.S_IMODE(home.stat().st_mode)) == (1000, 1000, 0o755)
    assert (home / ".profile").read_text() == "PS1=x\n" and (home / ".config/app").stat().st_uid == 1000
    assert os.readlink(home / ".link") == "/etc/passwd"  # copied as a link, not followed
    sudoers = root / "etc/sudoers.d/aenv-user"
    assert sudoers.read_text() == "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert stat.S_IMODE(sudoers.stat().st_mode) == 0o440 and sudoers.stat().st_uid == 0
    assert root.stat().st_mtime == EPOCH and (root / "etc").stat().st_mtime == EPOCH
    assert (root / "bin/bash").stat().st_mtime != EPOCH  # untouched files keep the image's times


def test_existing_user_is_kept_and_taken_ids_are_skipped(tmp_path):
    a = _tree(tmp_path / "a", passwd="root:x:0:0::/root:/bin/sh\nuser:x:1234:1234::/srv/u:/bin/zsh\n")
    (a / "etc/hostname").write_text("mine\n")
    done = prepare.prepare(a, EPOCH)
    assert done["user"] == {"name": "user", "uid": 1234, "gid": 1234, "home": "/srv/u", "shell": "/bin/zsh",
                            "created": False}
    assert (a / "etc/passwd").read_text().count("user:") == 1
    assert (a / "etc/hostname").read_text() == "mine\n"
    b = _tree(tmp_path / "b", passwd="root:x:0:0::/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n",
              group="root:x:0:\nnode:x:1000:\nother:x:1001:\n")
    (b / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    assert prepare.prepare(b, EPOCH)["user"]["uid"] == 1002
    assert (b / "etc/shadow").read_text().endswith(f"user::{EPOCH // 86400}:0:99999:7:::\n")


def test_no_passwd_at_all(tmp_path):
    root = tmp_path / "scratch"
    root.mkdir()
    done = prepare.prepare(root, EPOCH)
    assert (root / "etc/passwd").read_text() == ("root:x:0:0:root:/root:/bin/sh\n"
                                                 "user:x:1000:1000::/home/user:/bin/sh\n")
    assert (root / "etc/group").read_text() == "root:x:0:\nuser:x:1000:\n"
    assert done["user"]["created"]


def test_hostile_symlinks_stay_inside_the_tree(tmp_path):
    """/etc -> <an absolute host path>: written inside the tree, never on the host."""
    host = tmp_path / "host-etc"
    host.mkdir()
    root = tmp_path / "r"
    root.mkdir()
    (root / "etc").symlink_to(host)              # absolute: must mean <root><host>
    (root / "home").symlink_to("../../../../..")  # climbs: must stop at the root
    prepare.prepare(root, EPOCH)
    assert list(host.iterdir()) == []
    inside = root / str(host).lstrip("/")
    assert (inside / "passwd").read_text().startswith("root:")
    assert (root / "user").is_dir()  # /home -> / inside the tree: /home/user is /user
    assert prepare.resolve(root, "/etc/passwd") == inside / "passwd"


def test_link_loops_and_files_in_the_way_are_errors(tmp_path):
    root = tmp_path / "loop"
    root.mkdir()
    (root / "etc").symlink_to("etc")
    with pytest.raises(OciError, match="symbolic links"):
        prepare.prepare(root, EPOCH)
    other = tmp_path / "file"
    (other / "etc").mkdir(parents=True)
    (other / "etc/sudoers.d").write_text("not a dir")
    with pytest.raises(OciError, match="in the way"):
        prepare.prepare(other, EPOCH)


def test_same_input_same_result(tmp_path):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    for root in (a, b):
        for p in [root, *root.rglob("*")]:
            os.utime(p, (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    prepare.prepare(a, EPOCH)
    prepare.prepare(b, EPOCH)
    assert _listing(a) == _listing(b)
