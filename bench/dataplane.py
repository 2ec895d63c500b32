"""Benchmark: the data plane's own cost on a sandbox user port, without a VM.

A host-side HTTP server stands in for the guest port (the very server ``bench/lifecycle.py``
starts in the guest: ``GUEST_HTTP_SERVER``, 3-byte answers over HTTP/1.1 keep-alive), and a
Sandbox row on a throwaway SQLite database (or ``--database-url``) routes to it with
``guest_host=127.0.0.1``, as the non-VM tests run envd on the host. The data plane is started
as deployed (``python -m dataplane.serve``: uvicorn serving ``config.dataplane_asgi`` plus
``--uvicorn-args``, with the hot path — HAProxy, ``dataplane.handoff`` — unless ``--hotpath off``).
Small GETs go, in the same run and alternating, straight to the server (raw), through the data
plane (E2b-Sandbox-Id / E2b-Sandbox-Port headers, a traffic access token unless
``--no-traffic-token``), through a second data plane without its hot path ("python only", unless
``--no-python-only``) and through a bare HAProxy (the reference, when installed) from 1, 8 and 64
keep-alive clients of a separate load process (raw sockets on asyncio: a light client, so the
two cores go to what is measured). ``--baseline DIR`` adds, in the same run and alternating, a
data plane with its hot path started from another checkout (e.g. an older commit's ``git
archive``): before / after a change of the hot path under the same load.

    .venv/bin/python bench/dataplane.py [--requests 3000] [--runs 3] [--clients 1,8,64]
        [--uvicorn-args "--loop uvloop --http httptools"] [--workers 1] [--hotpath on|off]
        [--baseline /tmp/aenv-before]

Prints the table and writes JSON + markdown to bench/results/dataplane-<UTC stamp>.{json,md};
the host's load average and its CPU use by others are recorded per run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lifecycle_api import GUEST_HTTP_SERVER  # noqa: E402
from bench.lifecycle_common import percentile  # noqa: E402
from harness.ports import free_port  # noqa: E402

TARGET_P50_RATIO, TARGET_RPS_RATIO = 1.3, 0.8  # issue 26: data plane vs straight to the guest
SANDBOX_ID = "benchdataplane"
TRAFFIC_TOKEN = "bench-traffic-token"
BODY = b"ok\n"


def wait_port(port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start:\n{log.read_text()[-3000:]}")


# ---- the load process: N keep-alive clients on raw sockets ------------------------------------

async def _client(port: int, request: bytes, count: int, ready: asyncio.Barrier, out: list, starts: list):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def get() -> None:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        if status != b"200" or body != BODY:
            raise RuntimeError(f"unexpected answer {head!r} {body[:200]!r}")

    await get()  # the connection (and the data plane's upstream one), not timed
    await ready.wait()
    starts.append(time.perf_counter())
    for _ in range(count):
        t0 = time.perf_counter()
        await get()
        out.append((time.perf_counter() - t0) * 1e3)
    writer.close()


async def _load(port: int, headers: dict, requests: int, clients: int) -> dict:
    lines = [b"GET / HTTP/1.1", b"Host: 127.0.0.1:%d" % port]
    lines += [f"{k}: {v}".encode() for k, v in headers.items()]
    request = b"\r\n".join(lines) + b"\r\n\r\n"
    ready, latencies, starts = asyncio.Barrier(clients), [], []
    per_client = max(1, requests // clients)
    await asyncio.gather(*(_client(port, request, per_client, ready, latencies, starts) for _ in range(clients)))
    return {"latencies": latencies, "rps": len(latencies) / (time.perf_counter() - min(starts))}


def load_main(argv: list[str]) -> None:
    port, requests, clients, headers = int(argv[0]), int(argv[1]), int(argv[2]), json.loads(argv[3])
    print(json.dumps(asyncio.run(_load(port, headers, requests, clients))))


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def proc_cpu(pids: list[int]) -> float:
    """utime + stime (jiffies) of these processes, from /proc."""
    total = 0.0
    for pid in pids:
        try:
            parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += float(parts[11]) + float(parts[12])
        except (OSError, IndexError):
            pass
    return total


def run_load(port: int, headers: dict, requests: int, clients: int, ours: list[int]) -> dict:
    busy0, total0 = cpu_times()
    load_proc = subprocess.Popen([sys.executable, __file__, "--load", str(port), str(requests), str(clients),
                                  json.dumps(headers)], stdout=subprocess.PIPE, cwd=ROOT)
    mine0 = proc_cpu(ours)
    out, _ = load_proc.communicate(timeout=600)
    if load_proc.returncode:
        raise RuntimeError(f"load process failed ({load_proc.returncode})")
    busy1, total1 = cpu_times()
    result = json.loads(out)
    span = (total1 - total0) or 1.0
    # Shares of all the host's cores: everything busy (this run's load process included),
    # and the data plane + stand-in guest server's own part.
    result["host_busy_pct"] = 100 * (busy1 - busy0) / span
    result["ours_cpu_pct_of_host"] = 100 * (proc_cpu(ours) - mine0) / span
    result["loadavg1"] = os.getloadavg()[0]
    return result


# ---- the stack ---------------------------------------------------------------------------------

SETUP_ROW = """
from datetime import timedelta
from django.utils import timezone
from sandboxes.models import Sandbox, Team, Template
team, _ = Team.objects.get_or_create(slug="bench", defaults={{"name": "bench"}})
tpl, _ = Template.objects.get_or_create(id="base")
Sandbox.objects.filter(id={sid!r}).delete()
Sandbox.objects.create(id={sid!r}, team=team, template=tpl, state="running", envd_host="127.0.0.1",
                       envd_port=1, guest_host="127.0.0.1", traffic_access_token={token!r},
                       end_at=timezone.now() + timedelta(hours=1))
