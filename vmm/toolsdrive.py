"""Builds the read-only tools drive: aenv's guest init, static busybox and envd with its own runtime.

Why: envd must work whatever the template contains (no Python, another libc). envd is frozen with
PyInstaller (--onedir) from the host venv, and the host's dynamic loader and C libraries are
shipped next to it; the launcher runs envd through that loader, so only the guest kernel is shared
with the template. The drive is mounted read-only at /opt/aenv in the guest.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from vmm.rootfs import run

REPO = Path(__file__).resolve().parents[1]
GUEST_DIR = Path(__file__).parent / "guest"
ENVD_DIR = REPO / "envd"
MOUNT = "/opt/aenv"
LOADER = "ld-linux-x86-64.so.2"
LAUNCHER = f"""#!{MOUNT}/bin/busybox sh
# Runs envd through the loader and C library shipped on this drive (not the template's).
exec {MOUNT}/lib/{LOADER} --library-path {MOUNT}/lib:{MOUNT}/envd/_internal {MOUNT}/envd/envd "$@"
"""
# Modules that PyInstaller cannot see through envd's dynamic imports.
COLLECT = ["envd", "uvicorn"]
EXCLUDE = ["tkinter", "django", "pytest", "boto3", "botocore", "celery", "IPython"]


def _files_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc",):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def recipe_inputs() -> dict:
    """Everything that changes the tools drive: envd sources, guest scripts, this builder, the runtime."""
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return {
        "envd": _files_digest(ENVD_DIR),
        "guest": _files_digest(GUEST_DIR),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "python": sys.version,
        "dists": hashlib.sha256("\n".join(dists).encode()).hexdigest(),
        "libc": platform.libc_ver(),
        "busybox": hashlib.sha256(Path("/bin/busybox").read_bytes()).hexdigest(),
    }


def freeze_envd(work: Path, progress) -> Path:
    """PyInstaller --onedir bundle of envd; returns the bundle dir."""
    entry = GUEST_DIR / "envd_entry.py"
    extra = []
    for mod in COLLECT:
        extra += ["--collect-submodules", mod]
    extra += ["--hidden-import", "envd.__main__"]
    progress("freezing envd/__main__.py with PyInstaller")
    for mod in EXCLUDE:
        extra += ["--exclude-module", mod]
    run([sys.executable, "-m", "PyInstaller", "--onedir", "--noconfirm", "--log-level", "WARN",
         "--name", "envd", "--distpath", str(work / "dist"), "--workpath", str(work / "build"),
         "--specpath", str(work), "--paths", str(REPO), *extra, str(entry)], cwd=work)
    return work / "dist" / "envd"


def _elf_deps(paths: list[Path]) -> set[Path]:
    """System libraries (resolved by the host loader) that the bundle's ELF files need."""
    deps: set[Path] = set()
    for p in paths:
        proc = subprocess.run(["ldd", str(p)], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            parts = line.split()
            if "=>" in parts:
                target = parts[parts.index("=>") + 1]
                if target.startswith("/"):
                    deps.add(Path(target))
            elif parts and parts[0].startswith("/"):
                deps.add(Path(parts[0]))
    return deps


def _is_elf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def ship_libc(bundle: Path, libdir: Path) -> list[str]:
    """Copies the loader and the system libraries the bundle uses but does not contain."""
    libdir.mkdir(parents=True, exist_ok=True)
    elves = [p for p in bundle.rglob("*") if p.is_file() and not p.is_symlink() and _is_elf(p)]
    bundled = {p.name for p in bundle.rglob("*")}
    shipped = []
    for dep in sorted(_elf_deps(elves)):
        name = LOADER if dep.name.startswith("ld-linux") else dep.name
        if name in bundled or (libdir / name).exists():
            continue
        shutil.copy2(dep.resolve(), libdir / name)
        shipped.append(name)
    if not (libdir / LOADER).exists():
        shutil.copy2(Path("/lib64") / LOADER, libdir / LOADER)
        shipped.append(LOADER)
    return shipped


def build(out_img: Path, work: Path, progress) -> None:
    """Writes the tools drive image (ext4, label aenv-tools) to out_img."""
    work.mkdir(parents=True, exist_ok=True)
    bundle = freeze_envd(work, progress)
    tree = work / "tree"
    (tree / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", tree / "bin" / "busybox")
    shutil.copytree(bundle, tree / "envd", symlinks=True)
    shipped = ship_libc(tree / "envd", tree / "lib")
    progress(f"shipping host loader + libs: {', '.join(shipped)}")
    for name, text in (("init", (GUEST_DIR / "init.sh").read_text()), ("envd.sh", LAUNCHER)):
        (tree / name).write_text(text)
        (tree / name).chmod(0o755)
    (tree / "RECIPE").write_text(repr(recipe_inputs()) + "\n")
    used = sum(p.lstat().st_size for p in tree.rglob("*"))
    size_mb = int(used * 1.25 / 2**20) + 16
    progress(f"tools drive: {used / 2**20:.1f} MiB of files into a {size_mb} MiB ext4")
    with open(out_img, "wb") as f:
        f.truncate(size_mb << 20)
    run(["mkfs.ext4", "-q", "-F", "-L", "aenv-tools", "-m", "0", "-O", "^has_journal", "-d", str(tree), str(out_img)])
    os.chmod(out_img, 0o444)
