"""Turns a directory tree into an ext4 root disk (label ``aenv-root``) and a qcow2 base, deterministically.

Why deterministic: a template snapshot's disk chain sits on this base and is restored on other
nodes (the S3 snapshot store); they build the base themselves from the same image digest, so
the bytes must be identical: same inputs -> same sha256, on any node, at any time.

What would differ between two builds, and how it is pinned:

* mke2fs's defaults (host /etc/mke2fs.conf): our own config (MKE2FS_CONFIG) and explicit block
  size, inode size, feature list, inode count and size; the size comes from the tree's file
  sizes and entry counts only (never from directory sizes, which depend on the host fs).
* Random filesystem UUID and directory hash seed: both derived from a seed string (the image
  digest and the converter's key) with ``-U`` and ``-E hash_seed=``.
* Times mke2fs takes from the clock (superblock, lost+found, inode creation times):
  ``E2FSPROGS_FAKE_TIME`` = the epoch.
* Times mke2fs copies from the tree: mtime comes from the image (vmm.oci.unpack pins it);
  ctime cannot be set on the host and atime moves whenever anything reads the tree (walking
  it to size the filesystem does), so after mke2fs every in-use inode's ctime and atime are
  rewritten to the epoch with ``debugfs -w`` (``sif <ino> ctime|atime``; in-use inodes read
  from the inode bitmaps with ``dumpe2fs``). Sub-second parts are not copied by mke2fs 1.47.
* Directory order: ``mke2fs -d`` sorts entries (scandir + alphasort) under LC_ALL=C.
* Lazily initialised inode tables or journal (whether mke2fs zeroes them depends on the host
  filesystem's discard support): ``lazy_itable_init=0,lazy_journal_init=0``.
* qcow2: ``qemu-img convert`` writes clusters in order with no timestamps; its options pinned.

Not pinned: the tools themselves. Another e2fsprogs or qemu-img version may lay out other bytes,
so their versions are part of the disk key (vmm.oci.disks). The superblock's "lifetime writes"
counter counts the bytes the tools wrote, the same for the same tools on the usual Linux
filesystems (all of which punch holes in files).

``e2fsck -fn`` checks the result before it is used.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import uuid
from pathlib import Path

from vmm.oci import tools
from vmm.oci.errors import OciError

LABEL = "aenv-root"
BLOCK = 4096
INODE_SIZE = 256
FEATURES = "has_journal,extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize"
MIN_SIZE_MB = 2048        # the base image's size (vmm.rootfs.ROOTFS_SIZE_MB) and a Template's default disk
FREE_MB = 512             # at least this much free space over the image's files
ROUND_MB = 256
BYTES_PER_INODE = 16384
MKE2FS_CONF = f"""[defaults]
\tbase_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
\tdefault_mntopts = acl,user_xattr
\tenable_periodic_fsck = 0
\tblocksize = {BLOCK}
\tinode_size = {INODE_SIZE}
\tinode_ratio = {BYTES_PER_INODE}
\treserved_ratio = 0

[fs_types]
\text4 = {{
\t\tfeatures = {FEATURES}
\t}}
"""


def usage(root: Path) -> tuple[int, int]:
    """(bytes, inodes) the tree needs, from what the image determines only: regular file sizes
    (hard links once), a block per directory plus its entries' names, long symlink targets."""
    total, inodes, seen = 0, 0, set()
    for dirpath, dirnames, filenames in os.walk(root):
        names = dirnames + filenames
        total += BLOCK * max(1, math.ceil(sum(len(n) + 16 for n in names) / BLOCK))
        inodes += 1
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISDIR(st.st_mode):
                continue
            if st.st_nlink > 1:
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
            inodes += 1
            if stat.S_ISREG(st.st_mode):
                total += BLOCK * math.ceil(st.st_size / BLOCK)
            elif stat.S_ISLNK(st.st_mode) and st.st_size >= 60:
                total += BLOCK
    return total, inodes


