"""Benchmark: what an idle sandbox costs the host (issue 26, the idle row), under TCG.

Variants part: ``--per-variant`` guests of each variant are cold-booted (the driver's own boot,
in this process), left to settle, then all of them are measured in **one shared window**, so
every variant sees the same host load. Per guest: its QEMU's CPU time over the window
(``/proc/<pid>/task/*/schedstat``, exact nanoseconds, all threads; split into the vCPU threads and
the main loop), the threads' voluntary wakeups, and in the guest ``/proc/interrupts`` (local timer
interrupts, IPIs) and ``/proc/stat`` (context switches) read through envd just before and after.

A variant is the guest kernel command line with arguments added or taken away (``before``: the
command line without ``vmm.qemu.cmdline.IDLE_KERNEL_ARGS``, i.e. as it was before this work),
envd stopped (SIGSTOP for the window: what the guest costs without its agent), or the node's
metrics sampler imitated (``GET /metrics`` every ``--metrics-interval`` s, what a running node
does to every running sandbox).

Density part (``--density N``): up to N idle sandboxes started the node's way (a restore of the
booted template snapshot, one after the other, stopping early when a create takes longer than
``--density-max-create`` s or the host's MemAvailable would fall under ``--density-min-free``),
one window over all of them, then ``--density-creates`` creates (restore + envd answering,
killed again) timed while they idle.

Results: a table and JSON in bench/results/ (``idle-<stamp>.{md,json}``) with the host's cores,
memory, load average during each part and other users' QEMU processes (a shared host).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_host import cpu_window  # noqa: E402
from bench.lifecycle_common import ROOT, LoadMonitor, finish_run, mem_available, percentile  # noqa: E402
from bench.templates import git_state  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Variant:
    """One way of running the idle guest."""

    name: str
    add: tuple[str, ...] = ()  # kernel arguments added to the driver's command line
    strip: tuple[str, ...] = ()  # kernel arguments taken out of it
    stop_envd: bool = False  # envd SIGSTOPped for the window
    metrics: bool = False  # GET /metrics every --metrics-interval s during the window
    metrics_keepalive: bool = False  # ... on one kept-alive connection per guest (else one per request)
    sampler: bool = False  # ... by agent.metrics.Scraper itself (kept connections, idle guests less often)
    note: str = ""


def idle_args() -> tuple[str, ...]:
    from vmm.qemu import cmdline  # noqa: PLC0415

    return tuple(getattr(cmdline, "IDLE_KERNEL_ARGS", ()))


def variants() -> dict[str, Variant]:
    ours = idle_args()
    known = [
        Variant("before", strip=ours, note="the command line without IDLE_KERNEL_ARGS (as before this work)"),
        Variant("before-envd-stopped", strip=ours, stop_envd=True, note="the same, envd stopped for the window"),
        Variant("now", note="the driver's command line as it is"),
        Variant("now-envd-stopped", stop_envd=True, note="the same, envd stopped: the guest kernel alone"),
        Variant("now-metrics", metrics=True, note="the node's metrics sampler imitated (GET /metrics, a new "
                "connection each time, as agent.metrics does)"),
        Variant("now-metrics-keepalive", metrics=True, metrics_keepalive=True,
                note="the same on one kept-alive connection per guest"),
        Variant("now-sampler", metrics=True, sampler=True,
                note="the node's sampler as it is now (agent.metrics.Scraper: one kept-alive connection per "
                "guest, an idle guest asked every AENV_SANDBOX_METRICS_IDLE_INTERVAL s)"),
        # experiments (arguments this work tried; kept so a run can repeat them)
        Variant("x-compaction", strip=ours, add=("sysctl.vm.compaction_proactiveness=0",)),
        Variant("x-nowatchdog", strip=ours, add=("nowatchdog",)),
        Variant("x-psi-off", strip=ours, add=("psi=0",)),
        Variant("x-stat-interval", strip=ours, add=("sysctl.vm.stat_interval=10",)),
        Variant("x-all", strip=ours, add=("sysctl.vm.compaction_proactiveness=0", "nowatchdog", "psi=0",
                                          "sysctl.vm.stat_interval=10")),
    ]
    return {v.name: v for v in known}


# -- guest counters --------------------------------------------------------------------------------

def parse_guest_counters(text: str) -> dict[str, int]:
    """Sums over CPUs of the /proc/interrupts rows LOC (local timer), RES (reschedule IPIs),
    CAL (function-call IPIs), and /proc/stat's ctxt, from ``cat /proc/interrupts /proc/stat``."""
    out = {"LOC": 0, "RES": 0, "CAL": 0, "ctxt": 0}
    for line in text.splitlines():
        head, _, rest = line.strip().partition(":")
        if head in ("LOC", "RES", "CAL"):
            out[head] = sum(int(x) for x in rest.split() if x.isdigit())
        elif line.startswith("ctxt "):
            out["ctxt"] = int(line.split()[1])
    return out


