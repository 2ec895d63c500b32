"""The compose images' cache key (harness/compose_stack.images_key): a build is skipped when the
key's tags exist, so the key must change with every file the build context holds and with
nothing .dockerignore leaves out (else a stale image passes, or every run builds again)."""
from __future__ import annotations

from pathlib import Path

from harness.compose_stack import ROOT, images_key

DOCKERIGNORE = ".git\nvar\ntests\n*.egg-info\n**/__pycache__\n**/*.pyc\n"


def tree(tmp_path: Path) -> Path:
    (tmp_path / ".dockerignore").write_text(DOCKERIGNORE)
    for rel, text in {"pkg/mod.py": "x = 1\n", "deploy/docker/Dockerfile.node": "FROM base\n",
                      "scripts/run.sh": "#!/bin/sh\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_what_the_context_leaves_out_does_not_change_the_key(tmp_path):
    root = tree(tmp_path)
    key = images_key(root)
    for rel in ("var/images/base/rootfs.qcow2", "tests/unit/test_x.py", "pkg/__pycache__/mod.cpython-311.pyc",
                "deploy/x.pyc", "aenv.egg-info/PKG-INFO", ".git/HEAD"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("anything")
    assert images_key(root) == key


def test_every_file_of_the_context_changes_the_key(tmp_path):
    root = tree(tmp_path)
    key = images_key(root)
    seen = {key}
    (root / "pkg" / "mod.py").write_text("x = 2\n")  # content
    seen.add(images_key(root))
    (root / "scripts" / "run.sh").chmod(0o755)  # the executable bit (COPY keeps it)
    seen.add(images_key(root))
    (root / "pkg" / "tests").mkdir()  # "tests" is ignored at the root only, as docker reads it
    (root / "pkg" / "tests" / "t.py").write_text("")
    seen.add(images_key(root))
    (root / "pkg" / "mod.py").rename(root / "pkg" / "moved.py")  # a path
    seen.add(images_key(root))
    (root / ".dockerignore").write_text(DOCKERIGNORE + "!tests/keep.py\n")  # re-inclusion: everything counts
    (root / "tests" / "keep.py").parent.mkdir(exist_ok=True)
    (root / "tests" / "keep.py").write_text("")
    seen.add(images_key(root))
    assert len(seen) == 6


def test_the_key_of_this_checkout_is_stable_and_quick():
    """It is computed on every compose test and every background build."""
    assert images_key(ROOT) == images_key(ROOT)
