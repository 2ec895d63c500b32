"""The tools drive's relocation of envd and resize2fs onto the drive's loader and libraries
(vmm.toolsdrive), on real host binaries with patchelf; no VM. The end-to-end proof, envd in an
image without glibc, is tests/vmm/test_oci_images.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vmm import toolsdrive

pytestmark = pytest.mark.skipif(not (shutil.which("patchelf") and shutil.which("readelf")),
                                reason="patchelf/readelf not installed (scripts/setup.sh installs them)")
HOST_LIB = Path("/lib/x86_64-linux-gnu/libz.so.1")
HOST_EXE = Path(shutil.which("true") or "/bin/true")


def _interpreter(elf: Path) -> str:
    return subprocess.run(["patchelf", "--print-interpreter", str(elf)], capture_output=True, text=True,
                          check=True).stdout.strip()


def _lib_copy(tmp_path: Path, name: str, rpath: str | None, force_rpath: bool = False) -> Path:
    if not HOST_LIB.exists():
        pytest.skip(f"{HOST_LIB} not on this host")
    lib = tmp_path / name
    shutil.copyfile(HOST_LIB.resolve(), lib)
    if rpath is not None:
        subprocess.run(["patchelf", *(["--force-rpath"] if force_rpath else []), "--set-rpath", rpath, str(lib)],
                       check=True)
    return lib


def test_relocate_libraries_replaces_host_dirs_and_keeps_origin(tmp_path):
    drive = ["/opt/aenv/envd/_internal", "/opt/aenv/lib"]
    runpath = _lib_copy(tmp_path, "a.so", "$ORIGIN/../a.libs:/root/.pyenv/versions/3.11.7/lib")
    rpath = _lib_copy(tmp_path, "b.so", "/usr/local/lib", force_rpath=True)
    plain = _lib_copy(tmp_path, "c.so", None)
    before = plain.read_bytes()
    changed = toolsdrive.relocate_libraries([runpath, rpath, plain], drive)
    assert changed == [runpath, rpath]
    assert toolsdrive._dynamic_search_path(runpath) == ("RUNPATH", ["$ORIGIN/../a.libs", *drive])
    assert toolsdrive._dynamic_search_path(rpath) == ("RPATH", drive)  # the kind is kept
    assert toolsdrive._dynamic_search_path(plain) is None and plain.read_bytes() == before
    assert toolsdrive.relocate_libraries([runpath, rpath], drive) == []  # already relocated


def test_assemble_relocates_envd_and_resize2fs(tmp_path):
    """A stand-in bundle (a host executable as the bootloader, a library with a host RUNPATH):
    both executables start with the drive's loader and find their libraries on the drive, so
    they run in a root filesystem that has no C library at all."""
    if toolsdrive._host_resize2fs() is None:
        pytest.skip("resize2fs not installed")
    bundle = tmp_path / "bundle"
    (bundle / "_internal").mkdir(parents=True)
    shutil.copy2(HOST_EXE, bundle / "envd")
    _lib_copy(bundle / "_internal", "libextra.so.1", "/root/.pyenv/versions/3.11.7/lib")
    root = tmp_path / "root"
    tree = root / "opt" / "aenv"
    messages = []
    toolsdrive.assemble(tree, bundle, messages.append)

    loader = f"{toolsdrive.LIBDIR}/{toolsdrive.LOADER}"
    for exe, rpath in ((tree / "envd" / "envd", [toolsdrive.BUNDLE_LIBDIR, toolsdrive.LIBDIR]),
                       (tree / "bin" / "resize2fs", [toolsdrive.LIBDIR])):
        assert _interpreter(exe) == loader
        assert toolsdrive._dynamic_search_path(exe) == ("RPATH", rpath)
    assert toolsdrive._dynamic_search_path(tree / "envd" / "_internal" / "libextra.so.1") == \
        ("RUNPATH", [toolsdrive.BUNDLE_LIBDIR, toolsdrive.LIBDIR])
    shipped = {p.name for p in (tree / "lib").iterdir()}
    assert {toolsdrive.LOADER, "libc.so.6", "libext2fs.so.2", "libcom_err.so.2"} <= shipped
    assert (HOST_EXE.read_bytes() != (tree / "envd" / "envd").read_bytes())  # a relocated copy, not the host's
    launcher = (tree / "envd.sh").read_text()
    assert "exec /opt/aenv/envd/envd " in launcher and "--library-path" not in launcher
    assert any("relocated" in m for m in messages)

    if os.geteuid() != 0:
        pytest.skip("running the relocated binaries in a root without libc needs chroot (root)")
    assert not list(root.glob("lib*")) and not (root / "usr").exists()
    ran = subprocess.run(["chroot", str(root), "/opt/aenv/envd/envd"], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    ran = subprocess.run(["chroot", str(root), "/opt/aenv/bin/resize2fs"], capture_output=True, text=True)
    assert "resize2fs" in ran.stderr and "Usage:" in ran.stderr, ran.stderr  # it ran (no device given)


def test_recipe_inputs_do_not_depend_on_a_duplicate_distribution(monkeypatch):
    """A checkout's aenv.egg-info in the working directory lists aenv a second time: the
    tools drive's recipe (and so `base`'s hash) stays the same as without it."""
    import importlib.metadata

    once = list(importlib.metadata.distributions())
    aenv = next(d for d in once if d.metadata["Name"] == "aenv")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(once))
    plain = toolsdrive.recipe_inputs()["dists"]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter([*once, aenv]))
    assert toolsdrive.recipe_inputs()["dists"] == plain
