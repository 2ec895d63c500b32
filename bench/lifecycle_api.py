"""The API half of bench/lifecycle.py: the same lifecycle operations as the raw half
(bench/lifecycle_raw.py) through the E2B API of a running stack, each split by its
Server-Timing into node time and control-plane overhead; plus the user-port part (small
GETs to a guest HTTP server through the data plane and straight to the sandbox's slot).
Apart from the raw half so each reads as one way of driving the same verbs."""
from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time

from bench.lifecycle_common import PARENT_OPS, add_memory, mem_available, ms, run_cmd

USER_PORT = 8080  # the guest HTTP server of the user-port part


class Api:
    """The control-plane half: the same verbs through the E2B API, split by Server-Timing.
    Every sample is named ``api.<raw name>`` so it lines up with the raw one."""

    def __init__(self, args, api: str, sandbox_url: str, key: str, template: str, stack=None):
        self.args, self.api, self.sandbox_url, self.key = args, api.rstrip("/"), sandbox_url.rstrip("/"), key
        self.template, self.stack = template, stack
        self.samples: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.live: set[str] = set()  # sandboxes this run started and has not killed yet
        self.started: set[str] = set()  # every one, for the RAM-file sweep after the stack stops

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    @property
    def headers(self) -> dict:
        return {"X-API-Key": self.key}

    def timed(self, client, name: str, method: str, path: str, expect: int, *, node_of=None, **kw):
        """One API call; adds api.<name> (client ms), .node, .overhead; returns (response, ms)."""
        from bench.create_kill import parse_server_timing  # noqa: PLC0415

        t0 = time.perf_counter()
        resp = client.request(method, f"{self.api}{path}", headers=self.headers, timeout=600, **kw)
        wall = ms(t0, time.perf_counter())
        if resp.status_code != expect:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        phases = parse_server_timing(resp.headers.get("server-timing", ""))
        node = node_of(phases) if node_of else phases.get("node")
        self.add(f"api.{name}", wall)
        if node is not None:
            self.add(f"api.{name}.node", node)
            self.add(f"api.{name}.overhead", wall - node)
            if "dispatch" in phases:  # the Celery round trip without the node's work
                self.add(f"api.{name}.dispatch", phases["dispatch"])
        return resp, wall

    @staticmethod
    def create_node_ms(phases: dict) -> float | None:
        """A create's node time: its total minus placement (schedule) and the Celery round
        trip without the node's work (dispatch); see lifecycle.sandboxes.create.create_phases."""
        if "total" not in phases:
            return None
        return phases["total"] - phases.get("schedule", 0.0) - phases.get("dispatch", 0.0)

    def command(self, sbx: dict, cmd: str = "echo ok") -> str:
        """A command in an API sandbox through the data plane (official SDK, its own token)."""
        return run_cmd(self.sandbox_url, cmd, sandbox_id=sbx["sandboxID"], token=sbx.get("envdAccessToken"),
                       envd_version=sbx.get("envdVersion") or "0.6.4")

    def kill(self, client, sid: str) -> None:
        resp = client.delete(f"{self.api}/sandboxes/{sid}", headers=self.headers, timeout=120)
        if resp.status_code not in (204, 404):
            raise RuntimeError(f"kill {sid}: {resp.status_code} {resp.text[:300]}")
        self.live.discard(sid)

    def track(self, *ids: str) -> None:
        self.live.update(ids)
        self.started.update(ids)

    def kill_all(self, client) -> None:
        """After a failure: kill what is still alive through the API, so the node removes
        its VMs and RAM files the normal way (a SIGKILL would leave them in /dev/shm)."""
        for sid in list(self.live):
            try:
                self.kill(client, sid)
            except Exception as exc:  # noqa: BLE001 - best effort, the stack teardown follows
                print(f"cleanup: kill {sid} failed: {exc}", file=sys.stderr)

    def create(self, client, name: str, template: str) -> dict:
        """A create through the API → envd answering (the API answers after envd /init) →
        the first command through the data plane."""
        t0 = time.perf_counter()
        resp, _ = self.timed(client, name, "POST", "/v2/sandboxes", 201, node_of=self.create_node_ms,
                             json={"templateID": template, "timeout": 3600, "metadata": {"bench": "lifecycle"}})
        sbx = resp.json()
        self.track(sbx["sandboxID"])
        if self.command(sbx).strip() != "ok":
            raise RuntimeError(f"{name}: first command did not answer ok")
        self.add(f"api.{name}_first_command", ms(t0, time.perf_counter()))
        return sbx

    def run(self) -> None:
        import httpx  # noqa: PLC0415

        a, ops = self.args, set(self.args.ops.split(","))
        with httpx.Client() as client:
            try:
                self._run(client, a, ops)
            except BaseException:
                self.kill_all(client)
                raise

    def _run(self, client, a, ops) -> None:
        if "create" in ops:
            for _ in range(a.runs):
                self.kill(client, self.create(client, "create_from_template", self.template)["sandboxID"])
        if not ops & (PARENT_OPS | {"userport"}):
            return
        parent = self.create(client, "parent_create", self.template)
        sid = parent["sandboxID"]
        self.command(parent, "echo bench > /root/state.txt")
        if "disk" in ops or "pause" in ops:
            for _ in range(a.runs):
                self.timed(client, "pause_to_disk", "POST", f"/sandboxes/{sid}/pause", 204, json={})
                self.timed(client, "resume_from_disk", "POST", f"/sandboxes/{sid}/connect", 201,
                           json={"timeout": 3600})
                # nothing for the node to do: the whole call is control plane
                self.timed(client, "connect_running", "POST", f"/sandboxes/{sid}/connect", 200,
                           node_of=lambda p: 0.0, json={"timeout": 3600})
        if "fs" in ops:
            # a cold-boot resume loses the processes, not the files; the parent goes on as is
            for _ in range(a.fs_runs):
                self.timed(client, "pause_fs_only", "POST", f"/sandboxes/{sid}/pause", 204, json={"memory": False})
                self.timed(client, "resume_fs_only_cold_boot", "POST", f"/sandboxes/{sid}/connect", 201,
                           json={"timeout": 3600})
        if "snapshot" in ops:
            self.snapshots(client, sid)
        for count, runs in ((4, a.fork4_runs), (16, a.fork16_runs)):
            if f"fork{count}" in ops:
                for _ in range(runs):
                    self.fork(client, sid, count)
        if "userport" in ops:
            self.user_port(parent)
        self.pause_windows(sid)
        self.kill(client, sid)

    def snapshots(self, client, sid: str) -> None:
        for _ in range(self.args.runs):
            resp, _ = self.timed(client, "snapshot_total", "POST", f"/sandboxes/{sid}/snapshots", 201, json={})
            snap = resp.json()["snapshotID"]
            child = self.create(client, "create_from_snapshot", snap)
            self.kill(client, child["sandboxID"])
            gone = client.delete(f"{self.api}/templates/{snap}", headers=self.headers, timeout=120)
            if gone.status_code != 204:
                raise RuntimeError(f"delete snapshot {snap}: {gone.status_code} {gone.text[:300]}")

    def fork(self, client, sid: str, count: int) -> None:
        avail0 = mem_available()
        t0 = time.perf_counter()
        resp, _ = self.timed(client, f"fork{count}", "POST", f"/sandboxes/{sid}/fork", 201,
                             json={"count": count, "timeout": 600})
        entries = resp.json()
        kids = [e["sandbox"] for e in entries if "sandbox" in e]
        self.track(*(k["sandboxID"] for k in kids))
        try:
            if len(kids) != count:
                raise RuntimeError(f"API fork x{count}: {[e['error'] for e in entries if 'error' in e]}")
            with concurrent.futures.ThreadPoolExecutor(count) as pool:
                outs = list(pool.map(self.command, kids))
            t_all = time.perf_counter()
            assert all(o.strip() == "ok" for o in outs), outs
            self.add(f"api.fork{count}_all_answering", ms(t0, t_all))
            if self.stack is not None:
                pids = [p for k in kids for p in self.stack.qemu_pids(k["sandboxID"])]
                if len(pids) == count:
                    add_memory(self.add, f"api.fork{count}", pids, avail0)
        finally:
            with concurrent.futures.ThreadPoolExecutor(min(len(kids), 8) or 1) as pool:
                list(pool.map(lambda k: self.kill(client, k["sandboxID"]), kids))

    def user_port(self, sbx: dict) -> None:
        """A guest HTTP server on USER_PORT; small GETs through the data plane (E2b-Sandbox-Id /
        E2b-Sandbox-Port headers → the sandbox's guest_host:port) as api.userport_*, and the
        same straight from this host to guest_host:port (the slot address, read from the
        stack's DB) without the api. prefix, so API/raw = proxy / direct. Sequential with one
        keep-alive client, then ``--http-clients`` at once; proxy and direct alternate."""
        a, sid, port = self.args, sbx["sandboxID"], USER_PORT
        script = GUEST_HTTP_SERVER.format(port=port)
        self.command(sbx, f"cat > /tmp/bench_http.py <<'EOF'\n{script}\nEOF\n"
                          "(python3 /tmp/bench_http.py >/tmp/bench_http.log 2>&1 &) ; sleep 0.2; echo ok")
        proxy = (f"{self.sandbox_url}/", {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})
        targets = {"api.": proxy}
        guest_host = self.guest_host(sid)
        if guest_host:
            targets[""] = (f"http://{guest_host}:{port}/", {})
        else:
            self.notes.append("user port measured through the data plane only: the direct run needs --api auto "
                              "(guest_host from the stack's DB) and the netns backend")
        deadline = time.monotonic() + 60
        while True:  # the server has started (a refused connect is retried by the data plane)
            try:
                http_gets(*proxy, requests=1, clients=1)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for _ in range(a.http_runs):
            for clients, suffix in ((1, ""), (a.http_clients, "_concurrent")):
                for prefix, (url, headers) in targets.items():
                    latencies, rps = http_gets(url, headers, a.http_requests, clients)
                    self.samples.setdefault(f"{prefix}userport_get{suffix}", []).extend(latencies)
                    self.add(f"{prefix}userport{suffix}_rps", rps)
        self.notes.append(f"user port: {a.http_requests} GETs of 3 bytes per run, sequential on one keep-alive "
                          f"client and split over {a.http_clients} concurrent clients, {a.http_runs} run(s); "
                          "raw = this host straight to the slot address, API = through the data plane")

    def guest_host(self, sid: str) -> str:
        """Where the node reaches every port of the sandbox (its slot address), from the DB."""
        if self.stack is None:
            return ""
        out = self.stack.db("from sandboxes.models import Sandbox\n"
                            f"print('BENCH_HOST', Sandbox.objects.get(id={sid!r}).guest_host or '-')")
        host = out.split("BENCH_HOST", 1)[1].split()[0]
        return "" if host == "-" else host

    def pause_windows(self, sid: str) -> None:
        """The node's capture timings of this parent's snapshots and forks, from the
        SandboxEvents the control plane wrote (only with a stack of our own: needs its DB)."""
        if self.stack is None:
            self.notes.append("API parent pause windows need --api auto (read from the stack's SandboxEvents)")
            return
        code = f"""
import json
from sandboxes.models import SandboxEvent as E
ev = E.objects.filter(sandbox_id={sid!r}, outcome="ok").order_by("id")
snaps = [(e.details.get("timings") or {{}}).get("pause_ms") for e in ev.filter(operation="snapshot")]
forks = []
for e in ev.filter(operation="fork"):
    kids = e.details.get("children") or []
    t = {{}}
    for c in E.objects.filter(sandbox_id__in=kids, operation="create", outcome="ok"):
        t = (c.details or {{}}).get("timings") or {{}}
        if "capture.pause_ms" in t:
            break
    forks.append({{"count": len(kids), "pause_ms": t.get("capture.pause_ms"),
                  "ready_ms": t.get("fork_all_ready_ms")}})
print("BENCH_JSON " + json.dumps({{"snapshots": snaps, "forks": forks}}))
"""
        out = self.stack.db(code)
        data = json.loads(out.split("BENCH_JSON ", 1)[1])
        for v in data["snapshots"]:
            if v is not None:
                self.add("api.snapshot_pause_window", v)
        for f in data["forks"]:
            if f["pause_ms"] is not None:
                self.add(f"api.fork{f['count']}_parent_pause", f["pause_ms"])
                self.add(f"api.fork{f['count']}_children_ready", f["ready_ms"])


