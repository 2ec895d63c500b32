"""Builds the read-only tools drive: aenv's guest init, static busybox, envd with its own runtime
and resize2fs.

Why: envd must work whatever the template contains (no Python, another libc or none: alpine,
static busybox, distroless). envd is frozen with PyInstaller (--onedir) from the host venv, and the
host's dynamic loader and C libraries are shipped next to it in /opt/aenv/lib. Running the frozen
envd through that loader (``ld.so --library-path``) is not enough: PyInstaller's onedir bootloader
re-executes itself on Linux (so its LD_LIBRARY_PATH takes effect), and that exec goes through the
ELF interpreter in its header, the image's /lib64/ld-linux-x86-64.so.2. So the drive's ELF files
are relocated with patchelf instead: the bootloader's interpreter is the drive's loader and its
DT_RPATH the bundle + the drive's lib dir; the bundle's libraries that carry a RUNPATH (the host
Python's, e.g. pyenv's ``/root/.pyenv/.../lib``, which DT_RPATH does not override) get the drive's
dirs in place of their absolute host dirs. Every library envd maps then comes from the drive and
only the guest kernel is shared with the template; what envd starts gets an environment built by
envd (no LD_LIBRARY_PATH), so it runs on the image's own userland.

resize2fs (the host's, relocated the same way, its libraries in /opt/aenv/lib) grows the root
filesystem at boot when the sandbox disk is larger than the image's: OCI images rarely carry
e2fsprogs, and the drive's matches the host mke2fs that made every aenv root filesystem.
The drive is mounted read-only at /opt/aenv in the guest.
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
LIBDIR = f"{MOUNT}/lib"
BUNDLE_LIBDIR = f"{MOUNT}/envd/_internal"
LAUNCHER = f"""#!{MOUNT}/bin/busybox sh
# envd's bootloader names this drive's loader as its interpreter and the drive's lib dirs as its
# rpath (patchelf at build time), so it and its re-exec never touch the template's libc.
exec {MOUNT}/envd/envd "$@"
"""
RESIZE2FS = "resize2fs"  # the host's (e2fsprogs), shipped as bin/resize2fs
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
    # a set: a checkout with pip's aenv.egg-info lists aenv twice when it is the working
    # directory (sys.path[0]) and once from elsewhere (a git worktree without one), which would
    # give two tools drives, two `base` images and no template snapshot for one of them
    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()})
    return {
        "envd": _files_digest(ENVD_DIR),
        "guest": _files_digest(GUEST_DIR),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "python": sys.version,
        "dists": hashlib.sha256("\n".join(dists).encode()).hexdigest(),
        "libc": platform.libc_ver(),
        "busybox": hashlib.sha256(Path("/bin/busybox").read_bytes()).hexdigest(),
        "resize2fs": _file_digest(_host_resize2fs()),
        "patchelf": _patchelf_version(),
    }


def _host_resize2fs() -> Path | None:
    found = shutil.which(RESIZE2FS) or shutil.which(RESIZE2FS, path="/usr/sbin:/sbin")
    return Path(found).resolve() if found else None


def _file_digest(path: Path | None) -> str:
    """sha256 of a host tool for the recipe ("missing" if absent: build() then says what to install)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path else "missing"


def _patchelf_version() -> str:
    if not shutil.which("patchelf"):
        return "missing"
    return subprocess.run(["patchelf", "--version"], capture_output=True, text=True).stdout.strip()


def _require_host_tools() -> None:
    lacking = [pkg for tool, pkg in (("patchelf", "patchelf"), ("readelf", "binutils"), ("ldd", "libc-bin"))
               if not shutil.which(tool)] + ([] if _host_resize2fs() else ["e2fsprogs"])
    if lacking:
        raise RuntimeError(f"building the tools drive needs the packages {', '.join(lacking)} "
                           "(scripts/setup.sh installs them)")


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


def _elves(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and _is_elf(p))


def ship_libs(elves: list[Path], libdir: Path, provided: set[str] = frozenset()) -> list[str]:
    """Copies the loader and the system libraries `elves` link into `libdir`, but those whose
    name is in `provided` (found elsewhere on the drive) or already there; returns the names."""
    libdir.mkdir(parents=True, exist_ok=True)
    shipped = []
    for dep in sorted(_elf_deps(elves)):
        name = LOADER if dep.name.startswith("ld-linux") else dep.name
        if name in provided or (libdir / name).exists():
            continue
        shutil.copy2(dep.resolve(), libdir / name)
        shipped.append(name)
    if not (libdir / LOADER).exists():
        shutil.copy2(Path("/lib64") / LOADER, libdir / LOADER)
        shipped.append(LOADER)
    return shipped


