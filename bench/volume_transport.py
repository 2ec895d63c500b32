"""Volumes over NFS in the sandbox's slot (vmm.net.volume_server), measured on real VMs:
mount time, throughput and small-file latency against the guest's own disk, two sandboxes
seeing each other's writes, and what a mounted volume does to pause to disk / resume and to a
fork (the children's servers, their view of the volume). Plus the two device transports'
verdict: QEMU refusing to migrate a VM with a vhost-user-fs (virtio-fs) device, and what a
volume's size limit (its own ext4 image, volumes.image) costs to make and leaves usable.

    sudo .venv/bin/python -m bench.volume_transport [--mb 64] [--files 200] [--json out.json]

Prints the figures and writes them as JSON to bench/results/.

Its own network instance (``--net-prefix`` / ``--net-pool``) and home under var/bench-runs,
removed at the end."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GUEST_BENCH = r"""
import os, sys, time
d, mb, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d + "/small", exist_ok=True)
out = {}
block = os.urandom(1 << 20)
t = time.perf_counter()
with open(d + "/big", "wb") as f:
    for _ in range(mb):
        f.write(block)
    f.flush(); os.fsync(f.fileno())
out["write_MBps"] = mb / (time.perf_counter() - t)
open("/proc/sys/vm/drop_caches", "w").write("3\n")
t = time.perf_counter()
with open(d + "/big", "rb") as f:
    while f.read(1 << 20):
        pass
out["read_MBps"] = mb / (time.perf_counter() - t)
t = time.perf_counter()
for i in range(files):
    with open(f"{d}/small/{i}", "w") as f:
        f.write("x")
out["create_ms"] = (time.perf_counter() - t) * 1000 / files
open("/proc/sys/vm/drop_caches", "w").write("3\n")
t = time.perf_counter()
for i in range(files):
    os.stat(f"{d}/small/{i}")
out["stat_ms"] = (time.perf_counter() - t) * 1000 / files
t = time.perf_counter()
for i in range(files):
    with open(f"{d}/small/{i}") as f:
        f.read()
