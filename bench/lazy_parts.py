"""The four measurements of bench/lazy.py (issue 24), each against the run's stack (node A,
the S3 store) and nodes it starts beside it: a create from a built template on a node that
never saw it vs on the node that built it; a resume on another node than the pause's; three
templates in turn through a node's bounded chunk cache; fork ×2N over three nodes of N each
vs fork ×N on one. Each kills what it made and stops its nodes, also when it fails."""
from __future__ import annotations

import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench import lazy_stats as stats
from bench.cluster import stop_second_node
from bench.cluster_api import SANDBOX_TTL_S, Api
from bench.cluster_parts import EXPORTED, WHERE, _marked, dist, drain
from bench.create_kill import parse_server_timing
from bench.lifecycle_common import MIB, run_cmd
from bench.templates import base_shape
from bench.templates_runs import db_json
from envd import ENVD_PORT
from nodes.protocol import pause_image_of

FILL = "/home/user/fill.bin"


@dataclass
class Ctx:
    """What every part gets: the options, node A's stack and API, the store, a scratch root."""

    args: object
    stack: object
    api: Api
    s3: object  # a boto3 client of the store
    bucket: str
    prefix: str
    root: Path
    templates: list = field(default_factory=list)  # built so far: {"name", "build_s", "snapshot_id", ...}
    made: set = field(default_factory=set)  # every sandbox id made (RAM files checked at the end)


# -- helpers ---------------------------------------------------------------------------------


def wait_answer(api: Api, sandbox_url: str, sid: str, deadline_s: float = 120) -> float:
    """Until the guest's envd answers ``/health`` through the data plane; when (perf_counter)."""
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
    end = time.monotonic() + deadline_s
    while True:
        try:
            if api.client.get(f"{sandbox_url}/health", headers=route, timeout=30).status_code == 204:
                return time.perf_counter()
        except Exception:  # noqa: BLE001 - not routable yet
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"envd of {sid} did not answer within {deadline_s:.0f} s")
        time.sleep(0.005)


def where(stack, ids) -> dict:
    return db_json(stack, WHERE.format(ids=list(ids))) if ids else {}


EVENTS = """
import json
from sandboxes.models import SandboxEvent as E
out = {{}}
for e in E.objects.filter(sandbox_id__in={ids!r}, operation={op!r}, outcome="ok").order_by("id"):
    out[e.sandbox_id] = (e.details or {{}}).get("timings") or {{}}
print("BENCH_JSON " + json.dumps(out))
"""


FORK_EVENTS = """
import json
from sandboxes.models import SandboxEvent as E
rows = E.objects.filter(sandbox_id={sid!r}, operation="fork").exclude(outcome__in=["started", "ok"]).order_by("-id")
out = [{{"outcome": e.outcome, "ms": e.duration_ms, "message": e.message[:200]}} for e in rows[:{n}]]
print("BENCH_JSON " + json.dumps(out[::-1]))
"""


