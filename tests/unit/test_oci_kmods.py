"""vmm.oci.kmods and prepare's part of it: which of the guest kernel's modules an OCI disk gets
(the NFS client's closure in modules.dep, decompressed, its own modules.dep), read from a real
ext4 qcow2 with debugfs, cached per kernel; and where prepare() puts them in an image tree."""

import lzma
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm.oci import kmods, prepare, tools
from vmm.oci.errors import OciError

RELEASE = "6.1.0-99-cloud-amd64"
# a kernel's module dir in small: nfsv3's chain (one module compressed, one named with a dash),
# and modules the NFS client does not need
DEP = ("kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko\n"
       "kernel/lib/crc16.ko:\n"
       "kernel/net/sunrpc/sunrpc.ko:\n"
       "kernel/fs/nfs_common/nfs-acl.ko.xz: kernel/net/sunrpc/sunrpc.ko\n"
       "kernel/fs/nfs/nfs.ko: kernel/fs/lockd/lockd.ko kernel/net/sunrpc/sunrpc.ko\n"
       "kernel/fs/lockd/lockd.ko: kernel/net/sunrpc/sunrpc.ko\n"
       "kernel/fs/nfs/nfsv3.ko: kernel/fs/nfs_common/nfs-acl.ko.xz kernel/fs/nfs/nfs.ko kernel/fs/lockd/lockd.ko "
       "kernel/net/sunrpc/sunrpc.ko\n"
       "kernel/fs/nfs/nfsv4.ko: kernel/fs/nfs/nfs.ko kernel/net/sunrpc/sunrpc.ko\n")
NFS_CHAIN = {"sunrpc", "nfs_acl", "nfs", "lockd", "nfsv3"}


def _module_tree(root: Path) -> Path:
    """``root/lib/modules/RELEASE`` as a kernel package installs it (usrmerge: /lib -> usr/lib)."""
    moddir = root / "usr/lib/modules" / RELEASE
    for line in DEP.splitlines():
        path = line.split(":")[0]
        body = f"module {kmods.module_name(path)}\n".encode() * 50
        (moddir / path).parent.mkdir(parents=True, exist_ok=True)
        (moddir / path).write_bytes(lzma.compress(body) if path.endswith(".xz") else body)
    (moddir / "modules.dep").write_text(DEP)
    (moddir / "modules.order").write_text("".join(line.split(":")[0].replace(".xz", "") + "\n"
                                                  for line in DEP.splitlines()))
    (moddir / "modules.builtin").write_text("kernel/fs/nfs_common/nfs_ssc.ko\n")
    (moddir / "modules.dep.bin").write_bytes(b"depmod's index: not shipped")
    (root / "lib").symlink_to("usr/lib")
    return moddir


def _reader(moddir: Path):
    return lambda rel: (moddir / rel).read_bytes() if (moddir / rel).is_file() else None


def test_the_nfs_closure_only_decompressed_with_its_own_modules_dep(tmp_path):
    files = kmods.select(_reader(_module_tree(tmp_path)))
    modules = {kmods.module_name(p) for p in files if p.endswith(".ko")}
    assert modules == NFS_CHAIN  # not ext4, crc16 or nfsv4
    assert files["kernel/fs/nfs_common/nfs-acl.ko"] == b"module nfs_acl\n" * 50  # decompressed, renamed .ko
    assert not any(p.endswith(".xz") or p.endswith(".bin") for p in files)
    dep = files["modules.dep"].decode().splitlines()
    assert dep == ["kernel/net/sunrpc/sunrpc.ko:",
                   "kernel/fs/nfs_common/nfs-acl.ko: kernel/net/sunrpc/sunrpc.ko",
                   "kernel/fs/nfs/nfs.ko: kernel/fs/lockd/lockd.ko kernel/net/sunrpc/sunrpc.ko",
                   "kernel/fs/lockd/lockd.ko: kernel/net/sunrpc/sunrpc.ko",
                   "kernel/fs/nfs/nfsv3.ko: kernel/fs/nfs_common/nfs-acl.ko kernel/fs/nfs/nfs.ko "
                   "kernel/fs/lockd/lockd.ko kernel/net/sunrpc/sunrpc.ko"]
    # every dependency named is shipped
    assert {d for line in dep for d in line.split(":")[1].split()} <= set(files)
    assert files["modules.order"].decode().split() == [
        "kernel/net/sunrpc/sunrpc.ko", "kernel/fs/nfs_common/nfs-acl.ko", "kernel/fs/nfs/nfs.ko",
        "kernel/fs/lockd/lockd.ko", "kernel/fs/nfs/nfsv3.ko"]
    assert files["modules.builtin"] == b"kernel/fs/nfs_common/nfs_ssc.ko\n"


def test_a_kernel_without_the_module_or_its_files_is_an_error(tmp_path):
    moddir = _module_tree(tmp_path)
    with pytest.raises(OciError, match="no module nfsv9"):
        kmods.select(_reader(moddir), roots=("nfsv9",))
    (moddir / "kernel/fs/lockd/lockd.ko").unlink()
    with pytest.raises(OciError, match="lockd.ko is listed in modules.dep but missing"):
        kmods.select(_reader(moddir))
    with pytest.raises(OciError, match="no modules.dep"):
        kmods.select(lambda rel: None)
    (moddir / "modules.dep").write_text("../../../etc/nfsv3.ko:\n")
    with pytest.raises(OciError, match="not inside the module directory"):
        kmods.select(_reader(moddir))