out["open_read_ms"] = (time.perf_counter() - t) * 1000 / files
print(repr(out))
"""


def ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


class Bench:
    def __init__(self, args):
        os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool
        from vmm import templates  # noqa: PLC0415
        from vmm.qemu import QemuDriver  # noqa: PLC0415

        self.args = args
        self.home = (ROOT / "var" / "bench-runs" / f"volumes-{uuid.uuid4().hex[:8]}").absolute()
        self.driver = QemuDriver(home=self.home, images_dir=Path(args.images_dir).absolute(), boot_timeout=120,
                                 net_warm=3)
        self.templates = templates.TemplateCache(Path(args.images_dir).absolute())
        self.volume = Path(tempfile.mkdtemp(prefix="aenv-bench-volume-"))
        os.chown(self.volume, 1000, 1000)
        self.results: dict = {"notes": []}

    # ------------------------------------------------------------------ plumbing

    def start(self, name: str):
        from vmm.driver import BootSpec  # noqa: PLC0415

        spec = BootSpec(f"{name}-{uuid.uuid4().hex[:6]}", image="base", cpu_count=2, memory_mb=512, disk_size_mb=2048)
        template = self.templates.find(self.driver, spec)
        return self.driver.restore(template, spec, template=True, source_stays=True) if template else self.driver.boot(spec)

    def slot(self, sandbox_id: str):
        from vmm.net.slots import Slot  # noqa: PLC0415

        record = json.loads((self.home / "sandboxes" / sandbox_id / "vm.json").read_text())
        return Slot(self.driver.net.prefix, record["net_slot"], self.driver.net.pool_cidr)

    def serve(self, sandbox_id: str) -> float:
        """The sandbox's server in its current slot; ms to listening."""
        from vmm.net import nfs_guard, volume_server as vs  # noqa: PLC0415

        t0 = time.perf_counter()
        slot = self.slot(sandbox_id)
        key = nfs_guard.volume_key(b"bench" * 8, "bench/volume")  # the same for every server of the run
        vs.start(slot, [vs.Export(1, str(self.volume), "/bench", key)], self.home / "volume-servers" / sandbox_id)
        vs.open_ports(slot)
        return ms(t0)

    def unserve(self, sandbox_id: str) -> None:
        from vmm.net import volume_server as vs  # noqa: PLC0415

        vs.stop(self.home / "volume-servers" / sandbox_id)

    def sh(self, info, cmd: str, timeout: int = 300) -> str:
        from bench.lifecycle_common import run_cmd  # noqa: PLC0415

        return run_cmd(info.envd_url, cmd, sandbox_id=info.sandbox_id)

    def mount(self, info) -> float:
        from vmm.net import volume_server as vs  # noqa: PLC0415

        t0 = time.perf_counter()
        self.sh(info, vs.mount_script([("/bench", "/mnt/vol")]))
        return ms(t0)

    def guest_bench(self, info, where: str) -> dict:
        self.sh(info, f"cat > /tmp/b.py <<'EOF'\n{GUEST_BENCH}\nEOF")
        out = self.sh(info, f"python3 /tmp/b.py {where} {self.args.mb} {self.args.files}")
        return {k: round(v, 2) for k, v in eval(out.strip().splitlines()[-1]).items()}  # noqa: S307 - our own output

    # ------------------------------------------------------------------ parts

    def run(self) -> dict:
        r = self.results
        self.driver.start_network()
        a = self.start("a")
        b = self.start("b")
        try:
            r["server_start_ms"] = self.serve(a.sandbox_id)
            r["mount_ms"] = self.mount(a)
            r["server_rss_kb"] = self.server_rss(a.sandbox_id)
            r["nfs"] = self.guest_bench(a, "/mnt/vol/t")
            r["guest_disk"] = self.guest_bench(a, "/root/t")
            self.serve(b.sandbox_id)
            self.mount(b)
            self.sh(a, "rm -rf /mnt/vol/t; echo from-a > /mnt/vol/shared.txt")
            t0 = time.perf_counter()
            seen = self.sh(b, "cat /mnt/vol/shared.txt").strip()
            r["b_sees_a"] = {"ok": seen == "from-a", "ms": ms(t0)}
            self.sh(b, "echo from-b > /mnt/vol/back.txt")
            r["a_sees_b"] = self.sh(a, "cat /mnt/vol/back.txt").strip() == "from-b"
            r["pause"], a = self.pause_resume(a, b)
            r["fork"] = self.fork(a)
            r["virtiofs_migration"] = virtiofs_blocks_migration(self.home)
            r["size_limit"] = size_limit_images(self.home)
        except BaseException:
            print(json.dumps(r, indent=2))  # what was measured before it broke
            raise
        finally:
            for vm in self.driver.list():
                self.unserve(vm.sandbox_id)
                self.driver.kill(vm.sandbox_id)
            from vmm.net.netns import remove_instance  # noqa: PLC0415

            self.driver.net.close()
            remove_instance(self.driver.net.prefix, self.driver.net.pool_cidr, self.home)
            shutil.rmtree(self.home, ignore_errors=True)
            shutil.rmtree(self.volume, ignore_errors=True)
        return r

    def server_rss(self, sandbox_id: str) -> int:
        pid = int((self.home / "volume-servers" / sandbox_id / "server.pid").read_text())
        out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)], capture_output=True,
                             text=True).stdout
        total = sum(int(x) for x in out.split())
        kids = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
        rss = 0
        for k in kids:
            try:
                rss += int(next(l for l in Path(f"/proc/{k}/status").read_text().splitlines()
                                if l.startswith("VmRSS")).split()[1])
            except (OSError, StopIteration):
                pass
        return rss or total

    def pause_resume(self, a, b) -> dict:
        """Pause to disk and resume with the volume mounted (and an open file), against the
        same verbs on b's twin without a server restart; then the volume from the resumed guest."""
        out = {}
        self.sh(a, "setsid sh -c 'exec 3>>/mnt/vol/open.log; while true; do echo t >&3; sleep 1; done' "
                   ">/dev/null 2>&1 &")
        time.sleep(2)
        t0 = time.perf_counter()
        self.driver.pause_to_disk(a.sandbox_id)
        out["pause_to_disk_ms"] = ms(t0)
        self.unserve(a.sandbox_id)  # the slot is gone with the pause; so is its server
        t0 = time.perf_counter()
        info = self.driver.resume(a.sandbox_id)
        out["resume_ms"] = ms(t0)
        out["server_start_ms"] = self.serve(a.sandbox_id)
        t0 = time.perf_counter()
        self.sh(info, "cat /mnt/vol/shared.txt >/dev/null && echo after-resume > /mnt/vol/resumed.txt")
        out["first_volume_op_after_resume_ms"] = ms(t0)
        out["b_sees_resumed_write"] = self.sh(b, "cat /mnt/vol/resumed.txt").strip() == "after-resume"
        # the writer's file stayed open through the pause: it keeps appending (seen in a itself;
        # b sees the appends once a's client writes them back: NFS close-to-open, no close here)
        # (it did not until ganesha kept CAP_DAC_OVERRIDE: each write to a file the new server had
        # not created was refused, docs/volumes.md#what-the-server-itself-holds)
        before = after = int(self.sh(info, "wc -l < /mnt/vol/open.log").strip())
        deadline = time.monotonic() + 15  # the writer appends once a second
        while after <= before + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
            after = int(self.sh(info, "wc -l < /mnt/vol/open.log").strip())
        out["open_file_keeps_writing"] = after > before + 1
        self.sh(info, "sync")
        out["b_sees_appends_after_sync"] = int(self.sh(b, "wc -l < /mnt/vol/open.log").strip()) >= after
        # the same pause / resume of b with nothing of its own mounted beyond the volume: the
        # baseline is the VM without a volume (driver only)
        c = self.start("c")
        t0 = time.perf_counter()
        self.driver.pause_to_disk(c.sandbox_id)
        out["baseline_pause_to_disk_ms"] = ms(t0)
        t0 = time.perf_counter()
        self.driver.resume(c.sandbox_id)
        out["baseline_resume_ms"] = ms(t0)
        self.driver.kill(c.sandbox_id)
        return out, info

    def fork(self, a) -> dict:
        out = {}
        t0 = time.perf_counter()
        children = self.driver.fork(a.sandbox_id, 1)
        out["fork_ms"] = ms(t0)
        child = children[0]
        if isinstance(child, Exception):
            raise child
        out["server_start_ms"] = self.serve(child.sandbox_id)
        self.serve(a.sandbox_id)  # the parent keeps its slot; a fresh server is harmless
        t0 = time.perf_counter()
        seen = self.sh(child, "cat /mnt/vol/shared.txt").strip()
        out["child_sees_volume"] = seen == "from-a"
        out["first_volume_op_in_child_ms"] = ms(t0)
        self.sh(child, "echo from-child > /mnt/vol/child.txt")
        out["parent_sees_child_write"] = self.sh(a, "cat /mnt/vol/child.txt").strip() == "from-child"
        return out