def fork_events(stack, parent: str, n: int = 2, wait_s: float = 300) -> list:
    """The parent's last ``n`` fork events after the capture (``handed_over`` / ``handoff_skipped``,
    ``stored`` or ``error``): how long the hand-off and the upload took. A handed-over capture's
    upload ends after the fork answered: waited for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        got = db_json(stack, FORK_EVENTS.format(sid=parent, n=n))
        if any(e["outcome"] in ("stored", "error") for e in got) or time.monotonic() > deadline:
            return got
        time.sleep(1)


def node_timings(stack, ids, op: str) -> dict:
    """The node's own timings of each sandbox's last ``op`` (create, resume), from its event."""
    return db_json(stack, EVENTS.format(ids=list(ids), op=op)) if ids else {}


SNAPSHOT_OF = """
import json
from template_builds.models import TemplateBuild
b = TemplateBuild.objects.get(pk={build_id!r})
print("BENCH_JSON " + json.dumps({{"snapshot_id": b.snapshot_id, "node_id": b.node_id, "status": b.status}}))
"""


@contextmanager
def extra_node(ctx: Ctx, name: str, **kw):
    """A node worker beside the stack (harness.second_node.SecondNode ``name``), stopped at the
    end with its VMs, chunkfs daemon and network instance, and drained in the database so
    placement forgets it; its directories removed."""
    from harness.second_node import SecondNode  # noqa: PLC0415
    from harness.stack import stop_chunkfs  # noqa: PLC0415

    root = ctx.root / f"{name}-{uuid.uuid4().hex[:4]}"
    root.mkdir(parents=True)
    node = None
    try:
        t0 = time.monotonic()
        node = SecondNode(ctx.stack, root, name=name, **kw)
        node.start_s = round(time.monotonic() - t0, 1)
        yield node
    finally:
        if node is not None:
            stop_second_node(node)
            stop_chunkfs(node.home)
            try:
                drain(ctx.stack, node.id, True)
            except Exception:  # noqa: BLE001 - a gone row is fine
                pass
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def drained(stack, *node_ids: str):
    for n in node_ids:
        drain(stack, n, True)
    try:
        yield
    finally:
        for n in node_ids:
            drain(stack, n, False)


def timed_create(ctx: Ctx, template: str, tag: str) -> dict:
    """POST /v2/sandboxes → 201 → envd answering through the data plane; the sandbox stays."""
    t0 = time.perf_counter()
    a = ctx.api.create(template, tag=tag)
    if a.status != 201:
        raise RuntimeError(f"create {template}: {a.status} {a.error}")
    ctx.made.add(a.sandbox_id)
    t1 = wait_answer(ctx.api, ctx.stack.sandbox_url, a.sandbox_id)
    return {"sandbox_id": a.sandbox_id, "body": a.body, "api_ms": round(a.ms, 1),
            "answer_ms": round((t1 - t0) * 1e3, 1), "phases": a.phases}


def p50(values) -> float | None:
    return round(statistics.median(values), 1) if values else None


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


# -- templates ---------------------------------------------------------------------------------


def build_template(ctx: Ctx, index: int) -> dict:
    """A template FROM ``base`` (the base build's root disk under it) whose one RUN (its own:
    never the builder's cached layer) writes ``--fill-mib`` MiB of random bytes to
    /home/user/fill.bin and their sha256 beside it, built
    through the official SDK on node A (the only node up); its template snapshot is in the
    store. Returns its name, build time, snapshot id and size in the store."""
    from e2b import Template  # noqa: PLC0415

    fill = ctx.args.fill_mib
    name = f"lazy-{index}-{uuid.uuid4().hex[:6]}"
    shape = base_shape(ctx.stack)
    # the template's name in the command: an equal RUN would be the builder's CACHED layer of an
    # earlier template, the same fill (and chunks) again
    template = Template().from_template("base").run_cmd(
        f"echo {name} > /home/user/template-name && dd if=/dev/urandom of={FILL} bs=1M count={fill} status=none "
        f"&& sha256sum {FILL} > {FILL}.sha256")
    t0 = time.monotonic()
    info = Template.build(template, name, cpu_count=shape["cpu"], memory_mb=shape["memory_mb"])
    build_s = time.monotonic() - t0
    ctx.templates.append({"name": name})  # deleted at the end whatever follows
    rec = db_json(ctx.stack, SNAPSHOT_OF.format(build_id=str(info.build_id)))
    size = stats.stored_size(ctx.s3, ctx.bucket, ctx.prefix, rec["snapshot_id"])
    out = {"name": name, "fill_mib": fill, "build_s": round(build_s, 1), "built_on": rec["node_id"],
           "snapshot_id": rec["snapshot_id"], "shape": {k: shape[k] for k in ("cpu", "memory_mb", "disk_mb")},
           "size": size}
    ctx.templates[-1] = out
    print(f"built {name} in {build_s:.0f} s on {rec['node_id']}: {size['total_bytes'] / MIB:.0f} MiB in the store "
          f"({size['own_bytes'] / MIB:.0f} MiB its own files, {size['image_bytes'] / MIB:.0f} MiB image files)",
          flush=True)
    return out


def ensure_templates(ctx: Ctx, n: int) -> list[dict]:
    while len(ctx.templates) < n:
        build_template(ctx, len(ctx.templates))
    return ctx.templates[:n]


def _create_on(ctx: Ctx, node, tpl: dict, tag: str) -> dict:
    """A create of ``tpl`` that lands on ``node`` (the caller drained A): until envd answers,
    and what the node's chunkfs daemon fetched by then; the sandbox killed after."""
    before = stats.daemon_stats(node.home)
    row = timed_create(ctx, tpl["name"], tag)
    after = stats.daemon_stats(node.home)
    sid = row.pop("sandbox_id")
    row.pop("body")
    row.update(template=tpl["name"], node=where(ctx.stack, [sid]).get(sid), fetched=stats.delta(before, after),
               mount=stats.mount_figures(after, tpl["snapshot_id"]), cache=(after or {}).get("cache"),
               node_timings=node_timings(ctx.stack, [sid], "create").get(sid))
    ctx.api.kill(sid)
    return row


def part_template(ctx: Ctx) -> dict:
    """Two templates of the same shape and size (T0, T1). ``--runs`` creates of T0 on node A
    (which built it; one warm-up first); then per run a new node B that has never seen either
    template nor the base disk (A drained): a create of T1 there first — its first lazy
    restore, which also starts its chunkfs daemon and indexes its own files (a *cold* node) —
    then, once its daemon has stopped fetching (the first restore's read-ahead and prefetch
    would share the store's link), one of T0 (a *warm* node: its daemon running, the base disk's chunks a restore
    touches cached, T0's own layers and memory never seen). Until envd answers, p50 of each,
    the ratios to A's, and the bytes B's daemon fetched from the store by then."""
    tpl, other = ensure_templates(ctx, 2)
    runs = ctx.args.runs
    warm = timed_create(ctx, tpl["name"], "template-a-warm")
    ctx.api.kill(warm["sandbox_id"])
    on_a = []
    for _ in range(runs):
        row = timed_create(ctx, tpl["name"], "template-a")
        row["node"] = where(ctx.stack, [row["sandbox_id"]]).get(row["sandbox_id"])
        row["node_timings"] = node_timings(ctx.stack, [row["sandbox_id"]], "create").get(row["sandbox_id"])
        ctx.api.kill(row.pop("sandbox_id"))
        row.pop("body")
        on_a.append(row)
    cold, warm_b = [], []
    for _ in range(runs):
        with extra_node(ctx, "b", base_disk=False) as node, drained(ctx.stack, ctx.stack.node_id):
            cold.append({**_create_on(ctx, node, other, "template-b-cold"), "node_start_s": node.start_s})
            cold[-1]["settle"] = stats.settle(node.home)
            warm_b.append(_create_on(ctx, node, tpl, "template-b"))
        print(f"template on a new node: cold {cold[-1]['answer_ms']:.0f} ms, warm {warm_b[-1]['answer_ms']:.0f} ms "
              f"(fetched {cold[-1]['fetched']['store_bytes'] / MIB:.0f} / {warm_b[-1]['fetched']['store_bytes'] / MIB:.0f}"
              f" MiB in {stats.store_gets(cold[-1]['fetched'])} / {stats.store_gets(warm_b[-1]['fetched'])} GETs)",
              flush=True)
    a_ms = [r["answer_ms"] for r in on_a]
    out = {"template": tpl, "other_template": other, "runs": runs, "warm_up_ms": warm["answer_ms"], "on_builder": on_a,
           "builder_ms": dist(a_ms), "target_ratio": 1.5,
           "misplaced": sum(1 for r in on_a if r["node"] != ctx.stack.node_id) + sum(
               1 for r in cold + warm_b if r["node"] == ctx.stack.node_id)}
    for key, rows, t in (("new_node", warm_b, tpl), ("cold_node", cold, other)):
        ms = [r["answer_ms"] for r in rows]
        fetched = [r["fetched"]["store_bytes"] for r in rows]
        out.update({f"on_{key}": rows, f"{key}_ms": dist(ms), f"{key}_ratio_p50": ratio(p50(ms), p50(a_ms)),
                    f"{key}_fetched_bytes_p50": p50(fetched),
                    f"{key}_store_gets_p50": p50([stats.store_gets(r["fetched"]) for r in rows]),
                    f"{key}_fetched_pct_p50": round(100 * p50(fetched) / t["size"]["total_bytes"], 1)
                    if fetched and t["size"]["total_bytes"] else None,
                    f"{key}_wire_pct_p50": p50([w for w in (stats.wire_pct(r["fetched"], t["size"]["total_bytes"])
                                                            for r in rows) if w is not None])})
    return out


# -- resume on another node --------------------------------------------------------------------


def _paused_on_a(ctx: Ctx, i: int, j: int) -> dict:
    """A ``base`` sandbox on node A (the only node up) with a file written in it, paused and
    exported to the store; its pause image's size there."""
    a = ctx.api.create("base", tag="resume")
    if a.status != 201:
        raise RuntimeError(f"create: {a.status} {a.error}")
    ctx.made.add(a.sandbox_id)
    _marked(ctx.api, ctx.stack, a.body, f"run{i}-{j}")
    ctx.api.pause(a.sandbox_id)
    return {"body": a.body, "sid": a.sandbox_id, "mark": f"run{i}-{j}", "paused_at": time.time()}


def _resume_on(ctx: Ctx, node, p: dict) -> dict:
    """Connect → 201 → envd answering with A drained (so on ``node``); what the node's daemon
    fetched by then against the pause image; the file read back; the sandbox killed."""
    sid = p["sid"]
    image = stats.stored_size(ctx.s3, ctx.bucket, ctx.prefix, pause_image_of(sid))
    before = stats.daemon_stats(node.home)
    with drained(ctx.stack, ctx.stack.node_id):
        t0 = time.perf_counter()
        r = ctx.api.connect(sid)
        t1 = wait_answer(ctx.api, ctx.stack.sandbox_url, sid)
        after = stats.daemon_stats(node.home)
    fetched = stats.delta(before, after)
    lacked = image["own_bytes"] + sum(v for k, v in image["images"].items()
                                      if k == "rootfs" and ctx.args.resume_without_base_disk)
    row = {"connect_ms": round(r.ms, 1), "answer_ms": round((t1 - t0) * 1e3, 1), "phases": r.phases,
           "export_s": round(p["exported_at"] - p["paused_at"], 2), "image": image, "fetched": fetched,
           "fetched_pct_of_image": round(100 * fetched["store_bytes"] / image["total_bytes"], 1),
           "fetched_pct_of_lacked": round(100 * fetched["store_bytes"] / lacked, 1) if lacked else None,
           "wire_pct_of_image": stats.wire_pct(fetched, image["total_bytes"]),
           "mount": stats.mount_figures(after, pause_image_of(sid)), "node": where(ctx.stack, [sid]).get(sid),
           "node_is_b": False, "node_timings": node_timings(ctx.stack, [sid], "resume").get(sid)}
    row["node_is_b"] = row["node"] == node.id
    row["file_intact"] = _marked(ctx.api, ctx.stack, p["body"]) == p["mark"]
    ctx.api.kill(sid)
    return row


def part_resume(ctx: Ctx) -> dict:
    """Per run: two ``base`` sandboxes on node A, a file written in each, paused, until both
    pauses are exported to the store; then a new node B (with the base disk, as nodes have
    it, unless ``--resume-without-base-disk``) and, A drained, connect → envd answering of
    the first there (a cold node: its first lazy restore starts its chunkfs daemon and
    indexes its own files), then, its daemon quiet again, of the second (a warm node that
    never saw that pause image;
    chunks equal to the first one's, by content, are in its cache). Both files read back.
    What B's daemon fetched until each guest answered, against the pause image's size."""
    cold, warm = [], []
    for i in range(ctx.args.runs):
        paused = [_paused_on_a(ctx, i, j) for j in range(2)]
        exported = db_json(ctx.stack, EXPORTED.format(ids=[p["sid"] for p in paused]))
        if not all(exported.get(p["sid"]) for p in paused):
            raise RuntimeError(f"pauses not exported to the store within 100 s: {exported}")
        for p in paused:
            p["exported_at"] = exported[p["sid"]]
        with extra_node(ctx, "b", base_disk=not ctx.args.resume_without_base_disk) as node:
            cold.append({**_resume_on(ctx, node, paused[0]), "node_start_s": node.start_s})
            cold[-1]["settle"] = stats.settle(node.home)
            warm.append(_resume_on(ctx, node, paused[1]))
        print(f"resume on a new node: cold {cold[-1]['answer_ms']:.0f} ms ({cold[-1]['fetched_pct_of_image']} %), "
              f"warm {warm[-1]['answer_ms']:.0f} ms ({warm[-1]['fetched_pct_of_image']} % of "
              f"{warm[-1]['image']['total_bytes'] / MIB:.0f} MiB)", flush=True)
    out = {"runs": len(warm), "node_b_base_disk": not ctx.args.resume_without_base_disk, "target_ms": 1000,
           "target_pct": 10, "misplaced": sum(1 for r in cold + warm if not r["node_is_b"]),
           "all_files_intact": all(r["file_intact"] for r in cold + warm)}
    for key, rows in (("warm", warm), ("cold", cold)):
        pct = [r["fetched_pct_of_image"] for r in rows]
        out.update({f"{key}_rows": rows, f"{key}_answer_ms": dist([r["answer_ms"] for r in rows]),
                    f"{key}_connect_ms": dist([r["connect_ms"] for r in rows]), f"{key}_fetched_pct_p50": p50(pct),
                    f"{key}_wire_pct_p50": p50([r["wire_pct_of_image"] for r in rows
                                                if r.get("wire_pct_of_image") is not None]),
                    f"{key}_fetched_pct_of_lacked_p50": p50([r["fetched_pct_of_lacked"] for r in rows
                                                             if r["fetched_pct_of_lacked"] is not None])})
    return out


# -- a bounded cache serving three templates ---------------------------------------------------


def part_cache(ctx: Ctx) -> dict:
    """Three templates (each the base disk + ``--fill-mib`` MiB of its own) created in turn on
    one node B without the base disk and with ``AENV_CHUNK_CACHE_MB=--cache-mb``, A drained;
    each sandbox then reads its whole fill file in the guest (``sha256sum -c``: every byte
    through the cache, checked) and is killed. The daemon's stats are polled throughout."""
    tpls = ensure_templates(ctx, 3)
    rows = []
    env = {"AENV_CHUNK_CACHE_MB": str(ctx.args.cache_mb)}
    with extra_node(ctx, "b", base_disk=False, extra_env=env) as node, drained(ctx.stack, ctx.stack.node_id):
        watch = stats.CacheWatch(node.home).start()
        try:
            for tpl in tpls:
                row = {"template": tpl["name"], "template_mib": round(tpl["size"]["total_bytes"] / MIB)}
                before = stats.daemon_stats(node.home)
                try:
                    c = timed_create(ctx, tpl["name"], "cache")
                    row.update(created=True, answer_ms=c["answer_ms"])
                    t0 = time.monotonic()
                    out = run_cmd(ctx.stack.sandbox_url, f"sha256sum -c {FILL}.sha256", sandbox_id=c["sandbox_id"],
                                  token=c["body"].get("envdAccessToken"),
                                  envd_version=c["body"].get("envdVersion") or "0.6.4")
                    row.update(read_s=round(time.monotonic() - t0, 1), fill_intact=out.strip().endswith(": OK"))
                    ctx.api.kill(c["sandbox_id"])
                except Exception as exc:  # noqa: BLE001 - a failed create is this part's result
                    row.update(created=row.get("created", False), error=f"{type(exc).__name__}: {exc}"[:400])
                after = stats.daemon_stats(node.home)
                row.update(fetched=stats.delta(before, after), cache=(after or {}).get("cache"))
                rows.append(row)
                print(f"cache: {tpl['name']} created {row.get('created')}, read back intact "
                      f"{row.get('fill_intact')}, cache {((after or {}).get('cache') or {}).get('size_bytes', 0) / MIB:.0f}"
                      f" MiB", flush=True)
        finally:
            watch_summary = watch.stop()
    return {"cache_mb": ctx.args.cache_mb, "rows": rows, "watch": watch_summary,
            "all_created": all(r.get("created") for r in rows), "all_intact": all(r.get("fill_intact") for r in rows),
            "bound_kept": not watch_summary.get("over_bound", True) and watch_summary.get("samples", 0) > 0}


# -- fork over three nodes ---------------------------------------------------------------------


def fork_and_answer(ctx: Ctx, parent: str, count: int) -> dict:
    """POST /sandboxes/{parent}/fork ×``count``, then ``echo ok`` in every child at once
    through the data plane: when the last answered, from the call; children killed after.
    A refusal (not 201) is a result: its status and message."""
    t0 = time.perf_counter()
    resp = ctx.api.client.post(f"{ctx.api.url}/sandboxes/{parent}/fork", timeout=900,
                               json={"count": count, "timeout": SANDBOX_TTL_S})
    call_ms = (time.perf_counter() - t0) * 1e3
    phases = parse_server_timing(resp.headers.get("server-timing", ""))
    if resp.status_code != 201:
        try:
            message = resp.json().get("message")
        except ValueError:
            message = resp.text[:300]
        return {"count": count, "status": resp.status_code, "message": message, "call_ms": round(call_ms, 1),
                "phases": phases}
    entries = resp.json()
    kids = [e["sandbox"] for e in entries if isinstance(e, dict) and "sandbox" in e]
    ctx.api.adopt(k["sandboxID"] for k in kids)
    ctx.made.update(k["sandboxID"] for k in kids)
    errors = [e.get("error") for e in entries if isinstance(e, dict) and "sandbox" not in e]

    def answer(kid: dict) -> tuple[bool, float, str]:
        try:
            out = run_cmd(ctx.stack.sandbox_url, "echo ok", sandbox_id=kid["sandboxID"],
                          token=kid.get("envdAccessToken"), envd_version=kid.get("envdVersion") or "0.6.4")
            return out.strip() == "ok", (time.perf_counter() - t0) * 1e3, ""
        except Exception as exc:  # noqa: BLE001 - an unanswering child is counted, not fatal
            return False, (time.perf_counter() - t0) * 1e3, f"{type(exc).__name__}: {exc}"[:200]

    with ThreadPoolExecutor(max(1, len(kids))) as pool:
        answers = list(pool.map(answer, kids))
    placed = where(ctx.stack, [k["sandboxID"] for k in kids])
    per_node: dict[str, int] = {}
    last_per_node: dict[str, float] = {}
    for kid, (ok, ms, _) in zip(kids, answers):
        node = placed.get(kid["sandboxID"], "?")
        per_node[node] = per_node.get(node, 0) + 1
        if ok:
            last_per_node[node] = round(max(ms, last_per_node.get(node, 0.0)), 1)
    ok_ms = [ms for ok, ms, _ in answers if ok]
    t_kill = time.monotonic()
    failures = []

    def kill(kid: dict) -> None:
        try:
            ctx.api.kill(kid["sandboxID"])
        except Exception as exc:  # noqa: BLE001 - reported; the run's end kills what is left
            failures.append(f"{kid['sandboxID']}: {exc}"[:200])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(kill, kids))
    return {"count": count, "status": 201, "children": len(kids), "answered": len(ok_ms), "call_ms": round(call_ms, 1),
            "last_answer_ms": round(max(ok_ms), 1) if ok_ms else None, "answer_ms": dist(ok_ms),
            "errors": [e for e in errors if e][:5] + [m for ok, _, m in answers if not ok and m][:5],
            "per_node": per_node, "last_answer_ms_per_node": last_per_node, "phases": phases,
            "parent_fork_timings": node_timings(ctx.stack, [parent], "fork").get(parent),
            "parent_fork_events": fork_events(ctx.stack, parent) if len(per_node) > 1 else [],
            "kill_s": round(time.monotonic() - t_kill, 1), "kill_failures": failures}


