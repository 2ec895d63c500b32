"""The soak itself (issue 27.1), shared by bench/soak.py (a stack of its own, the table, the
JSON) and tests/integration/test_soak.py (a short run on the session's stack, asserting the
invariants).

Why a soak: single operations pass their tests; what breaks after hours is what accumulates
(a route, a pooled connection, a descriptor, a slot or a RAM file per operation) or a race
that needs thousands of tries. So one sandbox does ``cycles`` pause → connect cycles while
``sandboxes`` others run, at the same time, a mix of pause → connect, snapshot → create from
it, fork ×2, a network update, file writes and reads and commands, each with a long-running
counter (harness/guest_counter.py) whose pid must never change and whose count must
never go back. Everything goes through the official E2B SDK against the stack's API and data
plane, as users do; the SDK's own retries are off by default (``sdk_retries``) so every
failed answer is counted rather than hidden.

Counted: state lost (a counter restarted or gone back, a file that is not what was written, a
command counter that skipped), errors (any exception; its text kept), each operation's time
tagged with the main cycle it finished in (p50 / p99 per window of cycles: drift), and at
three quiet points (before the first cycle, after ``warmup`` cycles, at the end; the workers
wait at an operation boundary while they are taken) the RSS and open descriptors of the
node worker, the API and the data plane (their process groups, VMs excluded), the host's
MemAvailable and open files, and the stack's QEMU processes, snapshots and fork captures —
so a sandbox, snapshot or child left behind shows as growth too."""
from __future__ import annotations

import gc
import os
import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from e2b import Sandbox

from harness.guest_counter import read_counter, start_counter

STATE_FILE = "/home/user/soak.txt"
N_FILE = "/home/user/n"
# Rules the network step alternates (TEST-NET-3: nothing the guest talks to).
NETWORKS = ({"deny_out": ["203.0.113.7/32"]}, {}, {"allow_out": ["203.0.113.8"], "deny_out": ["203.0.113.0/24"]})
WORKER_OPS = ("pause_connect", "files", "snapshot_restore", "network", "fork2")


class StateLost(Exception):
    """An invariant of the sandbox's state failed (not an error answer: a wrong one)."""


@dataclass
class Config:
    cycles: int = 1000
    sandboxes: int = 8
    warmup: int = 100            # cycles before the second measurement (leak baseline)
    window: int = 100            # cycles per percentile window
    timeout: int = 3600          # each sandbox's timeout, renewed by every connect
    sdk_retries: int = 0
    max_errors: int = 25         # stop early past this many errors + state lost
    settle: float = 120          # s the end measurement waits for idle connections to close
    minutes: float = 0           # stop the cycles after this long (0: no limit), cleanly
    stop_file: str = ""          # stop the cycles, as cleanly, once this file exists ("": never)
    worker_pause: float = 0      # s each worker waits between its operations (0: back to back)
    seed: int = 27


@dataclass
class Result:
    samples: list = field(default_factory=list)        # (op, seconds, cycle)
    errors: list = field(default_factory=list)          # {"who", "op", "cycle", "error"}
    state_lost: list = field(default_factory=list)      # same shape
    points: dict = field(default_factory=dict)          # name -> measurement
    cycles_done: int = 0
    time_limited: bool = False
    worker_ops: dict = field(default_factory=dict)      # op -> count done
    duration_s: float = 0.0


class Gate:
    """Lets the main loop stop the workers at an operation boundary for a quiet measurement."""

    def __init__(self, workers: int):
        self.cond = threading.Condition()
        self.closed = False
        self.waiting = 0
        self.active = workers

    def check(self) -> None:
        with self.cond:
            if not self.closed:
                return
            self.waiting += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.closed)
            self.waiting -= 1

    def leave(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def close(self, timeout: float = 900) -> bool:
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.waiting >= self.active, timeout=timeout)

    def open(self) -> None:
        with self.cond:
            self.closed = False
            self.cond.notify_all()


