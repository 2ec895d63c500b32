"""Builds the template's operating system: debootstrap rootfs, guest kernel, mini initramfs, qcow2 base.

Why separate from the tools drive: debootstrap is slow and network-bound (~1 min), so its result
is cached on its own and only rebuilt when the package recipe changes.
"""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
from pathlib import Path

GUEST_DIR = Path(__file__).parent / "guest"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# debootstrap --include: what the guest boots with and what envd's callers assume.
PACKAGES = [
    "bash", "coreutils", "procps", "iproute2", "ca-certificates", "python3", "git", "curl", "sudo",
    "ncurses-bin", "attr", "e2fsprogs", "kmod", "less", "linux-image-cloud-amd64",
]
# What E2B's base image gives a sandbox user on top (issue 11, item 6): python (-> python3) with
# pip, venv and headers, Node.js + npm, a C/C++ toolchain, and the tools E2B's provisioning
# installs and its SDK's ready-check helpers call (ss and pgrep are in PACKAGES). All from Debian
# (only Debian's, PyPI's and npm's registries are reachable), installed by apt-get inside the new
# rootfs: debootstrap's resolver does not follow virtual packages (npm's node-* dependencies).
USER_PACKAGES = [
    "python-is-python3", "python3-pip", "python3-venv", "python3-dev", "nodejs", "npm", "build-essential",
    "jq", "iputils-ping", "socat", "unzip", "wget", "tar", "gzip", "xz-utils",
]
# Loaded in this order by the initramfs (dependencies first).
INITRAMFS_MODULES = [
    "virtio", "virtio_ring", "virtio_mmio", "virtio_blk", "failover", "net_failover", "virtio_net",
    "virtio_balloon",
]
# The template default disk (AENV_BASE_DISK_MB, setup.sh's --disk): a bigger base would give every
# sandbox more than its disk_size_mb says; bigger disks are grown at boot (aenv.resize). With
# USER_PACKAGES the tree is ~900 MiB / ~42k files, leaving ~1 GiB free.
ROOTFS_SIZE_MB = 2048
# One inode per 8 KiB, not mke2fs's 16 KiB: node_modules and site-packages are many small files and
# would run out of inodes (131k at 2 GiB, a third taken by the image) long before blocks.
ROOTFS_BYTES_PER_INODE = 8192
USER_SETUP = """set -e
useradd -m -u 1000 -U -s /bin/bash user
usermod -aG sudo user
passwd -d user >/dev/null
passwd -l root >/dev/null
echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/aenv-user
chmod 0440 /etc/sudoers.d/aenv-user
# Debian marks its Python externally managed (PEP 668), so a plain `pip install` would refuse.
# E2B users expect it to work: as `user` pip then installs into ~/.local (site-packages is not
# theirs), as root into /usr/local/lib/python3*/dist-packages (Debian's pip never writes /usr/lib).
# A config file rather than deleting EXTERNALLY-MANAGED: it survives python3 package upgrades.
printf '[global]\\nbreak-system-packages = true\\n' > /etc/pip.conf
# ~/.profile puts ~/.local/bin on PATH only if it exists when the login shell starts: create it,
# so scripts pip installs are found even by the command that installs them.
install -d -o user -g user /home/user/.local /home/user/.local/bin
echo aenv > /etc/hostname
printf '127.0.0.1 localhost\\n127.0.1.1 aenv\\n::1 localhost ip6-localhost ip6-loopback\\n' > /etc/hosts
mkdir -p /opt/aenv /code
chmod 1777 /tmp
rm -f /boot/initrd.img* /var/cache/apt/archives/*.deb /var/cache/apt/*.bin
rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/*.log /usr/share/doc/* /usr/share/man/* \\
    /usr/share/info/* /usr/share/lintian/* /usr/share/locale/*
"""


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Runs a build command, surfacing its output when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def recipe_inputs() -> dict:
    """Everything that changes the debootstrap result (fed to the recipe hash)."""
    return {"suite": SUITE, "mirror": MIRROR, "packages": PACKAGES, "user_packages": USER_PACKAGES,
            "user_setup": USER_SETUP, "v": 1}


def system_inputs() -> dict:
    """Everything that changes kernel/initramfs/qcow2 on top of a given debootstrap."""
    init = (GUEST_DIR / "initramfs_init.sh").read_text()
    return {"modules": INITRAMFS_MODULES, "size_mb": ROOTFS_SIZE_MB, "bytes_per_inode": ROOTFS_BYTES_PER_INODE,
            "initramfs_init": init, "initrd_addr_max": INITRD_ADDR_MAX, "v": 1}


def debootstrap(out: Path, progress) -> None:
    """Creates out/rootfs (customized, caches removed). Runs as root."""
    rootfs = out / "rootfs"
    progress(f"debootstrap {SUITE} (minbase, {len(PACKAGES)} packages) from {MIRROR}")
    run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), MIRROR])
    progress(f"apt-get install {len(USER_PACKAGES)} packages (python tooling, Node.js, toolchain, CLI tools)")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8"}
    run(["chroot", str(rootfs), "apt-get", "update", "-q"], env=env)
    run(["chroot", str(rootfs), "apt-get", "install", "-y", "-q", "--no-install-recommends", *USER_PACKAGES], env=env)
    progress("customizing rootfs (user account, sudo, hostname, cleanup)")
    run(["chroot", str(rootfs), "/bin/sh", "-c", USER_SETUP])


def kernel_release(rootfs: Path) -> str:
    """The single kernel installed in the rootfs."""
    releases = sorted(p.name for p in (rootfs / "lib/modules").iterdir())
    if len(releases) != 1:
        raise RuntimeError(f"expected one kernel in rootfs, found {releases}")
    return releases[0]