def guest_counters(info) -> dict[str, int] | None:
    from envd_client import EnvdClient, EnvdError  # noqa: PLC0415

    try:
        with EnvdClient.at(info.envd_host, info.envd_port) as envd:
            res = envd.run("cat /proc/interrupts /proc/stat", user="root")
    except EnvdError:
        return None
    return parse_guest_counters(res.stdout.decode(errors="replace")) if res.exit_code == 0 else None


def stop_envd_for(info, seconds: float) -> None:
    """SIGSTOPs the guest's envd for ``seconds`` (a detached guest shell sends the SIGCONT)."""
    from envd_client import EnvdClient  # noqa: PLC0415

    script = f"p=$(pidof envd); kill -STOP $p; sleep {seconds:.0f}; kill -CONT $p"
    with EnvdClient.at(info.envd_host, info.envd_port) as envd:
        envd.run(f"setsid sh -c '{script}' >/dev/null 2>&1 </dev/null &", user="root")


# -- host figures ----------------------------------------------------------------------------------

def thread_times(pid: int) -> dict[str, tuple[str, int, int]]:
    """tid -> (name, CPU ns so far, voluntary context switches) of every thread of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            ns = int(Path(f"{base}/schedstat").read_text().split()[0])
            status = Path(f"{base}/status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, ns, vol)
    return out


def qemu_delta(before: dict, after: dict, seconds: float, pid: int) -> dict:
    """CPU % of one core and wakeups/s over the window: all threads, the main loop (the thread
    whose tid is the pid: timers, devices, the network backend) and the others (the vCPU threads,
    plus QEMU's RCU and worker threads, which stay near 0 when idle; without debug-threads=on
    the threads have no names to tell them apart)."""
    total = vcpu = main = 0.0
    wake_vcpu = wake_main = 0
    for tid, (_name, ns, vol) in after.items():
        if tid not in before:
            continue
        d_ns, d_vol = ns - before[tid][1], vol - before[tid][2]
        total += d_ns
        if int(tid) == pid:
            main += d_ns
            wake_main += d_vol
        else:
            vcpu += d_ns
            wake_vcpu += d_vol
    pct = lambda ns: round(100.0 * ns / 1e9 / seconds, 3)  # noqa: E731
    return {"cpu_pct": pct(total), "vcpu_pct": pct(vcpu), "main_pct": pct(main),
            "vcpu_wakeups_s": round(wake_vcpu / seconds, 1), "main_wakeups_s": round(wake_main / seconds, 1)}


def process_memory(pid: int) -> dict[str, float]:
    """MiB of one QEMU: RSS (``Rss``: its own anonymous memory plus the guest RAM pages of the
    tmpfs file it has mapped), its anonymous part, its shared part, and PSS (each shared page
    split among the processes mapping it), from ``/proc/<pid>/smaps_rollup``."""
    want = {"Rss": "rss_mib", "Pss": "pss_mib", "Anonymous": "anon_mib", "Pss_Shmem": "pss_shmem_mib"}
    out: dict[str, float] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in want:
            out[want[key]] = round(int(rest.split()[0]) / 1024, 1)
    return out


def tcg_cache_mib(pid: int) -> float | None:
    """MiB resident of a QEMU's executable anonymous mappings: TCG's translated-code cache
    (``-accel tcg,tb-size=``), the part of its own memory a KVM host would not have."""
    total, perm, anon = 0, "", False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            perm, anon = head[1], len(head) == 5
        elif line.startswith("Rss:") and anon and "x" in perm:
            total += int(head[1])
    return round(total / 1024, 1)


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    return {"mean": round(statistics.mean(values), 3), "median": round(statistics.median(values), 3),
            "min": round(min(values), 3), "max": round(max(values), 3)}


# -- the driver with per-sandbox command lines ------------------------------------------------------

class Booter:
    """A QemuDriver of the benchmark's own (home under var/bench-runs, network instance from
    AENV_NET_PREFIX / AENV_NET_POOL) whose command line takes each sandbox's variant."""

    def __init__(self, images_dir: Path):
        import vmm.qemu.driver as qdriver  # noqa: PLC0415
        from vmm.qemu import QemuDriver  # noqa: PLC0415

        self.home = (ROOT / "var" / "bench-runs" / f"idle-{uuid.uuid4().hex[:8]}").absolute()
        self.driver = QemuDriver(home=self.home, images_dir=images_dir, boot_timeout=240)
        self.variant_of: dict[str, Variant] = {}
        # the image build of today's sources (envd, guest init), pinned for the whole run
        from vmm.images import ensure_image  # noqa: PLC0415

        built = ensure_image(images_dir, "base", progress=lambda m: None)
        self.image = f"{built.name}-{built.recipe_hash}"
        original = qdriver.qemu_command

        def command(**kw):
            argv = original(**kw)
            v = self.variant_of.get(kw["paths"].state_dir.name)
            if v is not None:
                i = argv.index("-append") + 1
                args = [a for a in argv[i].split() if a not in v.strip]
                argv[i] = " ".join(args + list(v.add))
            return argv

        qdriver.qemu_command = command  # this process's driver only

    def boot(self, sid: str, variant: Variant, cpu: int, memory: int):
        from vmm.driver import BootSpec  # noqa: PLC0415

        self.variant_of[sid] = variant
        return self.driver.boot(BootSpec(sid, image=self.image, cpu_count=cpu, memory_mb=memory))

    def kill_all(self) -> None:
        for sid in self.driver.sandbox_ids():
            self.driver.kill(sid)

    def remove(self) -> bool:
        from vmm.net.netns import remove_instance  # noqa: PLC0415

        self.kill_all()
        ok = True
        if self.driver.net.name == "netns":
            try:
                remove_instance(os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"], self.home)
            except Exception:  # noqa: BLE001 - reported, the results still count
                ok = False
        shutil.rmtree(self.home, ignore_errors=True)
        return ok


# -- one measured window over running guests --------------------------------------------------------

@dataclass
class Guest:
    info: object
    variant: Variant
    before: dict = field(default_factory=dict)
    counters0: dict | None = None
    counters0_at: float = 0.0


def read_counters(guests: list[Guest]) -> None:
    """The guest counters at the start. Read before the settle period: the read is a command
    through envd, which counts as someone using the sandbox (envd scans for listeners every
    second for envd.port_forward.ACTIVE_FOR seconds after it), so the settle outlasts that."""
    for g in guests:
        g.counters0, g.counters0_at = guest_counters(g.info), time.monotonic()


def metrics_loop(guests: list[Guest], interval: float, stop: threading.Event, asked: list[int]) -> None:
    """The node's sampler imitated for the window: ``now-metrics`` a new connection per request
    every round (as agent.metrics was), ``now-metrics-keepalive`` one kept connection per guest
    every round, ``now-sampler`` agent.metrics' own Scraper (kept connections, idle guests asked
    every AENV_SANDBOX_METRICS_IDLE_INTERVAL, their QEMU's CPU read from /proc)."""
    from envd_client import EnvdClient, EnvdError  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    def keepalive():  # httpx would drop an idle connection after 5 s: the sampler's period
        return httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=1, keepalive_expiry=300))

    kept = {id(g): EnvdClient.at(g.info.envd_host, g.info.envd_port, transport=keepalive())
            for g in guests if g.variant.metrics_keepalive}
    node = [g for g in guests if g.variant.sampler]
    scraper, rows = None, []
    if node:
        from django.conf import settings  # noqa: PLC0415

        from agent.metrics import Scraper, round_deadline  # noqa: PLC0415

        pids = {g.info.sandbox_id: g.info.pid for g in node}
        scraper = Scraper(interval, settings.AENV_SANDBOX_METRICS_IDLE_INTERVAL,
                          host_cpu=lambda: {sid: cpu_seconds(pid) for sid, pid in pids.items()})
        rows = [{"id": g.info.sandbox_id, "envd_host": g.info.envd_host, "envd_port": g.info.envd_port,
                 "envd_access_token": ""} for g in node]
        asked[0] += len(scraper.collect(scraper.due(rows), round_deadline(interval)))  # the sampler's first round
    try:
        while not stop.wait(interval):
            if scraper is not None:
                asked[0] += len(scraper.collect(scraper.due(rows), round_deadline(interval)))
            for g in guests:
                if g.variant.sampler:
                    continue
                try:
                    if id(g) in kept:
                        kept[id(g)].metrics()
                    else:
                        with EnvdClient.at(g.info.envd_host, g.info.envd_port) as envd:
                            envd.metrics()
                    asked[0] += 1
                except EnvdError:
                    pass
    finally:
        for client in kept.values():
            client.close()
        if scraper is not None:
            scraper.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of all of a process's threads (what agent.metrics.vm_cpu_seconds reads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def measure(guests: list[Guest], window: float, metrics_interval: float) -> dict[str, dict]:
    """One window over all guests; per variant the per-guest figures and their summaries."""
    for g in guests:
        if g.variant.stop_envd:
            stop_envd_for(g.info, window + 15)
    time.sleep(1.0)  # the stop has happened, the counter reads' own work is over
    for g in guests:
        g.before = thread_times(g.info.pid)
    stop, asked = threading.Event(), [0]
    sampled = [g for g in guests if g.variant.metrics]
    sampler = threading.Thread(target=metrics_loop, args=(sampled, metrics_interval, stop, asked), daemon=True)
    if sampled:
        sampler.start()
    t0 = time.monotonic()
    host = cpu_window(window, [])
    seconds = time.monotonic() - t0
    stop.set()
    after = {id(g): thread_times(g.info.pid) for g in guests}
    if sampled:
        sampler.join(timeout=30)
    if any(g.variant.stop_envd for g in guests):
        time.sleep(16.0)  # envd continued (window + 15 s), so the counters can be read
    out: dict[str, dict] = {}
    for g in guests:
        row = qemu_delta(g.before, after[id(g)], seconds, g.info.pid)
        c1 = guest_counters(g.info)
        if g.counters0 and c1:  # settle + window + the reads' own work (and, when stopped, 16 s after)
            span = time.monotonic() - g.counters0_at
            row.update({f"guest_{k}_s": round((c1[k] - g.counters0[k]) / span, 1) for k in c1})
        out.setdefault(g.variant.name, {"guests": []})["guests"].append(row)
    for name, v in out.items():
        rows = v["guests"]
        v["summary"] = {k: summary([r[k] for r in rows if k in r]) for k in rows[0]}
    return {"variants": out, "window_s": round(seconds, 1), "host_busy_pct": host["host_busy_pct"],
            "metrics_requests": asked[0], "load1_after": round(os.getloadavg()[0], 2)}