def _pgroup(leader: int) -> list[int]:
    """The processes of ``leader``'s process group, QEMU excluded (VMs start sessions of their own
    anyway; this is the guard if one did not)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == leader and not comm.startswith("qemu"):
            pids.append(int(d.name))
    return pids


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def process_figures(leaders: dict[str, int]) -> dict:
    """RSS (MiB), open descriptors and TCP connections of each named process group, summed over
    its processes; ``own`` of those connections are from this process's clients (the SDK keeps
    up to 20 idle connections per host for 300 s: the client's choice, not the server's leak),
    ``fds_net`` the descriptors without them, what the leak check compares."""
    import psutil  # noqa: PLC0415

    mine = {tuple(c.laddr) for c in psutil.Process().net_connections(kind="tcp") if c.raddr}
    out = {}
    for name, leader in leaders.items():
        rss = fds = tcp = own = n = 0
        by_process: dict[str, int] = {}
        tcp_to: dict[str, int] = {}  # "<process> <remote address> <state>": count, to tell what a descriptor growth is
        for pid in _pgroup(leader):
            try:
                proc = psutil.Process(pid)
                proc_name = proc.name()
                rss += _rss_kib(pid)
                count = len(os.listdir(f"/proc/{pid}/fd"))
                fds += count
                by_process[f"{proc_name}[{pid}]"] = count
                conns = proc.net_connections(kind="tcp")
                tcp += len(conns)
                own += sum(1 for c in conns if c.raddr and tuple(c.raddr) in mine)
                for c in conns:
                    where = f"{proc_name} {c.raddr[0] if c.raddr else 'listen'} {c.status}"
                    tcp_to[where] = tcp_to.get(where, 0) + 1
                n += 1
            except (OSError, psutil.Error):
                continue  # ended meanwhile
        out[name] = {"rss_mib": round(rss / 1024, 1), "fds": fds, "fds_net": fds - own, "tcp": tcp,
                     "own_client_conns": own, "processes": n, "fds_by_process": by_process, "tcp_to": tcp_to}
    return out


def host_figures() -> dict:
    mem = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemAvailable", "Shmem"):
            mem[key] = int(rest.split()[0]) // 1024
    open_files = int(Path("/proc/sys/fs/file-nr").read_text().split()[0])
    return {"mem_available_mib": mem.get("MemAvailable", 0), "shmem_mib": mem.get("Shmem", 0),
            "open_files": open_files}


def stack_figures(home: Path) -> dict:
    """What the stack holds on disk and in processes: a leak of sandboxes, snapshots or fork
    captures shows here."""
    from cluster.processes import qemu_pids  # noqa: PLC0415

    def count(sub: str) -> int:
        d = home / sub
        return sum(1 for _ in d.iterdir()) if d.exists() else 0
    return {"qemu": len(qemu_pids(str(home))), "sandbox_dirs": count("sandboxes"),
            "snapshots": count("snapshots"), "fork_captures": count("forks")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


class Soak:
    """One run. ``leaders``: name -> pid of the process-group leaders to watch (node, api,
    dataplane); ``home``: the stack's home (its QEMU processes and directories)."""

    def __init__(self, cfg: Config, leaders: dict[str, int], home: Path, log=print):
        self.cfg, self.leaders, self.home, self.log = cfg, leaders, Path(home), log
        self.result = Result()
        self.lock = threading.Lock()
        self.cycle = 0
        self.stop = threading.Event()
        self.gate = Gate(cfg.sandboxes)
        self.opts = {"retries": cfg.sdk_retries}
        self.owned: set[str] = set()   # sandboxes alive now, to kill at the end
        self.made: set[str] = set()    # every sandbox made
        self.ready = 0                 # workers with their sandbox

    # ---------------------------------------------------------------- bookkeeping

    def timed(self, op: str, fn, *a, **kw):
        t0 = time.monotonic()
        out = fn(*a, **kw)
        with self.lock:
            self.result.samples.append((op, time.monotonic() - t0, self.cycle))
        return out

    def failed(self, who: str, op: str, exc: BaseException) -> None:
        entry = {"who": who, "op": op, "cycle": self.cycle, "at": time.strftime("%H:%M:%S"),
                 "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if not isinstance(exc, StateLost):
            entry["trace"] = "".join(traceback.format_exception(exc))[-3000:]
        with self.lock:
            (self.result.state_lost if isinstance(exc, StateLost) else self.result.errors).append(entry)
            total = len(self.result.errors) + len(self.result.state_lost)
        self.log(f"[soak] {'STATE LOST' if isinstance(exc, StateLost) else 'ERROR'} {who} {op} "
                 f"cycle {entry['cycle']}: {entry['error'][:300]}")
        if total >= self.cfg.max_errors:
            self.log(f"[soak] {total} failures: stopping early")
            self.stop.set()

    def own(self, sid: str) -> None:
        with self.lock:
            self.owned.add(sid)
            self.made.add(sid)

    def measure(self, name: str, settle_below: dict | None = None) -> None:
        """The figures now; with ``settle_below`` (an earlier point), first up to
        ``Config.settle`` s for descriptors above that point's +10 % to close: idle keep-alive
        connections (the data plane's upstream pools expire in 30-60 s, the SDK's clients of
        sandboxes already dropped) are not leaked ones, and a leaked one never closes."""
        t0 = time.monotonic()
        while True:
            gc.collect()  # SDK objects of earlier connects: their client connections close
            procs = process_figures(self.leaders)
            over = [k for k, v in procs.items() if settle_below
                    and v["fds_net"] > settle_below["processes"].get(k, {}).get("fds_net", 0) * 1.1]
            if not over or time.monotonic() - t0 > self.cfg.settle:
                break
            time.sleep(5)
        self.result.points[name] = {"cycle": self.cycle, "at": time.strftime("%H:%M:%S"), "processes": procs,
                                    "host": host_figures(), "stack": stack_figures(self.home),
                                    "settle_s": round(time.monotonic() - t0, 1)}
        p = self.result.points[name]
        self.log(f"[soak] {name} (cycle {self.cycle}): " + ", ".join(
            f"{k} {v['rss_mib']} MiB / {v['fds']} fds ({v['own_client_conns']} ours)"
            for k, v in p["processes"].items())
            + f"; host {p['host']}; stack {p['stack']}")

    def quiet_measure(self, name: str, settle_below: str | None = None) -> None:
        if not self.gate.close():
            self.log(f"[soak] workers did not reach a boundary for {name}: measured anyway")
        try:
            self.measure(name, self.result.points.get(settle_below) if settle_below else None)
        finally:
            self.gate.open()

    # ---------------------------------------------------------------- one sandbox's state

    def _new(self, who: str, template: str = "base") -> "Tracked":
        sbx = self.timed("create", Sandbox.create, template, timeout=self.cfg.timeout, **self.opts)
        self.own(sbx.sandbox_id)
        t = Tracked(sbx, who)
        t.sbx.files.write(STATE_FILE, t.content)
        t.sbx.commands.run(f"echo 0 > {N_FILE}")
        t.pid, t.count = start_counter(t.sbx)
        return t

    def check(self, t: "Tracked", sbx=None, *, same_count_floor: bool = True) -> None:
        """The sandbox (or a copy of it: ``sbx``) still has what ``t`` last wrote and the
        counter's process, its count never lower than last seen."""
        s = sbx or t.sbx
        content = s.files.read(STATE_FILE)
        if content != t.content:
            raise StateLost(f"{STATE_FILE} is {content[:80]!r}, expected {t.content[:80]!r}")
        pid, n = read_counter(s)
        if pid != t.pid:
            raise StateLost(f"counter restarted: pid {pid}, was {t.pid}")
        if n < t.count:
            raise StateLost(f"counter went back: {n} after {t.count}")
        if sbx is None and same_count_floor:
            t.count = n

    def bump(self, t: "Tracked") -> None:
        """The command counter in the guest: one more, exactly."""
        out = self.timed("run", t.sbx.commands.run,
                         f"n=$(( $(cat {N_FILE}) + 1 )); echo $n > {N_FILE}; echo $n").stdout.strip()
        if out != str(t.runs + 1):
            raise StateLost(f"command counter is {out!r}, expected {t.runs + 1}")
        t.runs += 1

    def pause_connect(self, t: "Tracked") -> None:
        if self.timed("pause", t.sbx.pause) is not True:
            raise StateLost("pause answered not True")
        t.sbx = self.timed("connect", Sandbox.connect, t.sbx.sandbox_id, timeout=self.cfg.timeout, **self.opts)
        self.check(t)
        self.bump(t)

    # ---------------------------------------------------------------- the workers' operations

    def op_pause_connect(self, t):
        self.pause_connect(t)

    def op_files(self, t):
        t.content = f"{t.who} {t.runs} {random.getrandbits(64):016x} " + "x" * random.randrange(0, 4096)
        self.timed("write", t.sbx.files.write, STATE_FILE, t.content)
        got = self.timed("read", t.sbx.files.read, STATE_FILE)
        if got != t.content:
            raise StateLost(f"read back {len(got)} chars, wrote {len(t.content)}")
        self.check(t)
        self.bump(t)

    def op_snapshot_restore(self, t):
        floor = read_counter(t.sbx)[1]
        info = self.timed("snapshot", t.sbx.create_snapshot)
        restored = None
        try:
            restored = self.timed("create_from_snapshot", Sandbox.create, info.snapshot_id, timeout=600, **self.opts)
            self.own(restored.sandbox_id)
            self.check(t, restored)
            if read_counter(restored)[1] < floor:
                raise StateLost("the restored counter is below its value before the snapshot")
            self.check(t)  # the source ran on
        finally:
            if restored is not None:
                self.timed("kill", restored.kill)
                self.owned.discard(restored.sandbox_id)
            self.timed("delete_snapshot", Sandbox.delete_snapshot, info.snapshot_id, **self.opts)
        self.bump(t)

    def op_network(self, t):
        rule = NETWORKS[t.runs % len(NETWORKS)]
        self.timed("network", t.sbx.update_network, rule)
        net = t.sbx.get_info().network or {}
        got = {k: sorted(net.get(k) or []) for k in ("allow_out", "deny_out")}
        want = {k: sorted(rule.get(k) or []) for k in ("allow_out", "deny_out")}
        if got != want:
            raise StateLost(f"network is {got}, set {want}")
        self.check(t)
        self.bump(t)

    def op_fork2(self, t):
        floor = read_counter(t.sbx)[1]
        results = self.timed("fork2", t.sbx.fork, count=2, timeout=600, **self.opts)
        children = [r for r in results if not isinstance(r, Exception)]
        try:
            for c in children:
                self.own(c.sandbox_id)
            failures = [r for r in results if isinstance(r, Exception)]
            if failures:
                raise failures[0]
            for c in children:
                self.check(t, c)
                if read_counter(c)[1] < floor:
                    raise StateLost("a child's counter is below the parent's before the fork")
            self.check(t)
        finally:
            for c in children:
                self.timed("kill", c.kill)
                self.owned.discard(c.sandbox_id)
        self.bump(t)

    def worker(self, index: int) -> None:
        who = f"w{index}"
        rng = random.Random(self.cfg.seed + index)
        ops = list(WORKER_OPS)
        t = None
        try:
            while not self.stop.is_set():
                self.gate.check()
                if self.stop.is_set():
                    break
                try:
                    if t is None:
                        t = self._new(who)
                        with self.lock:
                            self.ready += 1
                        continue
                    rng.shuffle(ops)
                    for op in ops:
                        if self.stop.is_set():
                            break
                        self.gate.check()
                        if self.cfg.worker_pause and self.stop.wait(self.cfg.worker_pause):
                            break
                        try:
                            getattr(self, f"op_{op}")(t)
                            with self.lock:
                                self.result.worker_ops[op] = self.result.worker_ops.get(op, 0) + 1
                        except Exception as exc:  # noqa: BLE001 - each failure is kept and counted
                            self.failed(who, op, exc)
                            self.resync(t)
                except Exception as exc:  # noqa: BLE001
                    self.failed(who, "create", exc)
                    time.sleep(2)
        finally:
            self.gate.leave()

    def resync(self, t) -> None:
        """After a failure: carry on from what the sandbox holds now, so one failure is counted
        once (a paused sandbox is connected again; a sandbox that is gone ends the worker's
        checks with the next errors)."""
        try:
            t.sbx = Sandbox.connect(t.sbx.sandbox_id, timeout=self.cfg.timeout, **self.opts)
            t.content = t.sbx.files.read(STATE_FILE)
            t.runs = int(t.sbx.files.read(N_FILE).strip() or 0)
            t.pid, t.count = read_counter(t.sbx)
        except Exception as exc:  # noqa: BLE001
            self.log(f"[soak] {t.who}: could not resync: {type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- the run

    def run(self) -> Result:
        cfg = self.cfg
        t_start = time.monotonic()
        main = self._new("main")
        threads = [threading.Thread(target=self.worker, args=(i,), daemon=True, name=f"soak-w{i}")
                   for i in range(cfg.sandboxes)]
        for th in threads:
            th.start()
        try:
            # the workers have made their sandboxes before the first measurement
            from harness.polling import until  # noqa: PLC0415

            until(lambda: self.ready >= cfg.sandboxes or self.stop.is_set(),
                  "the workers' sandboxes", deadline=900, interval=1)
            self.quiet_measure("before")
            for i in range(cfg.cycles):
                if self.stop.is_set():
                    break
                if cfg.minutes and time.monotonic() - t_start > cfg.minutes * 60:
                    self.log(f"[soak] {cfg.minutes} minutes are up after {self.cycle} cycles")
                    self.result.time_limited = True
                    break
                if cfg.stop_file and os.path.exists(cfg.stop_file):
                    self.log(f"[soak] {cfg.stop_file} exists: stopping after {self.cycle} cycles")
                    self.result.time_limited = True
                    break
                t0 = time.monotonic()
                try:
                    self.pause_connect(main)
                    with self.lock:
                        self.result.samples.append(("main_cycle", time.monotonic() - t0, self.cycle))
                except Exception as exc:  # noqa: BLE001
                    self.failed("main", "pause_connect", exc)
                    self.resync(main)
                self.cycle = i + 1
                self.result.cycles_done = self.cycle
                if self.cycle == min(cfg.warmup, cfg.cycles):
                    self.quiet_measure("after_warmup")
                if self.cycle % 10 == 0:
                    self.log(f"[soak] cycle {self.cycle}/{cfg.cycles}: {len(self.result.errors)} errors, "
                             f"{len(self.result.state_lost)} state lost, worker ops {self.result.worker_ops}")
            self.quiet_measure("end", settle_below="after_warmup")
        finally:
            self.stop.set()
            self.gate.open()
            for th in threads:
                th.join(timeout=900)
            for sid in list(self.owned):
                try:
                    Sandbox.kill(sid, **self.opts)
                except Exception as exc:  # noqa: BLE001
                    self.log(f"[soak] cleanup: kill {sid}: {exc}")
            self.result.duration_s = round(time.monotonic() - t_start, 1)
        return self.result


@dataclass
class Tracked:
    """A sandbox and what it must still hold."""
    sbx: Sandbox
    who: str
    content: str = ""
    pid: int = 0
    count: int = 0
    runs: int = 0

    def __post_init__(self):
        self.content = self.content or f"{self.who} start {random.getrandbits(64):016x}"


# ---------------------------------------------------------------- the figures from a result

def windows(samples: list, cycles: int, window: int) -> dict:
    """op -> [{"cycles": "a-b", "n", "p50_s", "p99_s"}] per window of ``window`` main cycles."""
    out: dict[str, list] = {}
    n_windows = max(1, -(-cycles // window))
    for op in sorted({s[0] for s in samples}):
        rows = []
        for w in range(n_windows):
            lo, hi = w * window, min(cycles, (w + 1) * window)
            vals = [s[1] for s in samples if s[0] == op and lo <= s[2] < hi]
            if vals:
                rows.append({"cycles": f"{lo}-{hi}", "n": len(vals), "p50_s": round(percentile(vals, 50), 3),
                             "p99_s": round(percentile(vals, 99), 3)})
        out[op] = rows
    return out


def drift(win: dict) -> dict:
    """op -> last window's p50 / p99 over the first window's (1.0: no drift)."""
    out = {}
    for op, rows in win.items():
        if len(rows) >= 2:
            a, b = rows[0], rows[-1]
            out[op] = {"p50_ratio": round(b["p50_s"] / a["p50_s"], 2) if a["p50_s"] else None,
                       "p99_ratio": round(b["p99_s"] / a["p99_s"], 2) if a["p99_s"] else None}
    return out


def leaks(points: dict, limit: float = 0.10) -> dict:
    """Growth from after the warm-up to the end, per process (RSS; descriptors other than this
    process's own client connections) and for the
    stack's holdings; ``leak`` when RSS grew more than ``limit`` or anything the stack holds
    (QEMU processes, snapshots, fork captures) is above its count after the warm-up."""
    a, b = points.get("after_warmup"), points.get("end")
    if not a or not b:
        return {}
    out = {}
    for name, fa in a["processes"].items():
        fb = b["processes"].get(name, {})
        rss = (fb.get("rss_mib", 0) - fa["rss_mib"]) / fa["rss_mib"] if fa["rss_mib"] else 0.0
        fds = (fb.get("fds_net", 0) - fa["fds_net"]) / fa["fds_net"] if fa["fds_net"] else 0.0
        out[name] = {"rss_growth": round(rss, 3), "fds_growth": round(fds, 3),
                     "leak": rss > limit or fds > limit}
    grew = {k: (a["stack"][k], b["stack"][k]) for k in a["stack"] if b["stack"][k] > a["stack"][k]}
    out["stack"] = {"grew": grew, "leak": bool(grew)}
    return out