# The guest's HTTP server for the user-port part: a few bytes per GET, HTTP/1.1 keep-alive
# (python3 -m http.server answers HTTP/1.0 and closes every connection, which would measure
# TCP handshakes through the slot rather than the data plane), one thread per connection, a
# listen backlog for 64 clients connecting at once (socketserver's default is 5: the rest
# of the SYNs are dropped and retried seconds later).
# Head and body leave in one write (wbufsize; flushed after each request) with Nagle off:
# written separately, the body waits for the client's delayed ACK, ~40 ms per request.
GUEST_HTTP_SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 65536
    disable_nagle_algorithm = True
    def do_GET(self):
        body = b"ok\\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
class S(http.server.ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True
S(("0.0.0.0", {port}), H).serve_forever()
"""


def http_gets(url: str, headers: dict, requests: int, clients: int) -> tuple[list[float], float]:
    """``requests`` small GETs split over ``clients`` keep-alive httpx clients (one thread
    each); returns every request's latency (ms) and the throughput (requests/s from the moment
    every client is connected until the last answer). Each client's first GET (its
    connection) is not timed."""
    import httpx  # noqa: PLC0415

    per_client = max(1, requests // clients)
    connected = threading.Barrier(clients)
    starts: list[float] = []

    def one_client(_: int) -> list[float]:
        out = []
        with httpx.Client(headers=headers, timeout=30, trust_env=False) as c:  # no HTTP(S)_PROXY detour
            c.get(url).raise_for_status()
            connected.wait(timeout=120)
            starts.append(time.perf_counter())
            for _ in range(per_client):
                t0 = time.perf_counter()
                r = c.get(url)
                out.append(ms(t0, time.perf_counter()))
                if r.status_code != 200 or r.content != b"ok\n":
                    raise RuntimeError(f"GET {url}: {r.status_code} {r.text[:200]!r}")
        return out

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        latencies = [v for part in pool.map(one_client, range(clients)) for v in part]
    return latencies, len(latencies) / (time.perf_counter() - min(starts))
