"""The ``code-interpreter-v1`` recipe: ``base`` (Debian bookworm, Python 3.11, Node.js 18)
plus a venv of PyPI packages and aenv's code interpreter server (``code_interpreter/``),
whose start command is the server and whose ready check is its ``/health`` (200 only once
the default Python and JavaScript kernels run, so the template snapshot holds warm
kernels with numpy, pandas and matplotlib already imported).

The guest never reaches the internet: the host downloads the wheels for CPython 3.11 on
manylinux x86_64 (``pip download``, the list in ``code_interpreter/guest-requirements.txt``)
into the package cache (``AENV_PACKAGE_CACHE``, per list). Where it can (root, the base
image's root file system stage on this host: ``host_venv``), the host also installs them
into a venv made in the guest's root file system and byte-compiles it, cached beside them
per wheels, stage and ``VENV_VERSION``, and the build COPYs the finished venv in: seconds
natively instead of minutes under TCG. Elsewhere the build COPYs the wheels in and installs
them offline in the build VM, saying why in its log. The JavaScript kernel needs only the
guest's ``node`` (no npm)."""
from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from django.conf import settings

from template_builds.system import host_venv
from template_builds.system.recipes import Recipe, Tree, copy_step, run_step, tree_archive, tree_hash

ALIAS = "code-interpreter-v1"
SERVER = Path(__file__).resolve().parents[2] / "code_interpreter"
REQUIREMENTS = SERVER / "guest-requirements.txt"
GUEST = "/opt/code-interpreter"
VENV = f"{GUEST}/venv"
# A new number builds the host's venvs anew (part of their cache key with the wheels and the stage).
VENV_VERSION = 1
# The install, offline from a directory of wheels, then the byte-compilation on every CPU
# without the packages' own test suites; the same commands on the host and in the guest.
INSTALL = (f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --no-index --no-cache-dir --no-compile "
           "--disable-pip-version-check --find-links {wheels} -r {wheels}/requirements.txt")
COMPILE = f"{VENV}/bin/python -m compileall -q -j 0 -x '/tests?/' {VENV}/lib"
STALE_SECONDS = 6 * 3600  # a host build's leftovers older than this go
PRELOAD = "numpy,pandas,matplotlib.pyplot"
# The guest's interpreter: bookworm's CPython 3.11 on x86_64 (glibc 2.36).
PLATFORM = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--abi", "abi3", "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]


class DownloadFailed(Exception):
    pass


def wheels(cache: Path | None = None, progress=print) -> Tree:
    """The wheels of the requirements list for the guest, downloaded once per list into
    the package cache (a complete directory is never changed: a new list, a new one)."""
    cache = Path(cache or settings.AENV_PACKAGE_CACHE) / "code-interpreter"
    listed = REQUIREMENTS.read_text()
    key = hashlib.sha256((listed + " ".join(PLATFORM)).encode()).hexdigest()[:16]
    final = cache / f"wheels-{key}"
    if not final.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".wheels-", dir=cache))
        try:
            progress(f"downloading the code interpreter's wheels into {final}")
            out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                                  *PLATFORM, "-d", str(work), "-r", str(REQUIREMENTS)],
                                 capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise DownloadFailed(f"pip download failed: {out.stderr[-2000:] or out.stdout[-2000:]}")
            shutil.copyfile(REQUIREMENTS, work / "requirements.txt")
            try:
                work.rename(final)
            except OSError:  # another process finished the same download first
                pass
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return Tree(final, "wheels")