# -- parts ------------------------------------------------------------------------------------------

def run_variants(args, booter: Booter, monitor: LoadMonitor) -> dict:
    table = variants()
    chosen = [table[n] for n in args.variants.split(",")]
    guests: list[Guest] = []
    boot_ms: dict[str, list[float]] = {}
    monitor.phase = "variants-boot"
    for i in range(args.per_variant):  # interleaved, so no variant boots on a quieter host
        for v in chosen:
            sid = f"idle-{v.name.replace('-', '')[:12]}-{i}"
            info = booter.boot(sid, v, args.cpu, args.memory)
            boot_ms.setdefault(v.name, []).append(round(info.timings.get("total_ms", 0)))
            guests.append(Guest(info, v))
            print(f"booted {sid} in {info.timings.get('total_ms', 0):.0f} ms", flush=True)
    monitor.phase = "variants-settle"
    read_counters(guests)
    time.sleep(args.settle)
    monitor.phase = "variants-window"
    result = measure(guests, args.window, args.metrics_interval)
    for name, ms in boot_ms.items():
        result["variants"][name]["boot_ms"] = ms
        v = table[name]
        result["variants"][name]["definition"] = {"add": list(v.add), "strip": list(v.strip),
                                                  "stop_envd": v.stop_envd, "metrics": v.metrics,
                                                  "metrics_keepalive": v.metrics_keepalive, "sampler": v.sampler,
                                                  "note": v.note}
    booter.kill_all()
    return result


