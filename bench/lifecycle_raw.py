"""The raw half of bench/lifecycle.py: the lifecycle operations on the VM driver itself
(QemuDriver in this process), every number wall time around one driver call. Apart from
the API half (bench/lifecycle_api.py) so each reads as one way of driving the same verbs.

Networking (issue 10): the raw driver is a network instance of the benchmark's own
(AENV_NET_PREFIX / AENV_NET_POOL, set by bench/lifecycle.py before anything runs), started
like a node's (warm slot pool, resolver, table) and removed at the end of the raw part; a
second driver on restricted slirp (its own template snapshot: the fingerprint includes the
network backend) gives the netns / slirp comparison. The slot part measures the slots
themselves with bench/net_slots.py in yet another instance."""
from __future__ import annotations

import concurrent.futures
import shutil
import time
import uuid
from pathlib import Path

from vmm import templates
from vmm.driver import BootSpec
from vmm.net.spec import DEFAULT_WARM_SLOTS
from vmm.qemu import QemuDriver, envd_healthy

from bench.lifecycle_common import PARENT_OPS, ROOT, add_memory, mem_available, ms, run_cmd

NET_WARM = DEFAULT_WARM_SLOTS  # warm slots of the raw driver's pool: the node's default (AENV_NET_WARM_SLOTS)


def time_attach(driver, sink: list[float]) -> None:
    """Times every network handover of ``driver`` (its backend's ``attach``: for netns a warm
    slot from the pool plus its egress policy, for slirp a host port): the driver's own
    timings fold it into disk_ms, so the bound method is wrapped on this instance only."""
    attach = driver.net.attach

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return attach(*args, **kwargs)
        finally:
            sink.append(ms(t0, time.perf_counter()))

    driver.net.attach = timed


