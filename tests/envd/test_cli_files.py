"""``aenv upload`` / ``aenv download`` against a real envd on the host: files and
directory trees (nested, empty, hidden, binary, larger than a chunk) round trip; where
things land (``cp -r`` rules); nothing replaced locally without --force; symlinks
refused before anything moves; an interrupted transfer leaves no file under its final
name and no temporary file behind."""
import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from aenv_cli import output, transfer
from envd_client import EnvdClient

from .cli_api import FakeApi

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def remote(sandbox_user):
    """A fresh directory in the 'sandbox' (the host, as envd's user sees it)."""
    path = Path(sandbox_user.pw_dir) / f"cli-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chown(path, sandbox_user.pw_uid, sandbox_user.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def aenv(envd):
    api = FakeApi()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))},
           "E2B_API_URL": api.url, "E2B_SANDBOX_URL": envd.url, "E2B_API_KEY": "k"}

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "aenv_cli", *argv], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    yield run
    api.close()


def make_tree(root: Path) -> dict:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / ".hidden").mkdir()
    files = {"README": b"hello\n", "src/main.py": b"print('hi')\n", "src/pkg/data.bin": os.urandom(700_000),
             ".hidden/.env": b"A=1\n", "src/pkg/zero": b""}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return files


def digest_tree(root: Path) -> dict:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_a_directory_goes_up_and_comes_back_the_same(aenv, remote, tmp_path):
    make_tree(tmp_path / "proj")
    out = aenv("upload", "sb", str(tmp_path / "proj"), f"{remote}/")  # trailing /: under its own name
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Uploaded directory {tmp_path / 'proj'} to sb:{remote}/proj (5 files, ")
    assert digest_tree(remote / "proj") == digest_tree(tmp_path / "proj")
    assert (remote / "proj" / "src" / "main.py").stat().st_uid != 0  # written as the sandbox's user

    out = aenv("upload", "sb", str(tmp_path / "proj"), str(remote / "copy"))  # a new name: becomes it
    assert out.returncode == 0 and digest_tree(remote / "copy") == digest_tree(tmp_path / "proj")
    out = aenv("upload", "sb", str(tmp_path / "proj"), str(remote / "copy"))  # an existing dir: goes inside
    assert out.returncode == 0 and (remote / "copy" / "proj" / "README").exists()

    down = tmp_path / "down"
    down.mkdir()
    out = aenv("download", "sb", str(remote / "proj"), str(down))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Downloaded directory sb:{remote}/proj to {down}/proj (5 files, ")
    assert digest_tree(down / "proj") == digest_tree(tmp_path / "proj")
    assert not [p for p in down.rglob("*aenv-download*")]


def test_a_file_lands_by_cp_rules(aenv, remote, tmp_path):
    src = tmp_path / "note.txt"
    src.write_text("v1\n")
    assert aenv("upload", "sb", str(src), f"{remote}/").returncode == 0
    assert (remote / "note.txt").read_text() == "v1\n"
    assert aenv("upload", "sb", str(src), str(remote / "renamed.txt")).returncode == 0
    assert (remote / "renamed.txt").read_text() == "v1\n"
    out = aenv("upload", "sb", str(src), "rel/in/home.txt")  # relative: the user's home
    assert out.returncode == 0 and out.stdout.rstrip().endswith("/home/user/rel/in/home.txt")
    shutil.rmtree("/home/user/rel")
    src.write_text("v2\n")
    assert aenv("upload", "sb", str(src), str(remote / "note.txt")).returncode == 0  # replaces
    assert (remote / "note.txt").read_text() == "v2\n"
    assert not [p.name for p in remote.iterdir() if "aenv-upload" in p.name]

    dest = tmp_path / "d"
    dest.mkdir()
    out = aenv("download", "sb", str(remote / "note.txt"), str(dest))
    assert out.returncode == 0 and (dest / "note.txt").read_text() == "v2\n"
    (remote / "note.txt").write_text("v3\n")
    out = aenv("download", "sb", str(remote / "note.txt"), str(dest / "note.txt"))
    assert out.returncode == 5 and "--force" in out.stderr and (dest / "note.txt").read_text() == "v2\n"
    out = aenv("download", "-f", "sb", str(remote / "note.txt"), str(dest / "note.txt"))
    assert out.returncode == 0 and (dest / "note.txt").read_text() == "v3\n"
    os.chmod(remote / "note.txt", 0o750)
    assert aenv("download", "sb", str(remote / "note.txt"), str(dest / "x.sh")).returncode == 0
    assert (dest / "x.sh").stat().st_mode & 0o777 == 0o750  # the mode comes along


def test_directory_downloads_merge_and_check_every_conflict_first(aenv, remote, tmp_path):
    make_tree(remote / "proj")
    local = tmp_path / "proj"
    (local / "src").mkdir(parents=True)
    (local / "mine.txt").write_text("keep\n")
    (local / "README").write_text("local readme\n")
    out = aenv("download", "sb", str(remote / "proj"), str(tmp_path))
    assert out.returncode == 5 and "README" in out.stderr
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*")) == ["README", "mine.txt", "src"]
    out = aenv("download", "--force", "sb", str(remote / "proj"), str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (local / "README").read_bytes() == b"hello\n" and (local / "mine.txt").read_text() == "keep\n"
    assert (local / "src" / "pkg" / "data.bin").read_bytes() == (remote / "proj/src/pkg/data.bin").read_bytes()


def test_symlinks_and_missing_paths_are_refused_before_anything_moves(aenv, remote, tmp_path):
    tree = tmp_path / "t"
    make_tree(tree)
    (tree / "src" / "link").symlink_to("main.py")
    out = aenv("upload", "sb", str(tree), str(remote / "t"))
    assert out.returncode == 2 and "symbolic links are not supported" in out.stderr and not (remote / "t").exists()
    (remote / "r").mkdir()
    (remote / "r" / "a").write_text("a")
    (remote / "r" / "link").symlink_to("a")
    out = aenv("download", "sb", str(remote / "r"), str(tmp_path))
    assert out.returncode == 2 and "symbolic links are not supported" in out.stderr and not (tmp_path / "r").exists()
    assert aenv("download", "sb", str(remote / "nope"), str(tmp_path)).returncode == 4
    assert aenv("upload", "sb", str(tmp_path / "nope"), str(remote)).returncode == 4
    assert aenv("download", "sb", str(remote / "r" / "a"), str(tmp_path / "no" / "dir" / "a")).returncode == 4


class Interrupt(output.Progress):
    """A progress bar that is Ctrl-C after the first chunk."""

    def __init__(self):
        super().__init__(0, "test", quiet=True)

    def advance(self, n):
        raise KeyboardInterrupt


def test_an_interrupted_upload_leaves_nothing_under_its_name(envd, remote, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    with EnvdClient(envd.url) as client, pytest.raises(KeyboardInterrupt):
        transfer.upload_one(client, src, str(remote / "big.bin"), None, Interrupt())
    assert list(remote.iterdir()) == []  # neither the file nor its hidden twin


def test_an_interrupted_download_leaves_nothing_under_its_name(envd, remote, tmp_path):
    (remote / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    with EnvdClient(envd.url) as client, pytest.raises(KeyboardInterrupt):
        entry = client.stat(str(remote / "big.bin"))
        transfer.download_one(client, entry, tmp_path / "big.bin", force=False, user=None, progress=Interrupt())
    assert list(tmp_path.iterdir()) == []


def test_a_progress_bar_on_a_terminal_only(envd, remote, tmp_path):
    import pexpect  # noqa: PLC0415

    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(8 * 1024 * 1024))
    api = FakeApi()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))},
           "E2B_API_URL": api.url, "E2B_SANDBOX_URL": envd.url, "E2B_API_KEY": "k"}
    try:
        shown = pexpect.run(f"{sys.executable} -m aenv_cli upload sb {src} {remote}/", env=env, cwd=str(ROOT),
                            timeout=60, encoding="utf-8")
        quiet = pexpect.run(f"{sys.executable} -m aenv_cli upload -q sb {src} {remote}/again.bin", env=env,
                            cwd=str(ROOT), timeout=60, encoding="utf-8")
    finally:
        api.close()
    assert "Uploading" in shown and "8.00M" in shown and f"Uploaded {src} to sb:{remote}/big.bin" in shown
    assert "Uploading" not in quiet and (remote / "again.bin").stat().st_size == 8 * 1024 * 1024