def run_density(args, booter: Booter, monitor: LoadMonitor) -> dict:
    from vmm import templates  # noqa: PLC0415
    from vmm.driver import BootSpec  # noqa: PLC0415
    images_dir = Path(args.images_dir).absolute()
    image_name = booter.image
    templates.build(images_dir, image_name, args.cpu, args.memory, 2048, progress=print)
    cache = templates.TemplateCache(images_dir)
    spec = lambda sid: BootSpec(sid, image=image_name, cpu_count=args.cpu, memory_mb=args.memory)  # noqa: E731
    manifest = cache.find(booter.driver, spec("probe"))
    if manifest is None:
        return {"error": "no template snapshot for the shape"}

    def create(sid: str) -> tuple[object, float]:
        t0 = time.monotonic()
        info = booter.driver.restore(manifest, spec(sid), template=True, source_stays=True)
        return info, (time.monotonic() - t0) * 1e3

    monitor.phase = "density-start"
    avail0, started, start_ms, stopped_by = mem_available(), [], [], "the target"
    for i in range(args.density):
        if mem_available() < args.density_min_free * MIB:
            stopped_by = f"MemAvailable under {args.density_min_free} MiB"
            break
        try:
            info, ms = create(f"idle-dens-{i}")
        except Exception as e:  # noqa: BLE001 - the node would refuse or fail here too: reported
            stopped_by = f"create {i} failed: {str(e)[:200]}"
            break
        started.append(info)
        start_ms.append(round(ms))
        if i % 10 == 0:
            print(f"density: {len(started)} running, last create {ms:.0f} ms, load {os.getloadavg()[0]:.1f}", flush=True)
        if ms > args.density_max_create * 1e3:
            stopped_by = f"a create took {ms / 1e3:.1f} s (> {args.density_max_create} s)"
            break
    avail1 = mem_available()
    monitor.phase = "density-settle"
    time.sleep(args.settle)
    memory = [process_memory(info.pid) for info in started]
    tcg = [t for t in (tcg_cache_mib(info.pid) for info in started[:10]) if t is not None]
    shm = shutil.disk_usage(os.environ.get("AENV_SHM_DIR", "/dev/shm")).used
    avail_settled = mem_available()
    monitor.phase = "density-window"
    before = {info.pid: thread_times(info.pid) for info in started}
    t0 = time.monotonic()
    host = cpu_window(args.window, [])
    seconds = time.monotonic() - t0
    per = [qemu_delta(before[i.pid], thread_times(i.pid), seconds, i.pid)["cpu_pct"] for i in started]
    monitor.phase = "density-creates"
    creates = []
    for j in range(args.density_creates):
        try:
            info, ms = create(f"idle-densc-{j}")
            creates.append(round(ms))
            booter.driver.kill(info.sandbox_id)
        except Exception as e:  # noqa: BLE001
            creates.append(None)
            print(f"density create {j} failed: {e}", flush=True)
        time.sleep(1.0)
    load1 = round(os.getloadavg()[0], 2)
    booter.kill_all()
    done = [c for c in creates if c is not None]
    return {"requested": args.density, "running": len(started), "stopped_by": stopped_by,
            "start_create_ms": start_ms, "memavailable_drop_per_sandbox_mib":
                round((avail0 - avail1) / max(1, len(started)) / MIB, 1),
            "memavailable_drop_per_sandbox_settled_mib":
                round((avail0 - avail_settled) / max(1, len(started)) / MIB, 1),
            "memavailable_left_mib": round(avail_settled / MIB), "shm_used_mib": round(shm / MIB),
            "qemu_memory_mib": {k: summary([m[k] for m in memory if k in m])
                                for k in ("rss_mib", "pss_mib", "anon_mib", "pss_shmem_mib")},
            "qemu_tcg_cache_mib_first10": summary(tcg),
            "window_s": round(seconds, 1), "host_busy_pct": host["host_busy_pct"], "load1_after_creates": load1,
            "per_sandbox_cpu_pct": summary(per), "cpu_pct_all_sandboxes": round(sum(per), 1),
            "creates_while_idle_ms": creates,
            "creates_p50_ms": round(statistics.median(done)) if done else None,
            "creates_p90_ms": round(percentile(done, 90)) if done else None}