def geometry(used_bytes: int, inodes: int, min_size_mb: int = MIN_SIZE_MB) -> tuple[int, int]:
    """(size in MiB, inode count) for a tree of that usage: its data + 10% + the inode tables
    + a journal's worth + FREE_MB, rounded up to ROUND_MB, at least min_size_mb; inodes: the
    default ratio or 1.5x the tree's + 16384, whichever is more."""
    count = max(inodes + inodes // 2 + 16384, 0)
    need_mb = (used_bytes * 1.1 + count * INODE_SIZE) / 2**20 + 128 + FREE_MB
    size_mb = max(min_size_mb, ROUND_MB * math.ceil(need_mb / ROUND_MB))
    count = max(count, (size_mb << 20) // BYTES_PER_INODE)
    return size_mb, count


def ids(seed: str) -> tuple[str, str]:
    """(filesystem UUID, directory hash seed) derived from `seed` (random-looking v4 UUIDs)."""
    def one(label: str) -> str:
        return str(uuid.UUID(bytes=hashlib.sha256(f"{label}:{seed}".encode()).digest()[:16], version=4))
    return one("aenv-ext4-uuid"), one("aenv-ext4-hash-seed")


def _env(work: Path, epoch: int) -> dict:
    conf = work / "mke2fs.conf"
    conf.write_text(MKE2FS_CONF)
    return {"MKE2FS_CONFIG": str(conf), "E2FSPROGS_FAKE_TIME": str(epoch), "SOURCE_DATE_EPOCH": str(epoch)}


def make_ext4(tree: Path, raw: Path, seed: str, epoch: int, work: Path, min_size_mb: int = MIN_SIZE_MB) -> dict:
    """Writes the ext4 image of `tree` to `raw`; returns its facts (size, inodes, uuid)."""
    used, inodes = usage(tree)
    size_mb, inode_count = geometry(used, inodes, min_size_mb)
    fs_uuid, hash_seed = ids(seed)
    env = _env(work, epoch)
    raw.unlink(missing_ok=True)
    with open(raw, "wb") as f:
        f.truncate(size_mb << 20)
    tools.run(["mke2fs", "-q", "-F", "-t", "ext4", "-b", str(BLOCK), "-I", str(INODE_SIZE), "-N", str(inode_count),
               "-O", FEATURES, "-L", LABEL, "-m", "0", "-U", fs_uuid,
               "-E", f"hash_seed={hash_seed},lazy_itable_init=0,lazy_journal_init=0",
               "-d", str(tree), str(raw)], env=env)
    fixed = fix_times(raw, epoch, env)
    check(raw, env)
    return {"size_mb": size_mb, "inodes": inode_count, "used_bytes": used, "uuid": fs_uuid, "times_fixed": fixed}


def in_use_inodes(raw: Path, env: dict) -> list[int]:
    """Inode numbers the bitmaps mark used, without the reserved ones but root (2)."""
    out = tools.run(["dumpe2fs", str(raw)], env=env).stdout
    m = re.search(r"^Inode count:\s+(\d+)", out, re.M)
    first = re.search(r"^First inode:\s+(\d+)", out, re.M)
    if not m or not first:
        raise OciError(f"dumpe2fs {raw}: no inode count in its output")
    count, first_ino = int(m.group(1)), int(first.group(1))
    free = bytearray(count + 1)
    for line in re.findall(r"^\s+Free inodes: (.*)$", out, re.M):
        for part in line.split(","):
            part = part.strip()
            if part:
                lo, _, hi = part.partition("-")
                free[int(lo):int(hi or lo) + 1] = b"\1" * (int(hi or lo) + 1 - int(lo))
    return [i for i in range(1, count + 1) if not free[i] and (i == 2 or i >= first_ino)]


def fix_times(raw: Path, epoch: int, env: dict) -> int:
    """Sets every in-use inode's ctime and atime to `epoch` (mke2fs copied the host's);
    returns how many inodes."""
    inodes = in_use_inodes(raw, env)
    script = raw.with_suffix(".debugfs")
    script.write_text("".join(f"sif <{i}> ctime @{epoch}\nsif <{i}> atime @{epoch}\n" for i in inodes))
    proc = tools.run(["debugfs", "-w", "-f", str(script), str(raw)], env=env)
    script.unlink()
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("debugfs ")]
    if errors:
        raise OciError(f"debugfs could not set inode times: {errors[:3]}")
    return len(inodes)


def check(raw: Path, env: dict) -> None:
    proc = tools.run(["e2fsck", "-fn", str(raw)], env=env, check=False)
    if proc.returncode != 0:
        raise OciError(f"e2fsck found problems in the built filesystem ({proc.returncode}): "
                       f"{(proc.stdout + proc.stderr).strip()[-1500:]}")


def to_qcow2(raw: Path, out: Path) -> None:
    """The qcow2 base drivers put sandbox tops over (options pinned; see the module docstring)."""
    out.unlink(missing_ok=True)
    tools.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "-S", "4k",
               "-o", "compat=1.1,cluster_size=65536,lazy_refcounts=off,refcount_bits=16,preallocation=off",
               str(raw), str(out)])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