def test_the_id_follows_the_bytes(tmp_path):
    files = kmods.select(_reader(_module_tree(tmp_path)))
    changed = {**files, "kernel/fs/nfs/nfs.ko": b"another build"}
    assert kmods.content_id(RELEASE, files) == kmods.content_id(RELEASE, dict(reversed(files.items())))
    assert kmods.content_id(RELEASE, files) != kmods.content_id(RELEASE, changed)
    assert kmods.content_id(RELEASE, files) != kmods.content_id("6.1.0-98-cloud-amd64", files)


def _qcow2(tree: Path, out: Path) -> Path:
    raw = out.with_suffix(".raw")
    with open(raw, "wb") as f:
        f.truncate(64 << 20)
    tools.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", str(tree), str(raw)])
    tools.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out)])
    raw.unlink()
    return out


@pytest.mark.skipif(bool(tools.missing("mke2fs", "debugfs", "qemu-img")), reason="e2fsprogs or qemu-utils missing")
def test_extracted_once_per_kernel_from_the_base_images_qcow2(tmp_path):
    tree = tmp_path / "base-root"
    moddir = _module_tree(tree)
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel build 1")
    image = SimpleNamespace(name="base", kernel=kernel, kernel_release=RELEASE,
                            rootfs=_qcow2(tree, tmp_path / "rootfs.qcow2"))
    said = []
    found = kmods.for_image(tmp_path / "images", image, progress=said.append)
    assert found.release == RELEASE and set(found.modules) == NFS_CHAIN and len(said) == 1
    want = kmods.select(_reader(moddir))
    assert found.files() == sorted(want)
    assert all((found.dir / p).read_bytes() == want[p] for p in want)  # what debugfs read is the tree's bytes
    assert found.id == kmods.content_id(RELEASE, want)
    again = kmods.for_image(tmp_path / "images", image, progress=said.append)
    assert again == found and len(said) == 1  # cached: nothing extracted again
    kernel.write_bytes(b"kernel build 2")  # another kernel file: extracted anew, same modules
    other = kmods.for_image(tmp_path / "images", image, progress=said.append)
    assert len(said) == 2 and other.dir != found.dir and other.id == found.id
    with pytest.raises(OciError, match="no kernel release"):
        kmods.for_image(tmp_path / "images", SimpleNamespace(**{**vars(image), "kernel_release": "../x"}))


@pytest.mark.skipif(os.geteuid() != 0, reason="prepare() sets file owners: needs root")
def test_prepare_puts_them_in_lib_modules_of_the_image(tmp_path):
    src = tmp_path / "src"
    files = kmods.select(_reader(_module_tree(src)))
    shipped = tmp_path / "kmods" / RELEASE
    for rel, data in files.items():
        (shipped / rel).parent.mkdir(parents=True, exist_ok=True)
        (shipped / rel).write_bytes(data)
    modules = kmods.KernelModules(release=RELEASE, dir=shipped, id=kmods.content_id(RELEASE, files),
                                  modules=tuple(sorted(NFS_CHAIN)))

    usrmerged = tmp_path / "usrmerged"  # Debian's layout: written through /lib -> usr/lib
    (usrmerged / "usr/lib").mkdir(parents=True)
    (usrmerged / "lib").symlink_to("usr/lib")
    done = prepare.prepare(usrmerged, 1_700_000_000, modules)
    assert done["kernel_modules"]["added"] is True and done["kernel_modules"]["id"] == modules.id
    target = usrmerged / "usr/lib/modules" / RELEASE
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == sorted(files)
    assert (target / "modules.dep").read_bytes() == files["modules.dep"]
    st = (target / "kernel/fs/nfs/nfsv3.ko").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777, int(st.st_mtime)) == (0, 0, 0o644, 1_700_000_000)

    own = tmp_path / "own"  # an image made from aenv's base: its own module tree is kept as it is
    (own / "lib/modules" / RELEASE).mkdir(parents=True)
    (own / "lib/modules" / RELEASE / "modules.dep").write_text("theirs\n")
    done = prepare.prepare(own, 1_700_000_000, modules)
    assert done["kernel_modules"]["added"] is False and "its own" in done["kernel_modules"]["why"]
    assert (own / "lib/modules" / RELEASE / "modules.dep").read_text() == "theirs\n"

    odd = tmp_path / "odd"  # /lib a file: no modules (volumes refused), the disk is still made
    odd.mkdir()
    (odd / "lib").write_text("not a directory")
    done = prepare.prepare(odd, 1_700_000_000, modules)
    assert done["kernel_modules"]["added"] is False and "a file is in the way" in done["kernel_modules"]["why"]
    assert "kernel_modules" not in prepare.prepare(tmp_path / "src", 1_700_000_000)  # none asked: none added


def test_the_mount_falls_back_to_the_tools_drives_modprobe():
    from vmm.net import volume_server

    script = volume_server.mount_script([("/1", "/mnt/data")])
    first = script.splitlines()[1]
    assert first.startswith("modprobe nfsv3 ") and "/opt/aenv/bin/busybox modprobe nfsv3" in first
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