def part_fork(ctx: Ctx) -> dict:
    """Nodes B and C beside A (each with the base disk, as cluster nodes are), the stack's
    ``AENV_FORK_MAX_PER_NODE`` = ``--fork-per-node`` (N). A ``base`` parent on A; fork ×N with
    B and C drained (all on A), then fork ×2N with all three open; until the last child
    answers, each, and their ratio."""
    n = ctx.args.fork_per_node
    with extra_node(ctx, "b") as b, extra_node(ctx, "c", net_pool=ctx.args.node_c_pool) as c:
        with drained(ctx.stack, b.id, c.id):
            a = ctx.api.create("base", tag="fork-parent")
        if a.status != 201:
            raise RuntimeError(f"create: {a.status} {a.error}")
        parent = a.sandbox_id
        ctx.made.add(parent)
        kept = None
        try:
            run_cmd(ctx.stack.sandbox_url, "echo ok", sandbox_id=parent, token=a.body.get("envdAccessToken"),
                    envd_version=a.body.get("envdVersion") or "0.6.4")
            if ctx.args.fork_warm_store:  # a snapshot of the parent kept: the base image files stay in the store
                kept = ctx.api.call("POST", f"/sandboxes/{parent}/snapshots", 201, json={}).body["snapshotID"]
            with drained(ctx.stack, b.id, c.id):
                one = fork_and_answer(ctx, parent, n)
            print(f"fork ×{n} on one node: {one.get('last_answer_ms')} ms ({one.get('status')})", flush=True)
            three = fork_and_answer(ctx, parent, 2 * n)
            print(f"fork ×{2 * n} on three nodes: {three.get('last_answer_ms')} ms ({three.get('status')} "
                  f"{three.get('message') or ''})", flush=True)
        finally:
            ctx.api.kill(parent)
            if kept is not None:
                ctx.api.call("DELETE", f"/templates/{kept}", 204)
        nodes = {"a": ctx.stack.node_id, "b": b.id, "c": c.id}
    return {"per_node_max": n, "nodes": nodes, "warm_store": bool(ctx.args.fork_warm_store),
            "one_node": one, "three_nodes": three,
            "ratio": ratio(three.get("last_answer_ms"), one.get("last_answer_ms")), "target_ratio": 1.5,
            "all_answered": three.get("answered") == 2 * n}


PARTS = {"template": part_template, "resume": part_resume, "cache": part_cache, "fork": part_fork}
