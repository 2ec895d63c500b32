"""A sandbox's volume server: NFSv3 (nfs-ganesha, FSAL VFS) inside the sandbox's own slot,
exporting only the volumes that sandbox mounts, reachable only from its guest, behind a guard
that lets through only file handles it signed.

Why NFS over the slot network (docs/volumes.md has the measurements): the guest's NFS client
lives in guest memory and speaks to a fixed address (the slot's gateway, the same in every
slot), so pause to disk, snapshots and forks — all QEMU migrations — carry it like any TCP
client; virtio-fs and virtio-9p devices block QEMU's migration. NFSv3 is stateless: a
resumed or forked guest's client reconnects to the new slot's server and its file handles
(kernel handles of the same host directories, tagged with per-volume keys) are still good.
Locks (NLM) are off: a lock is local to one guest.

Fences (docs/security.md#volumes), all outside the guest:

- the guest talks to ``nfs_guard`` (unprivileged, uid nobody), never to ganesha: ganesha
  resolves a handle to any inode of the export's filesystem (``open_by_handle_at``), so the
  guard refuses every handle whose tag is not good for one of this sandbox's volumes;
- ganesha listens on the slot's loopback only, in the slot's netns (the slot's table lets the
  guest reach the gateway's NFS and MOUNT ports, nothing else there);
- ganesha, its rpcbind and the guard run in a pid namespace and a mount namespace whose root
  is a small tmpfs: ``/usr`` read-only, a few ``/etc`` files, and the sandbox's volume
  directories bind-mounted ``nosuid,nodev`` — no other path of the node exists there;
- ganesha keeps only CAP_DAC_READ_SEARCH (``open_by_handle_at``), CAP_SETUID and CAP_SETGID
  (it acts as each caller's uid), and CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_CHOWN (it opens files and
  sets attributes as root after checking the caller's permission itself), with ``no_new_privs``; it and the guard run under a seccomp
  filter (``syscall_fence``: no namespaces, mounts, ptrace, BPF, io_uring, keyrings, …);
- guest root is squashed to the volumes' owner (no device nodes, no root-owned files on the
  node), every other uid is kept."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .slots import GATEWAY_IP, GUEST_IP, TAP, Slot, SlotError

NFS_PORT = 2049      # the guard's, where the guest connects
MOUNT_PORT = 20048
SERVER_NFS_PORT = 12049    # ganesha's, on the slot's loopback only
SERVER_MOUNT_PORT = 12048
GANESHA = "ganesha.nfsd"
RPCBIND = "rpcbind"
EXPORTS_DIR = "/exports"   # where the volumes are inside the server's root
GUARD = Path(__file__).with_name("nfs_guard.py")
FENCE = Path(__file__).with_name("syscall_fence.py")  # the seccomp filter both run under
# What ganesha keeps: open_by_handle_at, acting as each caller's uid and gids, and what it does as
# root on the caller's behalf once its own permission check passed (FSAL VFS opens an existing
# file, sets attributes and links as root): without DAC_OVERRIDE a guest could write no file
# that this server instance had not created itself — every file after a resume (the bench's
# "appends stop after a pause"), every file the content API wrote — and without FOWNER / CHOWN
# no chmod, utimes, truncate, hard link or chgrp of it. ganesha refuses other callers' files,
# root is squashed, so no guest gains a uid it could not claim anyway. Never MKNOD, never FSETID.
GANESHA_CAPS = ("dac_read_search", "dac_override", "fowner", "chown", "setuid", "setgid")
NOBODY = 65534
_ETC = ("netconfig", "nsswitch.conf", "hosts", "host.conf", "protocols", "services")


@dataclass(frozen=True)
class Export:
    export_id: int  # stable per volume of this sandbox: part of the NFS file handles
    path: str       # the volume's directory on the node
    pseudo: str     # how the guest names it in its mount (``/<volume id>``)
    key: bytes = field(default=b"", repr=False)  # the volume's handle key (``nfs_guard.volume_key``)


def available() -> str | None:
    """Why volume mounts cannot be served on this node, or None."""
    for tool in (GANESHA, RPCBIND, "unshare", "nsenter", "setpriv", "pivot_root"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs nfs-ganesha-vfs)"
    if _python() is None:
        return "no python3 under /usr for the volume guard"
    if os.geteuid() != 0:
        return "the node does not run as root"
    return None


def _python() -> str | None:
    """A python3 inside ``/usr``, the only tree the server's root shows (the guard is stdlib only)."""
    found = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    return os.path.realpath(found) if found and os.path.realpath(found).startswith("/usr/") else None


