"""The host tools the OCI path runs, found once and run with their output kept for errors.

Why external tools: pulling (registry auth flows, manifest lists, Docker and OCI media types,
blob de-duplication) and unpacking (whiteouts, hard links, xattrs, device nodes, path safety)
are solved by well-kept, Debian-packaged programs: ``skopeo`` and ``umoci``. Building the disk
uses e2fsprogs and qemu-utils, which the base image build already needs. Their versions are
part of a guest disk's key (vmm.oci.disks): another version may lay out bytes differently.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from vmm.oci.errors import OciError, ToolMissing

# tool -> the Debian package that ships it (scripts/setup.sh installs them)
PACKAGES = {"skopeo": "skopeo", "umoci": "umoci", "mke2fs": "e2fsprogs", "debugfs": "e2fsprogs",
            "dumpe2fs": "e2fsprogs", "e2fsck": "e2fsprogs", "qemu-img": "qemu-utils"}


def which(tool: str) -> str:
    """The tool's path; raises ToolMissing naming the package to install."""
    path = shutil.which(tool) or (shutil.which(tool, path="/usr/sbin:/sbin") if tool in PACKAGES else None)
    if path is None:
        raise ToolMissing(f"{tool} not found (apt-get install {PACKAGES.get(tool, tool)}; scripts/setup.sh does)")
    return path


def missing(*tools: str) -> list[str]:
    """The tools of `tools` that are not installed (for skip reasons and preflight checks)."""
    out = []
    for tool in tools:
        try:
            which(tool)
        except ToolMissing:
            out.append(tool)
    return out


def run(argv: list[str], *, env: dict | None = None, timeout: float | None = 3600, input: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Runs a tool (argv[0] looked up with which()) with a C locale, capturing its output;
    check=True raises OciError with the end of stderr on a non-zero exit."""
    full_env = {**os.environ, "LC_ALL": "C", "TZ": "UTC", **(env or {})}
    try:
        proc = subprocess.run([which(argv[0]), *argv[1:]], capture_output=True, text=True, env=full_env,
                              timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise OciError(f"{argv[0]} did not finish within {timeout:.0f}s") from None
    if check and proc.returncode != 0:
        raise OciError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


@functools.lru_cache(maxsize=None)
def version(tool: str) -> str:
    """The tool's version string, e.g. "1.47.0" (mke2fs), "7.2.22" (qemu-img)."""
    flag = {"mke2fs": "-V"}.get(tool, "--version")
    proc = run([tool, flag], check=False)
    text = proc.stdout + proc.stderr
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    if proc.returncode != 0 or m is None:
        raise OciError(f"cannot tell the version of {tool}: {text.strip()[:200]}")
    return m.group(1)