# -- report -----------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = [f"# idle guests {result['when']}", "",
             f"host: {result['host']['cpus']} cores, {result['host_mem_gib']} GiB, load during: "
             + "; ".join(f"{p} {v['load1_mean']} (max {v['load1_max']}, other QEMUs ≤ {v['other_qemu_max']})"
                         for p, v in result["host"]["load_during"].items()), ""]
    v = result.get("variants_part")
    if v:
        lines += [f"Variants: {result['settings']['per_variant']} guests each ({result['settings']['cpu']} vCPU / "
                  f"{result['settings']['memory']} MiB, cold boot), one {v['window_s']} s window for all, "
                  f"host busy {v['host_busy_pct']} %.", "",
                  "| variant | QEMU CPU, % of a core (mean, min–max) | vCPU (+aux) threads | main loop | vCPU wakeups/s "
                  "| main loop wakeups/s | guest timer irqs/s | guest IPIs/s | guest ctxt/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, d in v["variants"].items():
            s = d["summary"]
            g = lambda k: s.get(k, {}).get("mean", "–")  # noqa: E731
            ipis = (s["guest_CAL_s"]["mean"] + s["guest_RES_s"]["mean"]) if "guest_CAL_s" in s else "–"
            lines.append(f"| {name} | {s['cpu_pct']['mean']:.2f} ({s['cpu_pct']['min']:.2f}–{s['cpu_pct']['max']:.2f}) "
                         f"| {g('vcpu_pct')} | {g('main_pct')} | {g('vcpu_wakeups_s')} | {g('main_wakeups_s')} "
                         f"| {g('guest_LOC_s')} | {ipis if isinstance(ipis, str) else round(ipis, 1)} | {g('guest_ctxt_s')} |")
        lines += ["", "Variants: " + "; ".join(f"`{n}`: {d['definition']['note'] or ' '.join(d['definition']['add'])}"
                                                 for n, d in v["variants"].items()), ""]
    d = result.get("density_part")
    mem = lambda k: d.get("qemu_memory_mib", {}).get(k, {}).get("mean", "–")  # noqa: E731
    if d and "running" in d:
        lines += ["Density (template restores, the node's create):", "",
                  "| running idle | stopped by | per-sandbox CPU % (mean) | all of them, % of a core | host busy % "
                  "| MemAvailable drop / sandbox (settled) | QEMU RSS / PSS / anon per sandbox (mean) "
                  "| create while idle p50 / p90 |", "|---:|---|---:|---:|---:|---:|---:|---:|",
                  f"| {d['running']} | {d['stopped_by']} | {d['per_sandbox_cpu_pct'].get('mean')} "
                  f"| {d['cpu_pct_all_sandboxes']} | {d['host_busy_pct']} "
                  f"| {d['memavailable_drop_per_sandbox_mib']} ({d.get('memavailable_drop_per_sandbox_settled_mib')}) MiB "
                  f"| {mem('rss_mib')} / {mem('pss_mib')} / {mem('anon_mib')} MiB "
                  f"| {d['creates_p50_ms']} / {d['creates_p90_ms']} ms |", ""]
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    from vmm.images import DEFAULT_IMAGES_DIR  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="now,now-metrics,now-metrics-keepalive,now-sampler",
                   help=f"comma list of: {', '.join(variants())}")
    p.add_argument("--per-variant", type=int, default=3)
    p.add_argument("--window", type=float, default=60.0, help="seconds measured")
    p.add_argument("--settle", type=float, default=75.0,
                   help="seconds after the last boot before measuring (longer than envd's ACTIVE_FOR)")
    p.add_argument("--metrics-interval", type=float, default=5.0, help="the node's AENV_SANDBOX_METRICS_INTERVAL")
    p.add_argument("--cpu", type=int, default=2, help="vCPUs (base's default shape: 2 / 512 MiB)")
    p.add_argument("--memory", type=int, default=512)
    p.add_argument("--density", type=int, default=0, help="idle sandboxes to start for the density part (0: skip)")
    p.add_argument("--density-creates", type=int, default=5)
    p.add_argument("--density-max-create", type=float, default=30.0)
    p.add_argument("--density-min-free", type=int, default=2048, help="MiB of MemAvailable to leave")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--images-dir", default=os.environ.get("AENV_IMAGES_DIR", str(DEFAULT_IMAGES_DIR)))
    p.add_argument("--net-prefix", default="aenvi", help="network instance of the benchmark's driver")
    p.add_argument("--net-pool", default="10.24.0.0/20")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")  # agent.metrics (the now-sampler variant)
    import django  # noqa: PLC0415

    django.setup()
    for name in args.variants.split(","):
        if name not in variants():
            p.error(f"unknown variant {name!r}")
    t_start, load0 = time.monotonic(), os.getloadavg()
    monitor = LoadMonitor().start()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {"benchmark": "idle", "when": stamp, "git": git_state(), "notes": [],
                    "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "idle_kernel_args": list(idle_args()),
                    "host_mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 30), 1)}
    booter = Booter(Path(args.images_dir).absolute())
    result["image"] = booter.image
    try:
        if not args.no_variants:
            result["variants_part"] = run_variants(args, booter, monitor)
        if args.density:
            booter.driver.start_network()
            result["density_part"] = run_density(args, booter, monitor)
    finally:
        result["network_removed"] = booter.remove()
    result["notes"].append("QEMU CPU is schedstat time of all its threads over the window (not this process's "
                           "envd calls); guest counters span the settle period, the window and the reads")
    finish_run(result, monitor.stop(), t_start, load0)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"idle-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {base}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