def config(exports: list[Export], uid: int, gid: int) -> str:
    """ganesha.conf: NFSv3 over TCP only on the slot's loopback (the guard forwards to it), no
    locks, no quotas, no NFSv4 state to recover; paths as the server's root shows them.
    Attributes are never answered from ganesha's cache (``Attr_Expiration_Time = 0``; 60 s by
    default): other sandboxes' servers and the content API change the same files, and a guest
    opening a file must get its size now (close-to-open), not the one this server last saw."""
    blocks = []
    for e in exports:
        blocks.append(f"""EXPORT {{
  Export_Id = {e.export_id};
  Path = "{EXPORTS_DIR}/{e.export_id}";
  Pseudo = "{e.pseudo}";
  Protocols = 3;
  Transports = TCP;
  Access_Type = RW;
  Squash = Root_Squash;
  Anonymous_Uid = {uid};
  Anonymous_Gid = {gid};
  SecType = sys;
  Attr_Expiration_Time = 0;
  FSAL {{ Name = VFS; }}
}}
""")
    return f"""NFS_CORE_PARAM {{
  Protocols = 3;
  Bind_addr = 127.0.0.1;
  Mount_Path_Pseudo = true;
  NFS_Port = {SERVER_NFS_PORT};
  MNT_Port = {SERVER_MOUNT_PORT};
  Enable_NLM = false;
  Enable_RQUOTA = false;
  Enable_UDP = false;
}}
NFSV4 {{ Graceless = true; }}
NFS_KRB5 {{ Active_krb5 = false; }}
MDCACHE {{ Entries_HWMark = 10000; }}
LOG {{ Default_Log_Level = WARN; }}
{"".join(blocks)}"""


# Run inside the slot's netns, a new mount namespace and a new pid namespace (its /proc shows
# only the server's processes). $1: the new root's mount point, $2: the run dir, $3: python3;
# then "<export id>=<path>" pairs. The guard's keys come on stdin.
# Nothing of the node's filesystems stays open in ganesha (open_by_handle_at takes any fd as
# the way into a filesystem): /usr is a read-only overlay (a filesystem of its own that decodes
# no handles), its log and output are on a tmpfs, its stdin is /dev/null (devtmpfs); only the
# exports are binds of the volume store.
_LAUNCH = """set -eu
exec 3<&0  # the keys, for the guard (an asynchronous command's stdin would be /dev/null)
root=$1 run=$2 python=$3
shift 3
mount --make-rprivate /
mount -t tmpfs -o size=4m,mode=0755,nosuid,nodev aenv-volumes "$root"
cd "$root"
mkdir -p usr etc dev proc log run/rpcbind var/lib/nfs/ganesha tmp {exports} old .empty
chmod 1777 tmp
ln -s usr/bin bin; ln -s usr/sbin sbin; ln -s usr/lib lib; ln -s usr/lib64 lib64; ln -s ../run var/run
# (var/run: ganesha registers with rpcbind through /var/run/rpcbind.sock; without it, and without
# IPv6 in the slot, it cannot register and exits)
mount -t overlay -o ro,nosuid,nodev,lowerdir=/usr:$root/.empty aenv-usr usr
for f in {etc}; do if [ -e /etc/$f ]; then cp /etc/$f etc/; fi; done
rpc_uid=$(id -u _rpc 2>/dev/null || echo {nobody})
{{ echo "root:x:0:0::/:/usr/sbin/nologin"; echo "_rpc:x:$rpc_uid:{nobody}::/run/rpcbind:/usr/sbin/nologin"
  echo "nobody:x:{nobody}:{nobody}::/:/usr/sbin/nologin"; }} > etc/passwd
{{ echo "root:x:0:"; echo "nogroup:x:{nobody}:"; }} > etc/group
ln -s /proc/self/mounts etc/mtab
# its own device nodes on a tmpfs of their own: a bind of the node's /dev/null would be a way
# (open_by_handle_at) into the node's devtmpfs, disks included
mount -t tmpfs -o size=64k,mode=0755,nosuid,noexec aenv-dev dev
mknod -m 666 dev/null c 1 3; mknod -m 666 dev/zero c 1 5; mknod -m 666 dev/random c 1 8
mknod -m 666 dev/urandom c 1 9
mount -o remount,ro,nosuid,noexec dev
for pair in "$@"; do
  id=${{pair%%=*}} src=${{pair#*=}}
  mkdir -p "{exports_rel}/$id"
  mount --bind "$src" "{exports_rel}/$id"
  mount -o remount,bind,nosuid,nodev "{exports_rel}/$id"
done
cp "$run/ganesha.conf" etc/ganesha.conf
cp {guard} guard.py
cp {fence} fence.py
mount -t tmpfs -o size=2m,mode=0700,nosuid,nodev,noexec aenv-log log
mount -t proc -o nosuid,nodev,noexec proc proc
pivot_root . old
cd /
umount -l /old
rmdir /old
rpcbind -h {gateway} 3<&-
setpriv --reuid={nobody} --regid={nobody} --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all \\
  "$python" -I -S /fence.py "$python" -I -S /guard.py \\
  --listen {gateway} --nfs {nfs}:{server_nfs} --mount {mnt}:{server_mnt} <&3 3<&- &
exec 3<&-
setpriv --no-new-privs --inh-caps=-all --bounding-set=-all,{caps} "$python" -I -S /fence.py --no-ipv6 \\
  {ganesha} -F -f /etc/ganesha.conf -L /log/ganesha.log -p /run/ganesha.pid </dev/null >>/log/ganesha.log 2>&1 &
ganesha=$!
trap 'kill -TERM $ganesha 2>/dev/null || true' TERM INT  # this shell is the namespace's init
status=0
while kill -0 $ganesha 2>/dev/null; do wait $ganesha || status=$?; done
tail -n 5 /log/ganesha.log >&2
exit $status
"""