class Raw:
    """The driver half: every number is wall time around one driver call (plus what the call
    itself reports in its timings)."""

    def __init__(self, args):
        self.args = args
        self.images_dir = Path(args.images_dir).absolute()
        self.home = (ROOT / "var" / "bench-runs" / f"lifecycle-{uuid.uuid4().hex[:8]}").absolute()
        # network="auto": netns where this process can make slots (root), like the node
        self.driver = QemuDriver(home=self.home, images_dir=self.images_dir, boot_timeout=120, net_warm=NET_WARM)
        self.slirp: QemuDriver | None = None  # the restricted slirp driver, made by the slirp part
        self.templates = templates.TemplateCache(self.images_dir)
        self.samples: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.info: dict = {"network": self.driver.net.name}
        self.attach_ms: list[float] = []
        time_attach(self.driver, self.attach_ms)
        self.n = 0

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def sid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}"

    def spec(self, sid: str) -> BootSpec:
        return BootSpec(sid, image=self.args.image, cpu_count=self.args.cpu, memory_mb=self.args.memory,
                        disk_size_mb=self.args.disk)

    def start(self, spec: BootSpec, driver: QemuDriver | None = None):
        """Like the node's create: a restore of the booted template (built first), else a cold boot."""
        driver = driver or self.driver
        template = self.templates.find(driver, spec)
        if template is None:
            info = driver.boot(spec)
            info.timings["from_template_snapshot"] = 0
        else:
            info = driver.restore(template, spec, template=True)
            info.timings["from_template_snapshot"] = 1
        return info

    @property
    def netns(self) -> bool:
        return self.driver.net.name == "netns"

    def run(self) -> None:
        a = self.args
        ops = set(a.ops.split(","))
        try:
            self.info["start_network"] = self.driver.start_network()  # as the node does: warm pool, resolver
            if "slots" in ops:
                self.slot_ops()
            if "create" in ops:
                self.creates()
            if "slirp" in ops:
                self.slirp_creates()
            if ops & PARENT_OPS:
                parent = self.start(self.spec("parent"))
                run_cmd(parent.envd_url, "echo bench > /root/state.txt && python3 -c 'print(1)'")
                sid = parent.sandbox_id
                for op, fn in (("pause", self.pause_resume), ("disk", self.pause_to_disk), ("fs", self.fs_pause),
                               ("snapshot", self.snapshots)):
                    if op in ops:
                        fn(sid)
                for count, runs in ((4, a.fork4_runs), (16, a.fork16_runs)):
                    if f"fork{count}" in ops:
                        for _ in range(runs):
                            self.fork(sid, count)
                self.driver.kill(sid)
        finally:
            for driver in (self.driver, self.slirp):
                for vm in driver.list() if driver is not None else ():
                    driver.kill(vm.sandbox_id)
            self.remove_network()
            shutil.rmtree(self.home, ignore_errors=True)

    def remove_network(self) -> None:
        """The bench instance's slots (warm ones included), table and resolver: nothing of it
        is left on the host (vmm.net.netns.remove_instance)."""
        if not self.netns:
            return
        from vmm.net.netns import remove_instance  # noqa: PLC0415

        self.driver.net.close()  # stops the refill first, so no slot is made after the sweep
        left = remove_instance(self.driver.net.prefix, self.driver.net.pool_cidr, self.home)
        self.info["removed_at_end"] = {"slots": len(left["slots"]), "table": left["table"]}

    def slot_ops(self) -> None:
        """Making / destroying a slot and a handover from a warm pool (bench/net_slots.py, in an
        instance of its own: prefix aenvbm, pool 10.16.0.0/20)."""
        from bench import net_slots  # noqa: PLC0415

        if not self.netns:
            self.notes.append("slot part skipped: this process cannot make network slots (needs root, nft, nsenter)")
            return
        measured = net_slots.measure(self.args.slot_runs, NET_WARM)
        for name, values in measured.items():
            key = name if name.startswith("slot_") else f"slot_{name}"
            self.samples.setdefault(key, []).extend(values)

    def creates(self) -> None:
        for _ in range(self.args.runs):
            sid = self.sid("create")
            self.attach_ms.clear()
            t0 = time.perf_counter()
            info = self.start(self.spec(sid))
            t1 = time.perf_counter()
            assert info.timings.get("from_template_snapshot") == 1, info.timings
            run_cmd(info.envd_url)
            t2 = time.perf_counter()
            self.add("create_from_template", ms(t0, t1))
            self.add("create_from_template_first_command", ms(t0, t2))
            self.add("create.ram_copy", info.timings.get("ram_copy_ms", 0))
            if self.attach_ms:
                self.add("create.net_attach", self.attach_ms[0])
            t0 = time.perf_counter()
            self.driver.kill(sid)  # netns: the slot is destroyed with the VM
            self.add("kill", ms(t0, time.perf_counter()))
        for _ in range(self.args.cold_runs):
            sid = self.sid("cold")
            t0 = time.perf_counter()
            self.driver.boot(self.spec(sid))  # boot() never restores a template
            self.add("create_cold_boot", ms(t0, time.perf_counter()))
            self.driver.kill(sid)

    def slirp_creates(self) -> None:
        """The same creates on a restricted slirp driver (its own home and template snapshot),
        for the netns / slirp comparison (the cold boots are not repeated on slirp)."""
        if not self.netns:
            self.notes.append("slirp comparison skipped: the raw driver itself runs on slirp")
            return
        self.slirp = QemuDriver(home=self.home / "slirp", images_dir=self.images_dir, boot_timeout=120,
                                network="slirp")
        attach_ms: list[float] = []
        time_attach(self.slirp, attach_ms)
        t0 = time.monotonic()
        self.templates.build(self.slirp, self.args.image, self.args.cpu, self.args.memory, self.args.disk,
                             progress=lambda m: print(f"slirp {m}", flush=True))
        self.info["slirp_template_snapshot_ready_s"] = round(time.monotonic() - t0, 1)
        for _ in range(self.args.runs):
            sid = self.sid("slirp")
            attach_ms.clear()
            t0 = time.perf_counter()
            info = self.start(self.spec(sid), self.slirp)
            t1 = time.perf_counter()
            assert info.timings.get("from_template_snapshot") == 1, info.timings
            run_cmd(info.envd_url)
            t2 = time.perf_counter()
            self.add("create_from_template_slirp", ms(t0, t1))
            self.add("create_from_template_slirp_first_command", ms(t0, t2))
            if attach_ms:
                self.add("create_slirp.net_attach", attach_ms[0])
            t0 = time.perf_counter()
            self.slirp.kill(sid)
            self.add("kill_slirp", ms(t0, time.perf_counter()))

    def pause_resume(self, sid: str) -> None:
        for _ in range(self.args.runs):
            t0 = time.perf_counter()
            t = self.driver.pause(sid)
            self.add("pause", ms(t0, time.perf_counter()))
            self.add("pause.qmp_stop", t["pause_ms"])
            t0 = time.perf_counter()
            self.driver.resume(sid)
            self.add("resume_in_memory", ms(t0, time.perf_counter()))

    def pause_to_disk(self, sid: str) -> None:
        for _ in range(self.args.runs):
            t0 = time.perf_counter()
            t = self.driver.pause_to_disk(sid)
            self.add("pause_to_disk", ms(t0, time.perf_counter()))
            self.add("pause_to_disk.saved", t["pause_to_disk_ms"])
            t0 = time.perf_counter()
            self.driver.resume(sid)
            self.add("resume_from_disk", ms(t0, time.perf_counter()))

    def fs_pause(self, sid: str) -> None:
        for _ in range(self.args.fs_runs):
            t0 = time.perf_counter()
            self.driver.pause_to_disk(sid, memory=False)
            self.add("pause_fs_only", ms(t0, time.perf_counter()))
            t0 = time.perf_counter()
            info = self.driver.resume(sid)
            self.add("resume_fs_only_cold_boot", ms(t0, time.perf_counter()))
            assert info.timings.get("cold_boot") == 1

    def snapshots(self, sid: str) -> None:
        """Snapshot (pause window and total), then one restore from it (→ envd, → first command)."""
        for i in range(self.args.runs):
            dest = self.home / "snapshots" / f"s{i}"
            t0 = time.perf_counter()
            m = self.driver.snapshot(sid, dest)
            self.add("snapshot_total", ms(t0, time.perf_counter()))
            self.add("snapshot_pause_window", m.timings["pause_ms"])
            self.add("snapshot.memory_copy", m.timings["memory_copy_ms"])
            child = self.sid("restored")
            t0 = time.perf_counter()
            info = self.driver.restore(m, self.spec(child))
            t1 = time.perf_counter()
            run_cmd(info.envd_url)
            self.add("create_from_snapshot", ms(t0, t1))
            self.add("create_from_snapshot_first_command", ms(t0, time.perf_counter()))
            self.driver.kill(child)
            shutil.rmtree(dest)

    def fork(self, sid: str, count: int) -> None:
        avail0 = mem_available()
        self.attach_ms.clear()
        t0 = time.perf_counter()
        results = self.driver.fork(sid, count)
        for v in self.attach_ms:  # the children's handovers, made at once (the pool refills behind)
            self.add(f"fork{count}.net_attach", v)
        kids = [r for r in results if not isinstance(r, Exception)]
        if len(kids) != count:
            raise RuntimeError(f"fork x{count}: {[r for r in results if isinstance(r, Exception)]}")
        # each child answers at its own slot's address (envd_url), so networking is part of it
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            outs = list(pool.map(lambda k: run_cmd(k.envd_url), kids))
        t_all = time.perf_counter()
        assert all(o.strip() == "ok" for o in outs), outs
        if self.netns:
            hosts = {k.guest_host for k in kids}
            assert len(hosts) == count and "" not in hosts, f"fork x{count}: children share slots: {hosts}"
        self.add(f"fork{count}_parent_pause", kids[0].timings["capture.pause_ms"])
        self.add(f"fork{count}_children_ready", kids[0].timings["fork_all_ready_ms"])
        self.add(f"fork{count}_all_answering", ms(t0, t_all))
        add_memory(self.add, f"fork{count}", [k.pid for k in kids], avail0)
        for k in kids:
            self.driver.kill(k.sandbox_id)
        parent = self.driver.info(sid)
        assert envd_healthy(parent.envd_host, parent.envd_port)
