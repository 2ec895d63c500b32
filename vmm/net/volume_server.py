"""A sandbox's volume server: NFSv3 (nfs-ganesha, FSAL VFS) inside the sandbox's own slot,
exporting only the volumes that sandbox mounts, reachable only from its guest.

Why NFS over the slot network (docs/volumes.md has the measurements): the guest's NFS client
lives in guest memory and speaks to a fixed address (the slot's gateway, the same in every
slot), so pause to disk, snapshots and forks — all QEMU migrations — carry it like any TCP
client; virtio-fs and virtio-9p devices block QEMU's migration. NFSv3 is stateless: a
resumed or forked guest's client reconnects to the new slot's server and its file handles
(kernel handles of the same host directories) are still good. Locks (NLM) are off: a lock
is local to one guest.

Fences: the server runs in the slot's netns (nothing else can reach it: the node's and other
slots' traffic never arrives there, the slot address is DNATed to the guest) and in a mount
namespace of its own with a private ``/run`` (its rpcbind, which ganesha insists on
registering with, is that slot's alone); the slot's table lets the guest reach the gateway
on the NFS and MOUNT ports only (``open_ports``). Exports are the sandbox's volumes' paths;
guest root is squashed to the volumes' owner (no device nodes, no root-owned files on the
host), every other uid is kept."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .slots import GATEWAY_IP, GUEST_IP, TAP, Slot, SlotError

NFS_PORT = 2049
MOUNT_PORT = 20048
GANESHA = "ganesha.nfsd"
RPCBIND = "rpcbind"


@dataclass(frozen=True)
class Export:
    export_id: int  # stable per volume of this sandbox: part of the NFS file handles
    path: str       # the volume's directory on the node
    pseudo: str     # how the guest names it in its mount (``/<volume id>``)


def available() -> str | None:
    """Why volume mounts cannot be served on this node, or None."""
    for tool in (GANESHA, RPCBIND, "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs nfs-ganesha-vfs)"
    if os.geteuid() != 0:
        return "the node does not run as root"
    return None


def config(exports: list[Export], uid: int, gid: int) -> str:
    """ganesha.conf: NFSv3 over TCP only, no locks, no quotas, no NFSv4 state to recover."""
    blocks = []
    for e in exports:
        blocks.append(f"""EXPORT {{
  Export_Id = {e.export_id};
  Path = "{e.path}";
  Pseudo = "{e.pseudo}";
  Protocols = 3;
  Transports = TCP;
  Access_Type = RW;
  Squash = Root_Squash;
  Anonymous_Uid = {uid};
  Anonymous_Gid = {gid};
  SecType = sys;
  FSAL {{ Name = VFS; }}
}}
""")
    return f"""NFS_CORE_PARAM {{
  Protocols = 3;
  Mount_Path_Pseudo = true;
  NFS_Port = {NFS_PORT};
  MNT_Port = {MOUNT_PORT};
  Enable_NLM = false;
  Enable_RQUOTA = false;
  Enable_UDP = false;
}}
NFSV4 {{ Graceless = true; }}
NFS_KRB5 {{ Active_krb5 = false; }}
MDCACHE {{ Entries_HWMark = 10000; }}
LOG {{ Default_Log_Level = WARN; }}
{"".join(blocks)}"""


# Run inside the slot's netns and a new mount namespace: a private /run for rpcbind's socket.
_LAUNCH = """set -e
mount --make-rprivate /
mount -t tmpfs -o size=1m,mode=0755 aenv-volumes /run
mkdir -p /run/rpcbind /run/ganesha
rpcbind -h {gateway}
exec {ganesha} -F -f "$1" -L "$2" -p /run/ganesha/ganesha.pid
"""


def _pid_file(run_dir: Path) -> Path:
    return run_dir / "server.pid"


def start(slot: Slot, exports: list[Export], run_dir: Path, *, uid: int = 1000, gid: int = 1000,
          timeout: float = 10.0) -> int:
    """Starts the slot's server (replacing one already there) and waits until it listens;
    returns its pid. SlotError when it does not come up."""
    stop(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    conf, log = run_dir / "ganesha.conf", run_dir / "ganesha.log"
    conf.write_text(config(exports, uid, gid))
    argv = slot.nsenter("unshare", "--mount", "--propagation", "private", "sh", "-c",
                        _LAUNCH.format(gateway=GATEWAY_IP, ganesha=GANESHA), "aenv-volumes", str(conf), str(log))
    with open(run_dir / "launch.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    _pid_file(run_dir).write_text(str(proc.pid))
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
    done = subprocess.run(slot.nsenter("ss", "-Hltn", f"sport = :{NFS_PORT}"), capture_output=True, text=True,
                          timeout=10)
    return done.returncode == 0 and bool(done.stdout.strip())


def stop(run_dir: Path) -> bool:
    """Stops the server started in ``run_dir`` (its whole process group: ganesha and its
    rpcbind). False if none was running."""
    pid_file = _pid_file(run_dir)
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return False
    stopped = False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
            stopped = True
        except ProcessLookupError:
            break
        for _ in range(40):
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
    lines = ["set -e", "modprobe nfsv3 2>/dev/null || modprobe nfs 2>/dev/null || true",
             f"grep -qw nfs /proc/filesystems || {{ echo 'the guest kernel has no NFS client'; exit {NO_NFS_EXIT}; }}"]
    for pseudo, path in mounts:
        lines.append(f"mkdir -p {shlex.quote(path)}")
        lines.append(f"mount -i -t nfs -o {MOUNT_OPTIONS} {shlex.quote(GATEWAY_IP + ':' + pseudo)} {shlex.quote(path)}")
    return "\n".join(lines) + "\n"