def _find_module(moddir: Path, name: str) -> Path:
    for suffix in (".ko", ".ko.xz"):
        hits = list(moddir.rglob(name + suffix)) or list(moddir.rglob(name.replace("_", "-") + suffix))
        if hits:
            return hits[0]
    raise RuntimeError(f"module {name} not found under {moddir}")


def build_initramfs(rootfs: Path, out_cpio: Path, work: Path) -> None:
    """Static busybox + the virtio modules from the rootfs + our init, as an uncompressed cpio."""
    release = kernel_release(rootfs)
    tree = work / "initramfs"
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", tree / "bin/busybox")
    for applet in ("sh", "mount", "insmod", "switch_root", "findfs", "mkdir", "usleep", "sleep", "cat",
                   "grep", "ls", "echo", "poweroff"):
        os.symlink("busybox", tree / "bin" / applet)
    moddir = rootfs / "lib/modules" / release
    for name in INITRAMFS_MODULES:
        src = _find_module(moddir, name)
        data = src.read_bytes()
        if src.suffix == ".xz":
            data = lzma.decompress(data)
        (tree / "lib/modules" / f"{name}.ko").write_bytes(data)
    (tree / "modules.order").write_text("\n".join(INITRAMFS_MODULES) + "\n")
    init = tree / "init"
    shutil.copy2(GUEST_DIR / "initramfs_init.sh", init)
    init.chmod(0o755)
    write_cpio(tree, out_cpio)


def write_cpio(tree: Path, out: Path) -> None:
    """Writes `tree` as a newc cpio archive (what the kernel unpacks as initramfs); root-owned."""

    def entry(f, ino: int, name: str, mode: int, data: bytes) -> None:
        nameb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nameb), 0]
        header = b"070701" + b"".join(b"%08x" % v for v in fields)
        f.write(header + nameb + b"\0" * (-(len(header) + len(nameb)) % 4))
        f.write(data + b"\0" * (-len(data) % 4))

    with open(out, "wb") as f:
        ino = 1
        for p in sorted(tree.rglob("*")):
            st = p.lstat()
            if p.is_symlink():
                data = os.readlink(p).encode()
            elif p.is_file():
                data = p.read_bytes()
            else:
                data = b""
            entry(f, ino, str(p.relative_to(tree)), st.st_mode, data)
            ino += 1
        entry(f, 0, "TRAILER!!!", 0, b"")


# Linux x86 boot protocol: the setup header's magic "HdrS" at 0x202, its version at 0x206 and,
# from 2.03 on, initrd_addr_max (the highest byte a boot loader may put the initrd at) at 0x22c.
BOOT_HEADER_MAGIC = (0x202, b"HdrS")
BOOT_PROTOCOL_OFFSET = 0x206
INITRD_ADDR_MAX_OFFSET = 0x22C
# Why: QEMU 10 (microvm) reserves the last 4 KiB below 2 GiB for its ACPI tables yet, when the
# kernel's initrd_addr_max is exactly the last byte of RAM (0x7fffffff, Debian's kernels, a
# 2048 MiB guest), loads the initrd right up to it: the tables overwrite the initramfs's tail
# and the guest boots without its disks (docs/benchmarks.md, "QEMU 10.0"). 64 KiB lower, no
# RAM size in whole MiB ends there, and QEMU keeps its usual 64 KiB gap below the top.
INITRD_ADDR_MAX = 0x7FFEFFFF


def cap_initrd_addr_max(kernel: Path, cap: int = INITRD_ADDR_MAX) -> bool:
    """Lowers a bzImage's initrd_addr_max to ``cap`` in place (True if it changed). Only the
    boot loader (QEMU) reads the field; the kernel itself does not. Not a bzImage, or a boot
    protocol before 2.03: unchanged."""
    with open(kernel, "r+b") as f:
        header = f.read(INITRD_ADDR_MAX_OFFSET + 4)
        at, magic = BOOT_HEADER_MAGIC
        if len(header) < INITRD_ADDR_MAX_OFFSET + 4 or header[at:at + 4] != magic:
            return False
        if int.from_bytes(header[BOOT_PROTOCOL_OFFSET:BOOT_PROTOCOL_OFFSET + 2], "little") < 0x203:
            return False
        if int.from_bytes(header[INITRD_ADDR_MAX_OFFSET:INITRD_ADDR_MAX_OFFSET + 4], "little") <= cap:
            return False
        f.seek(INITRD_ADDR_MAX_OFFSET)
        f.write(cap.to_bytes(4, "little"))
    return True


def build_system(rootfs: Path, out: Path, work: Path, progress) -> str:
    """Writes out/{vmlinuz,initrd.cpio,rootfs.qcow2}; returns the guest kernel release."""
    release = kernel_release(rootfs)
    progress(f"guest kernel {release}; building mini initramfs")
    shutil.copy2(rootfs / "boot" / f"vmlinuz-{release}", out / "vmlinuz")
    cap_initrd_addr_max(out / "vmlinuz")
    build_initramfs(rootfs, out / "initrd.cpio", work)
    raw = work / "rootfs.ext4"
    progress(f"mkfs.ext4 -d rootfs into {ROOTFS_SIZE_MB} MiB sparse file")
    with open(raw, "wb") as f:
        f.truncate(ROOTFS_SIZE_MB << 20)
    run(["mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-m", "0", "-i", str(ROOTFS_BYTES_PER_INODE), "-d", str(rootfs),
         str(raw)])
    progress("converting to qcow2 base")
    run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out / "rootfs.qcow2")])
    raw.unlink()
    return release