def launch_script() -> str:
    return _LAUNCH.format(exports=EXPORTS_DIR.lstrip("/"), exports_rel=EXPORTS_DIR.lstrip("/"), etc=" ".join(_ETC),
                          nobody=NOBODY, guard=shlex.quote(str(GUARD)), fence=shlex.quote(str(FENCE)),
                          gateway=GATEWAY_IP, nfs=NFS_PORT, server_nfs=SERVER_NFS_PORT, mnt=MOUNT_PORT,
                          server_mnt=SERVER_MOUNT_PORT, caps=",".join(f"+{c}" for c in GANESHA_CAPS), ganesha=GANESHA)


def _pid_file(run_dir: Path) -> Path:
    return run_dir / "server.pid"


def start(slot: Slot, exports: list[Export], run_dir: Path, *, uid: int = 1000, gid: int = 1000,
          timeout: float = 10.0) -> int:
    """Starts the slot's server (replacing one already there) and waits until it listens;
    returns its pid. SlotError when it does not come up."""
    stop(run_dir)
    python = _python()
    if python is None:
        raise SlotError("no python3 under /usr for the volume guard")
    if any(not e.key for e in exports):
        raise SlotError("every export needs its handle key")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "root").mkdir(exist_ok=True)
    conf, log = run_dir / "ganesha.conf", run_dir / "launch.log"
    conf.write_text(config(exports, uid, gid))
    argv = slot.nsenter("unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c",
                        launch_script(), "aenv-volumes", str(run_dir / "root"), str(run_dir), python,
                        *(f"{e.export_id}={e.path}" for e in exports))
    keys = json.dumps({e.pseudo: e.key.hex() for e in exports}).encode()
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True)
    _pid_file(run_dir).write_text(str(proc.pid))
    try:
        proc.stdin.write(keys)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SlotError(f"volume server of {slot.netns} exited ({proc.returncode}): {_tail(log)}")
        if _listening(slot):
            return proc.pid
        time.sleep(0.05)
    stop(run_dir)
    raise SlotError(f"volume server of {slot.netns} did not listen within {timeout} s: {_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-3:])
    except OSError:
        return "(no log)"


def _listening(slot: Slot) -> bool:
    """Both the guard (the guest's ports) and ganesha behind it listen."""
    done = subprocess.run(slot.nsenter("ss", "-Hltn"), capture_output=True, text=True, timeout=10)
    ports = {line.split()[3].rsplit(":", 1)[-1] for line in done.stdout.splitlines() if len(line.split()) > 3}
    wanted = {str(p) for p in (NFS_PORT, MOUNT_PORT, SERVER_NFS_PORT, SERVER_MOUNT_PORT)}
    return done.returncode == 0 and wanted <= ports


def stop(run_dir: Path) -> bool:
    """Stops the server started in ``run_dir`` (its whole process group: ganesha, its rpcbind
    and the guard). False if none was running."""
    pid_file = _pid_file(run_dir)
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return False
    stopped = False
    # SIGTERM gets 2 s; a SIGKILLed process still has to be scheduled to die, which on a loaded
    # host takes a while: wait up to 10 s for that, so a stopped server is gone when this returns
    for sig, polls in ((signal.SIGTERM, 40), (signal.SIGKILL, 200)):
        try:
            os.killpg(pid, sig)
            stopped = True
        except ProcessLookupError:
            break
        for _ in range(polls):
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            continue
        break
    pid_file.unlink(missing_ok=True)
    return stopped


def open_ports_script() -> str:
    """nft lines for the slot's table: the guest may reach its gateway's NFS and MOUNT
    ports (before the always-denied drop: the gateway is link-local), nothing else there."""
    ports = f"{{ {NFS_PORT}, {MOUNT_PORT} }}"
    return (f'insert rule inet aenv guard iifname "{TAP}" ip saddr {GUEST_IP} ip daddr {GATEWAY_IP} '
            f"tcp dport {ports} accept\n"
            f'insert rule inet aenv to_slot iifname "{TAP}" ip daddr {GATEWAY_IP} tcp dport {ports} accept\n')


def open_ports(slot: Slot) -> None:
    done = subprocess.run(slot.nsenter("nft", "-f", "-"), input=open_ports_script(), capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        raise SlotError(f"opening the volume ports of {slot.netns} failed: {done.stderr.strip()}")


TOOLS_BUSYBOX = "/opt/aenv/bin/busybox"  # the tools drive's (vmm.toolsdrive), in every guest
NO_NFS_EXIT = 3  # the mount script's exit when the guest cannot mount NFS at all (no modules)
# hard: a server being restarted (a resume, a fork child's new slot) is waited for, never an
# I/O error; timeo=10 (1 s) so a guest whose old connection vanished retries soon; actimeo=1:
# another sandbox's change to a directory or a file's attributes shows within a second
# (opening a file always revalidates it: NFS's close-to-open consistency).
MOUNT_OPTIONS = (f"vers=3,proto=tcp,port={NFS_PORT},mountport={MOUNT_PORT},mountproto=tcp,nolock,hard,timeo=10,"
                 f"actimeo=1,addr={GATEWAY_IP},mountaddr={GATEWAY_IP}")


def mount_script(mounts: list[tuple[str, str]]) -> str:
    """What the guest runs as root to mount ``[(pseudo, path)]`` from its gateway: the
    kernel's own NFS client (module from the template's /lib/modules), no helper binary
    (``mount -i``), hard mounts (a paused server is waited for, never an I/O error)."""
    # modprobe: the image's, else the tools drive's busybox (most OCI images have none; their
    # disks carry the kernel's NFS modules with a text modules.dep: vmm.oci.kmods)
    lines = ["set -e", f"modprobe nfsv3 2>/dev/null || {TOOLS_BUSYBOX} modprobe nfsv3 2>/dev/null || "
             "modprobe nfs 2>/dev/null || true",
             f"grep -qw nfs /proc/filesystems || {{ echo 'the guest kernel has no NFS client'; exit {NO_NFS_EXIT}; }}"]
    for pseudo, path in mounts:
        lines.append(f"mkdir -p {shlex.quote(path)}")
        lines.append(f"mount -i -t nfs -o {MOUNT_OPTIONS} {shlex.quote(GATEWAY_IP + ':' + pseudo)} {shlex.quote(path)}")
    return "\n".join(lines) + "\n"