def venv(wheel_tree: Tree, cache: Path | None = None, progress=print) -> Tree | str:
    """The venv of ``wheel_tree``'s wheels built on the host in the guest's root file system
    (``host_venv``), once per wheels, stage and ``VENV_VERSION`` into the package cache (built
    aside and renamed: a complete directory is never changed), with its archive and hash made
    once too (a few hundred MB); or why this host cannot (the build installs in the guest)."""
    cache = Path(cache or settings.AENV_PACKAGE_CACHE) / "code-interpreter"
    try:
        stage, rootfs = host_venv.guest_rootfs(Path(settings.AENV_IMAGES_DIR))
    except LookupError as exc:
        return str(exc)
    command = f"{INSTALL.format(wheels=host_venv.WHEELS_IN_ROOT)} && {COMPILE}"
    key = hashlib.sha256(f"{wheel_tree.root.name};{stage};{VENV_VERSION};{command}".encode()).hexdigest()[:16]
    final = cache / f"venv-{key}"
    if not final.is_dir():
        reason = host_venv.unavailable()
        if reason:
            return reason
        cache.mkdir(parents=True, exist_ok=True)
        _clear_stale(cache)
        work = Path(tempfile.mkdtemp(prefix=".venv-", dir=cache))
        try:
            progress(f"building the code interpreter's venv on the host in the guest's root file system "
                     f"(stage debootstrap-{stage}) into {final}")
            t0 = time.monotonic()
            try:
                host_venv.run(rootfs, work, GUEST, wheel_tree.root, command)
            except host_venv.BuildFailed as exc:
                progress(f"the host build of the venv failed: {exc}")
                return "its host build failed"
            tree_archive(work / "venv", "venv", work / "venv.tar.gz", keep_caches=True, compresslevel=6)
            (work / "files-hash").write_text(tree_hash(work / "venv", "venv", keep_caches=True))
            try:
                work.rename(final)
            except OSError:  # another process finished the same build first
                pass
            progress(f"venv built and archived on the host in {time.monotonic() - t0:.1f}s")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return Tree(final / "venv", "venv", keep_caches=True, archive=final / "venv.tar.gz",
                known_hash=(final / "files-hash").read_text().strip())


def _clear_stale(cache: Path, older_than: float = STALE_SECONDS) -> None:
    """Removes what a killed host build left (a few hundred MB each): nothing that old is
    still being built (a build times out after 30 minutes)."""
    for path in [*cache.glob(".venv-*"), *cache.glob(".root-.venv-*")]:
        try:
            if time.time() - path.stat().st_mtime > older_than:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def recipe(cache: Path | None = None, progress=print) -> Recipe:
    wheel_tree = wheels(cache, progress)
    server = Tree(SERVER, "code_interpreter")
    built = venv(wheel_tree, cache, progress)
    if isinstance(built, Tree):
        install = [copy_step(built, VENV)]
    else:
        progress(f"{ALIAS}: the venv is installed in the build VM (slow under emulation): {built}")
        say = shlex.quote(f"aenv: installing the venv in the build VM, not on the host: {built}")
        install = [
            # wheels first: the slow install is cached until the package list changes
            copy_step(wheel_tree, f"{GUEST}/wheels"),
            run_step(f"echo {say} && {INSTALL.format(wheels=f'{GUEST}/wheels')} && rm -rf {GUEST}/wheels "
                     f"&& {COMPILE}"),
        ]
        built = wheel_tree
    steps = [
        *install,
        copy_step(server, f"{GUEST}/lib/code_interpreter"),
        run_step(f"echo {GUEST}/lib > \"$({VENV}/bin/python -c 'import sysconfig; "
                 f"print(sysconfig.get_paths()[\"purelib\"])')/aenv-code-interpreter.pth\" "
                 f"&& {VENV}/bin/python -m compileall -q {GUEST}/lib "
                 f"&& {VENV}/bin/python -c 'import code_interpreter.app, ipykernel, bash_kernel'"),
    ]
    start = (f"sudo {VENV}/bin/python -m code_interpreter --cwd /home/user --runtime-dir /run/code-interpreter "
             f"--preload {PRELOAD}")
    ready = "curl -sf -o /dev/null http://127.0.0.1:49999/health"
    return Recipe(alias=ALIAS, steps=steps, start_cmd=start, ready_cmd=ready, cpu_count=2, memory_mb=1024,
                  trees={built.name: built, server.name: server})