def size_limit_images(home: Path) -> dict:
    """What a volume's size limit costs (volumes.image): making and mounting its ext4 image,
    the room it leaves, the node's disk it takes, and a write past it."""
    from volumes import image  # noqa: PLC0415

    out = {}
    for mb in (8, 1024, 10240):
        root = home / "limits" / f"v{mb}"
        t0 = time.perf_counter()
        image.create(root, mb, 1000, 1000)
        made = ms(t0)
        used, size = image.usage(root)
        entry = {"create_ms": made, "usable_bytes": size - used,
                 "disk_kib_empty": image.image_of(root).stat().st_blocks // 2}
        if mb == 8:
            written = 0
            try:
                with open(root / "fill", "wb") as f:
                    while written < (16 << 20):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        os.fsync(f.fileno())
                        written += 1 << 20
            except OSError as exc:
                entry["past_the_limit"] = f"{exc.strerror} after {written >> 20} MiB"
        t0 = time.perf_counter()
        image.remove(root)
        entry["remove_ms"] = ms(t0)
        out[f"{mb}MiB"] = entry
    return out


def virtiofs_blocks_migration(home: Path) -> dict:
    """QEMU with a vhost-user-fs device (virtiofsd serving a directory), no guest needed: does
    the ``migrate`` that pause, snapshot and fork use go through?"""
    virtiofsd = "/usr/lib/qemu/virtiofsd"
    if not Path(virtiofsd).exists():
        return {"skipped": "no /usr/lib/qemu/virtiofsd"}
    work = home / "virtiofs"
    (work / "share").mkdir(parents=True, exist_ok=True)
    sock, qmp = work / "vfs.sock", work / "qmp.sock"
    vfs = subprocess.Popen([virtiofsd, f"--socket-path={sock}", "-o", f"source={work / 'share'}", "-o", "cache=none"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    qemu = None
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        qemu = subprocess.Popen([
            "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-nodefaults", "-nographic", "-S",
            "-object", "memory-backend-memfd,id=mem,size=64M,share=on", "-machine", "memory-backend=mem", "-m", "64M",
            "-chardev", f"socket,id=vfs,path={sock}", "-device", "vhost-user-fs-device,chardev=vfs,tag=vol",
            "-qmp", f"unix:{qmp},server=on,wait=off"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        from vmm.qemu.qmp import QMP, QMPError  # noqa: PLC0415

        for _ in range(100):
            if qmp.exists():
                break
            time.sleep(0.05)
        with QMP(qmp) as q:
            try:
                q.execute("migrate", uri="exec:cat > /dev/null")
            except QMPError as exc:
                return {"migrate_refused": True, "error": str(exc)}
            time.sleep(0.5)
            return {"migrate_refused": False, "status": q.execute("query-migrate")}
    finally:
        if qemu is not None:
            qemu.kill()
            qemu.wait()
        vfs.kill()
        vfs.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images-dir", default=os.environ.get("AENV_IMAGES_DIR", str(ROOT / "var" / "images")))
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--net-prefix", default="aenvq")
    parser.add_argument("--net-pool", default="10.17.0.0/20")
    parser.add_argument("--json", default="", help="default: bench/results/volume_transport-<UTC stamp>.json")
    args = parser.parse_args()
    result = Bench(args).run()
    print(json.dumps(result, indent=2))
    out = Path(args.json or ROOT / "bench" / "results" / f"volume_transport-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