"""


# The proven-proxy reference (``--haproxy``): HAProxy relaying to the same server, routed by
# the very header the data plane reads, connections kept alive both sides. It checks no
# token and reads no database: it is what a proxy steered by aenv would cost per request.
HAPROXY_CFG = """
global
    maxconn 4096
defaults
    mode http
    timeout connect 3s
    timeout client 300s
    timeout server 300s
    http-reuse always
frontend dp
    bind 127.0.0.1:{port}
    use_backend guest if {{ req.hdr(e2b-sandbox-id) -m str {sid} }}
backend guest
    http-request del-header e2b-sandbox-id
    http-request del-header e2b-sandbox-port
    http-request del-header e2b-traffic-access-token
    server g 127.0.0.1:{guest_port}
"""


class Stack:
    def __init__(self, args, tmp: Path):
        self.args, self.tmp, self.procs = args, tmp, []
        self.env = {**os.environ, "AENV_HOME": str(tmp), "PYTHONUNBUFFERED": "1"}
        self.env["DATABASE_URL"] = args.database_url or f"sqlite:///{tmp / 'db.sqlite3'}"
        self.env.setdefault("AENV_IMAGES_DIR", str(ROOT / "var" / "images"))

    def start(self, name: str, cmd: list[str], port: int, cwd=ROOT) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        wait_port(port, proc, name, log)
        return proc

    def up(self) -> None:
        py = sys.executable
        if not self.args.database_url:
            subprocess.run([py, "manage.py", "migrate", "-v0"], cwd=ROOT, env=self.env, check=True)
        token = "" if self.args.no_traffic_token else TRAFFIC_TOKEN
        subprocess.run([py, "manage.py", "shell", "-c", SETUP_ROW.format(sid=SANDBOX_ID, token=token)],
                       cwd=ROOT, env=self.env, check=True)
        self.guest_port = free_port()
        # A listen backlog for 64 clients (the stdlib's is 5): connections a proxy opens under
        # load would otherwise wait for SYN retransmits (1 s, 3 s), the server's doing.
        server = GUEST_HTTP_SERVER.format(port=self.guest_port).replace('"0.0.0.0"', '"127.0.0.1"')
        server = server.replace("http.server.ThreadingHTTPServer(",
                                "http.server.ThreadingHTTPServer.request_queue_size = 256\n"
                                "http.server.ThreadingHTTPServer(")
        self.guest = self.start("guest", [py, "-c", server], self.guest_port)
        uvicorn = ["--no-access-log", "--timeout-keep-alive", "300", "--log-level", "warning",
                   *shlex.split(self.args.uvicorn_args)]
        if self.args.workers > 1:
            uvicorn += ["--workers", str(self.args.workers)]
        self.dp_port = free_port()
        if self.args.source:  # an older checkout: started as it was deployed then
            cmd = [py, "-m", "uvicorn", "config.dataplane_asgi:application", "--host", "127.0.0.1",
                   "--port", str(self.dp_port), *uvicorn]
        else:
            cmd = [py, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(self.dp_port),
                   "--hotpath", self.args.hotpath, *shlex.split(self.args.serve_args), "--", *uvicorn]
        self.dataplane = self.start("dataplane", cmd, self.dp_port, cwd=self.args.source or ROOT)
        self.py_port = None
        if self.args.python_only and not self.args.source and self.args.hotpath != "off":
            self.py_port = free_port()
            self.python_only = self.start("python-only", [
                py, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(self.py_port), "--hotpath", "off",
                "--", *uvicorn], self.py_port)
        self.base_port = None
        if self.args.baseline:
            self.base_port = free_port()
            self.baseline = self.start("baseline", [
                py, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(self.base_port), "--hotpath", "on",
                "--", *uvicorn], self.base_port, cwd=self.args.baseline)
        self.haproxy_port = None
        if self.args.haproxy:
            self.haproxy_port = free_port()
            cfg = self.tmp / "haproxy.cfg"
            cfg.write_text(HAPROXY_CFG.format(port=self.haproxy_port, sid=SANDBOX_ID, guest_port=self.guest_port))
            self.haproxy = self.start("haproxy", [shutil.which("haproxy"), "-f", str(cfg), "-db"], self.haproxy_port)
        self.headers = {"E2b-Sandbox-Id": SANDBOX_ID, "E2b-Sandbox-Port": str(self.guest_port)}
        if token:
            self.headers["E2b-Traffic-Access-Token"] = token

    def ours(self) -> list[int]:
        """The stand-in guest's and every data plane's processes (HAProxy, uvicorn, workers)."""
        pids, todo = [self.guest.pid], [p.pid for p in self.procs if p is not self.guest]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            children = Path(f"/proc/{pid}/task/{pid}/children")
            if children.exists():
                todo += [int(p) for p in children.read_text().split()]
        return pids

    def down(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def summarize(latencies: list[float], rps: list[float]) -> dict:
    return {"n": len(latencies), "p50_ms": percentile(latencies, 50), "p90_ms": percentile(latencies, 90),
            "p99_ms": percentile(latencies, 99), "rps": statistics.median(rps)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        return load_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="GETs per run and client count (split over clients)")
    p.add_argument("--runs", type=int, default=3, help="alternating raw / data plane runs per client count")
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--uvicorn-args", default="", help='extra uvicorn options, e.g. "--loop uvloop --http httptools"')
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--hotpath", choices=("on", "off"), default="on" if shutil.which("haproxy") else "off",
                   help="the data plane's hot path (dataplane.serve --hotpath; default: on when HAProxy is installed)")
    p.add_argument("--serve-args", default="", help='extra dataplane.serve options, e.g. "--haproxy-threads 2"')
    p.add_argument("--python-only", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure a data plane without its hot path, in the same run")
    p.add_argument("--database-url", default="", help="an existing, migrated database (default: a fresh SQLite)")
    p.add_argument("--no-traffic-token", action="store_true")
    p.add_argument("--label", default="", help="a name for this configuration in the results")
    p.add_argument("--haproxy", action=argparse.BooleanOptionalAction, default=bool(shutil.which("haproxy")),
                   help="also measure HAProxy in front of the same server (default: when installed)")
    p.add_argument("--baseline", default="", help="also measure a data plane with its hot path started from this "
                                                   "checkout (before / after a change), in the same run")
    p.add_argument("--source", default="", help="run the data plane from this checkout (e.g. an older commit's "
                                                 "`git archive`), to compare in the same conditions")
    args = p.parse_args()

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    with tempfile.TemporaryDirectory(prefix="aenv-bench-dp-") as tmp:
        stack = Stack(args, Path(tmp))
        try:
            stack.up()
            rows, raw_runs = [], []
            for clients in [int(c) for c in args.clients.split(",")]:
                targets = [("raw", stack.guest_port, {}), ("dataplane", stack.dp_port, stack.headers)]
                if stack.py_port:
                    targets.append(("python_only", stack.py_port, stack.headers))
                if stack.base_port:
                    targets.append(("baseline", stack.base_port, stack.headers))
                if stack.haproxy_port:
                    targets.append(("haproxy", stack.haproxy_port, stack.headers))
                data = {name: ([], [], []) for name, _, _ in targets}
                for _ in range(args.runs):
                    for name, port, headers in targets:
                        r = run_load(port, headers, args.requests, clients, stack.ours())
                        lat, rps, runs = data[name]
                        lat.extend(r["latencies"])
                        rps.append(r["rps"])
                        runs.append({k: v for k, v in r.items() if k != "latencies"})
                raw, dp = summarize(*data["raw"][:2]), summarize(*data["dataplane"][:2])
                hap = summarize(*data["haproxy"][:2]) if "haproxy" in data else None
                pyo = summarize(*data["python_only"][:2]) if "python_only" in data else None
                base = summarize(*data["baseline"][:2]) if "baseline" in data else None
                loads = [run["loadavg1"] for name in data for run in data[name][2]]
                busy = [run["host_busy_pct"] for name in data for run in data[name][2]]
                rows.append({"clients": clients, "raw": raw, "dataplane": dp, "haproxy": hap, "python_only": pyo,
                             "baseline": base,
                             "p50_ratio": dp["p50_ms"] / raw["p50_ms"], "rps_ratio": dp["rps"] / raw["rps"],
                             "loadavg1": [min(loads), max(loads)], "host_busy_pct": statistics.median(busy),
                             "runs": {n: data[n][2] for n in data}})
                raw_runs.append(clients)
        finally:
            stack.down()
    result = {"benchmark": "dataplane", "stamp": stamp, "label": args.label, "uvicorn_args": args.uvicorn_args,
              "serve_args": args.serve_args,
              "hotpath": args.hotpath if not args.source else "as in the source",
              "source": args.source or "this checkout", "baseline": args.baseline,
              "workers": args.workers, "requests": args.requests, "runs": args.runs,
              "traffic_token": not args.no_traffic_token, "cpus": os.cpu_count(),
              "database": "given" if args.database_url else "sqlite",
              "targets": {"p50_ratio": TARGET_P50_RATIO, "rps_ratio": TARGET_RPS_RATIO}, "rows": rows}
    md = report(result)
    print(md)
    out = ROOT / "bench" / "results" / f"dataplane-{stamp}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(md + "\n")
    print(f"\nwritten: {out}.json, .md")


def report(result: dict) -> str:
    lines = [f"data plane vs straight to the guest port ({result['label'] or 'default'}; hot path "
             f"{result.get('hotpath', 'off')}; uvicorn "
             f"{result['uvicorn_args'] or '(defaults)'}, workers {result['workers']}; {result['requests']} GETs "
             f"x {result['runs']} runs per row)", "",
             "| clients | raw p50 / p99 ms | data plane p50 / p99 ms | p50 ratio | raw req/s | data plane req/s "
             "| req/s ratio | python only p50 ms, req/s (ratios) | bare HAProxy p50 ms, req/s (ratios) "
             "| baseline p50 ms, req/s (ratios) | load avg (1 min) | host busy % |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        raw, dp = r["raw"], r["dataplane"]
        ok_p = "" if r["p50_ratio"] <= TARGET_P50_RATIO else " ✗"
        ok_r = "" if r["rps_ratio"] >= TARGET_RPS_RATIO else " ✗"
        lines.append(f"| {r['clients']} | {raw['p50_ms']:.2f} / {raw['p99_ms']:.2f} | {dp['p50_ms']:.2f} / "
                     f"{dp['p99_ms']:.2f} | {r['p50_ratio']:.2f}×{ok_p} | {raw['rps']:.0f} | {dp['rps']:.0f} | "
                     f"{r['rps_ratio']:.2f}×{ok_r} | {_other(r, 'python_only')} | {_other(r, 'haproxy')} | "
                     f"{_other(r, 'baseline')} | "
                     f"{r['loadavg1'][0]:.2f}–{r['loadavg1'][1]:.2f} | "
                     f"{r['host_busy_pct']:.0f} |")
    return "\n".join(lines)


def _other(row: dict, name: str) -> str:
    hap, raw = row.get(name), row["raw"]
    if not hap:
        return "–"
    return (f"{hap['p50_ms']:.2f}, {hap['rps']:.0f} ({hap['p50_ms'] / raw['p50_ms']:.2f}×, "
            f"{hap['rps'] / raw['rps']:.2f}×)")


if __name__ == "__main__":
    main()
