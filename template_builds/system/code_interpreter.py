"""The ``code-interpreter-v1`` recipe: ``base`` (Debian bookworm, Python 3.11, Node.js 18)
plus a venv of PyPI packages and aenv's code interpreter server (``code_interpreter/``),
whose start command is the server and whose ready check is its ``/health`` (200 only once
the default Python and JavaScript kernels run, so the template snapshot holds warm
kernels with numpy, pandas and matplotlib already imported).

The guest never reaches the internet: the host downloads the wheels for CPython 3.11 on
manylinux x86_64 (``pip download``, the list in ``code_interpreter/guest-requirements.txt``)
into the package cache (``AENV_PACKAGE_CACHE``, per list), and the build COPYs them in and
installs them offline. The JavaScript kernel needs only the guest's ``node`` (no npm)."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from django.conf import settings

from .recipes import Recipe, Tree, copy_step, run_step

ALIAS = "code-interpreter-v1"
SERVER = Path(__file__).resolve().parents[2] / "code_interpreter"
REQUIREMENTS = SERVER / "guest-requirements.txt"
GUEST = "/opt/code-interpreter"
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


def recipe(cache: Path | None = None, progress=print) -> Recipe:
    wheel_tree = wheels(cache, progress)
    server = Tree(SERVER, "code_interpreter")
    venv = f"{GUEST}/venv"
    steps = [
        # wheels first: the slow install is cached until the package list changes
        copy_step(wheel_tree, f"{GUEST}/wheels"),
        # byte-compiled on both vCPUs afterwards, without the packages' own test suites (TCG is slow)
        run_step(f"python3 -m venv {venv} && {venv}/bin/pip install -q --no-index --no-cache-dir --no-compile "
                 f"--disable-pip-version-check --find-links {GUEST}/wheels -r {GUEST}/wheels/requirements.txt "
                 f"&& rm -rf {GUEST}/wheels && {venv}/bin/python -m compileall -q -j 0 -x '/tests?/' "
                 f"{venv}/lib"),
        copy_step(server, f"{GUEST}/lib/code_interpreter"),
        run_step(f"echo {GUEST}/lib > \"$({venv}/bin/python -c 'import sysconfig; "
                 f"print(sysconfig.get_paths()[\"purelib\"])')/aenv-code-interpreter.pth\" "
                 f"&& {venv}/bin/python -m compileall -q {GUEST}/lib "
                 f"&& {venv}/bin/python -c 'import code_interpreter.app, ipykernel, bash_kernel'"),
    ]
    start = (f"sudo {venv}/bin/python -m code_interpreter --cwd /home/user --runtime-dir /run/code-interpreter "
             f"--preload {PRELOAD}")
    ready = "curl -sf -o /dev/null http://127.0.0.1:49999/health"
    return Recipe(alias=ALIAS, steps=steps, start_cmd=start, ready_cmd=ready, cpu_count=2, memory_mb=1024,
                  trees={wheel_tree.name: wheel_tree, server.name: server})