def ship_libc(bundle: Path, libdir: Path) -> list[str]:
    """Copies the loader and the system libraries the bundle uses but does not contain."""
    return ship_libs(_elves(bundle), libdir, {p.name for p in bundle.rglob("*")})


def _patchelf(*args: str) -> str:
    return run(["patchelf", *args]).stdout.strip()


def _dynamic_search_path(elf: Path) -> tuple[str, list[str]] | None:
    """("RPATH" or "RUNPATH", its entries) of a dynamic ELF file, None if it has neither."""
    out = subprocess.run(["readelf", "-d", str(elf)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        for kind in ("RUNPATH", "RPATH"):
            if f"({kind})" in line and "[" in line:
                return kind, [e for e in line[line.index("[") + 1:line.rindex("]")].split(":") if e]
    return None


def relocate_executable(elf: Path, rpath: list[str]) -> None:
    """Makes `elf` start with the drive's loader and look up its libraries (and, with DT_RPATH,
    those of every library without a RUNPATH of its own) in `rpath` first."""
    _patchelf("--set-interpreter", f"{LIBDIR}/{LOADER}", "--force-rpath", "--set-rpath", ":".join(rpath), str(elf))


def relocate_libraries(elves: list[Path], rpath: list[str]) -> list[Path]:
    """Replaces the absolute host directories in the RPATH/RUNPATH of `elves` with `rpath`
    (entries relative to $ORIGIN kept, first): a host path such as pyenv's lib dir means nothing in
    the guest, or worse, the template's files. Returns the files changed."""
    changed = []
    for elf in elves:
        found = _dynamic_search_path(elf)
        if found is None:
            continue
        kind, entries = found
        new = [e for e in entries if e.startswith("$ORIGIN") or e.startswith("${ORIGIN}")]
        new += [e for e in rpath if e not in new]
        if new == entries:
            continue
        force = ["--force-rpath"] if kind == "RPATH" else []
        _patchelf(*force, "--set-rpath", ":".join(new), str(elf))
        changed.append(elf)
    return changed


def assemble(tree: Path, bundle: Path, progress) -> None:
    """The drive's files in `tree`: busybox, the envd bundle and resize2fs relocated onto the
    drive's loader and libraries, the init and the envd launcher."""
    (tree / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", tree / "bin" / "busybox")
    shutil.copytree(bundle, tree / "envd", symlinks=True)
    shipped = ship_libc(tree / "envd", tree / "lib")
    resize2fs = tree / "bin" / "resize2fs"
    shutil.copy2(_host_resize2fs(), resize2fs)
    shipped += ship_libs([resize2fs], tree / "lib")
    progress(f"shipping host loader + libs: {', '.join(shipped)}")
    envd_rpath = [BUNDLE_LIBDIR, LIBDIR]
    relocate_executable(tree / "envd" / "envd", envd_rpath)
    changed = relocate_libraries([p for p in _elves(tree / "envd") if p != tree / "envd" / "envd"], envd_rpath)
    relocate_executable(resize2fs, [LIBDIR])
    changed += relocate_libraries(_elves(tree / "lib"), [LIBDIR])
    progress(f"relocated envd, resize2fs and the search paths of {len(changed)} libraries onto {MOUNT}")
    for name, text in (("init", (GUEST_DIR / "init.sh").read_text()), ("envd.sh", LAUNCHER)):
        (tree / name).write_text(text)
        (tree / name).chmod(0o755)


def build(out_img: Path, work: Path, progress) -> None:
    """Writes the tools drive image (ext4, label aenv-tools) to out_img."""
    _require_host_tools()
    work.mkdir(parents=True, exist_ok=True)
    bundle = freeze_envd(work, progress)
    tree = work / "tree"
    assemble(tree, bundle, progress)
    (tree / "RECIPE").write_text(repr(recipe_inputs()) + "\n")
    used = sum(p.lstat().st_size for p in tree.rglob("*"))
    size_mb = int(used * 1.25 / 2**20) + 16
    progress(f"tools drive: {used / 2**20:.1f} MiB of files into a {size_mb} MiB ext4")
    with open(out_img, "wb") as f:
        f.truncate(size_mb << 20)
    run(["mkfs.ext4", "-q", "-F", "-L", "aenv-tools", "-m", "0", "-O", "^has_journal", "-d", str(tree), str(out_img)])
    os.chmod(out_img, 0o444)
