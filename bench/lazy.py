"""Benchmark: on-demand images and snapshots (issue 24), with real VMs and the S3 store (a
moto server), in one run against a stack of its own (node A) and node workers it starts
beside it (harness.second_node):

1. template (``--parts template``): templates FROM ``base`` whose RUN writes ``--fill-mib``
   MiB of random bytes (their snapshot carries the base build's 911 MiB root disk, their own
   layer and memory: ~1.3 GiB in the store at the default) are built on A; ``--runs`` creates
   of one on A, then per run a new node B that has never seen the templates nor the base disk
   (its images dir lacks it): a create of the other template first (a cold node: its chunkfs
   daemon starts, its own files are indexed), then one of the first (a warm node): create →
   envd answering, p50 each, the ratios to A's (target ≤ 1.5×), and the bytes B's chunkfs
   daemon fetched from the store by then.
2. resume (``resume``): per run two ``base`` sandboxes paused on A and exported to the
   store, then a new node B (with the base disk, as nodes have it) where, A drained, the
   first resumes (connect; a cold node) and then the second (a warm node that never saw that
   pause image): until the guest answers, p50 of ``--runs`` each (target ≤ 1.0 s), and the
   bytes B fetched before it answered as % of the pause image (≤ 10 %).
3. cache (``cache``): three such templates created in turn on a node B with
   ``AENV_CHUNK_CACHE_MB=--cache-mb``, each sandbox reading its whole fill file back
   (``sha256sum -c``): each create succeeds, the cache's size (the daemon's stats, polled
   throughout) never exceeds its bound; evictions.
4. fork (``fork``): nodes B and C beside A, ``AENV_FORK_MAX_PER_NODE=--fork-per-node`` (N):
   fork ×N of a ``base`` sandbox with B and C drained vs fork ×2N over the three: until the
   last child answers, the ratio (target ≤ 1.5×); a refusal is reported as such.

``--peer-fetch``: every node has peer fetch on (any free port each), and with it a fork across
nodes hands its capture over before its upload ends (``AENV_FORK_HANDOFF``).

``--shape-store 1gbit`` (or ``none,1gbit`` for both in one run): the moto server runs in a
network namespace of the benchmark's, behind a veth pair whose both ends a ``tc`` token
bucket limits to that rate (harness.shaped_link); ``none``: moto on loopback. The link's
PUT/GET throughput is measured first and reported.

Everything made is removed at the end: sandboxes, templates (API delete), the extra nodes
(their VMs, chunkfs daemons, network instances), the stack, the moto server and its
namespace. The benchmark owns ``--net-pool``'s /16 (default 10.26.0.0/16): its stacks take
later /20s, node C ``--node-c-pool``, the store link ``--store-link`` (a /30).

    sudo .venv/bin/python bench/lazy.py [--parts template,resume,cache,fork] [--shape-store none,1gbit] [--peer-fetch] [--quick]
JSON + Markdown to bench/results/lazy-<UTC stamp>.{json,md} (--quick: 1 run each, 16 MiB
fills, a 256 MiB cache, fork ×2 vs ×4; to var/bench-quick/). Needs root and FUSE.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import lazy_parts as parts  # noqa: E402
from bench.cluster import _home, _shm_leftovers, api_of, stack_of  # noqa: E402
from bench.lazy_report import write_results  # noqa: E402
from bench.lifecycle_common import MIB, LoadMonitor, finish_run  # noqa: E402
from bench.templates import delete_template, git_state  # noqa: E402

BUCKET = "aenv-bench-lazy"


def probe_store(url: str, mib: int = 64, threads: int = 4) -> dict:
    """PUT and GET of ``mib`` MiB in 4 MiB objects, ``threads`` at a time: what the store and
    its link give a node (a chunk fetch is one such GET)."""
    from harness.moto_s3 import client  # noqa: PLC0415

    s3, data = client(url), os.urandom(4 * MIB)
    keys = [f"probe/{i}" for i in range(mib // 4)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=BUCKET, Key=k, Body=data), keys))
    t1 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys))
    t2 = time.monotonic()
    for k in keys:
        s3.delete_object(Bucket=BUCKET, Key=k)
    return {"mib": mib, "threads": threads, "put_mib_s": round(mib / (t1 - t0), 1),
            "get_mib_s": round(mib / (t2 - t1), 1)}


def run_store(args, store: str, result: dict, monitor: LoadMonitor) -> dict:
    """Every selected part against one store (``none``: moto on loopback; a rate: moto behind
    a shaped link), on a stack of its own."""
    from harness.moto_s3 import CREDENTIALS, client, moto_server  # noqa: PLC0415
    from harness.shaped_link import ShapedLink  # noqa: PLC0415

    link = ShapedLink(args.store_link, rate=store) if store != "none" else None
    run: dict = {"store": "loopback" if store == "none" else f"{store} (tc tbf, namespace)"}
    prefix = f"lz-{uuid.uuid4().hex[:6]}"
    with moto_server(BUCKET, link=link) as url:
        run["store_probe"] = probe_store(url)
        print(f"store {run['store']} at {url}: {run['store_probe']}", flush=True)
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": prefix, **CREDENTIALS,
               "AENV_PAUSE_EXPORT_DELAY": "0.5", "AENV_FORK_MAX_PER_NODE": str(args.fork_per_node)}
        if args.peer_fetch:  # every node on this machine serves its chunks on a port of its own
            env.update(AENV_CHUNK_PEER_FETCH="1", AENV_CHUNK_PEER_PORT="0")
        run["peer_fetch"] = bool(args.peer_fetch)
        with stack_of("lz", env) as stack, api_of(stack.api_url, stack.api_key, set(), stack.admin_token) as api:
            os.environ.update(E2B_API_URL=stack.api_url, E2B_SANDBOX_URL=stack.sandbox_url, E2B_API_KEY=stack.api_key)
            os.environ.pop("E2B_DEBUG", None)
            ctx = parts.Ctx(args=args, stack=stack, api=api, s3=client(url), bucket=BUCKET, prefix=prefix,
                            root=_home("lzn"))
            ctx.root.mkdir(parents=True)
            try:
                for part in args.parts:
                    monitor.phase = f"{part} ({store})"
                    t0 = time.monotonic()
                    try:
                        run[part] = parts.PARTS[part](ctx)
                    except Exception as exc:  # noqa: BLE001 - the other parts still run; reported
                        traceback.print_exc()
                        run[part] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()}
                    run[part]["part_s"] = round(time.monotonic() - t0)
                run["templates"] = ctx.templates
            finally:
                for tpl in ctx.templates:
                    try:
                        delete_template(stack, tpl["name"])
                    except Exception as exc:  # noqa: BLE001 - the stack and the store go anyway
                        result["notes"].append(f"cleanup: template {tpl['name']}: {exc}")
                left = _shm_leftovers(ctx.made | api.live)
                if left:
                    result["notes"].append(f"cleanup: removed {left} RAM file(s) left in /dev/shm")
                shutil.rmtree(ctx.root, ignore_errors=True)
        if link is not None:
            run["link_qdiscs"] = link.qdiscs()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(parts.PARTS), help=f"comma separated, of {', '.join(parts.PARTS)}")
    parser.add_argument("--shape-store", default="none",
                        help="comma separated: none (moto on loopback) and/or a rate for the store's link (1gbit)")
    parser.add_argument("--quick", action="store_true", help="small counts and sizes, results to var/bench-quick/")
    parser.add_argument("--out", type=Path, help="where the JSON + Markdown go (default bench/results/)")
    parser.add_argument("--runs", type=int, default=5, help="creates / resumes of each kind")
    parser.add_argument("--fill-mib", type=int, default=256, help="MiB of random bytes each template adds to base")
    parser.add_argument("--cache-mb", type=int, default=1024, help="the cache part's AENV_CHUNK_CACHE_MB")
    parser.add_argument("--peer-fetch", action="store_true",
                        help="AENV_CHUNK_PEER_FETCH on every node (and with it a fork's early hand-off)")
    parser.add_argument("--fork-warm-store", action="store_true",
                        help="the fork part keeps a snapshot of its parent: the base image files are in the store "
                             "before the forks (as where templates are stored), not published by the first capture")
    parser.add_argument("--fork-per-node", type=int, default=16, help="AENV_FORK_MAX_PER_NODE (N): ×N vs ×2N")
    parser.add_argument("--resume-without-base-disk", action="store_true",
                        help="the resume part's node B lacks the base disk too (default: it has it, as nodes do)")
    parser.add_argument("--net-prefix", default="aenvz", help="network instance prefix (stacks: <prefix>s<N>)")
    parser.add_argument("--net-pool", default="10.26.0.0/20", help="the stacks take later /20s of its /16")
    parser.add_argument("--node-c-pool", default="10.26.8.0/21", help="the fork part's node C's slot pool")
    parser.add_argument("--store-link", default="10.26.0.0/30", help="the shaped store link's /30")
    args = parser.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(parts.PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(parts.PARTS)}")
    stores = [s.strip().lower() for s in args.shape_store.split(",") if s.strip()]
    try:
        from harness.shaped_link import parse_rate  # noqa: PLC0415

        for s in stores:
            if s != "none":
                parse_rate(s)
    except ValueError as exc:
        parser.error(str(exc))
    if os.geteuid() != 0:
        print("cannot run: needs root (network namespaces, slots, FUSE mounts)", file=sys.stderr)
        return 1
    if args.quick:
        args.runs, args.fill_mib, args.cache_mb, args.fork_per_node = 1, 16, 256, 2
    out_dir = args.out or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "bench" / "results")
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool

    t_start, load0 = time.monotonic(), os.getloadavg()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {"benchmark": "lazy", "when": stamp, "quick": args.quick, "parts": args.parts, "stores": stores,
                    "git": git_state(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
                    "notes": [], "runs": []}
    monitor = LoadMonitor().start()
    try:
        for store in stores:
            result["runs"].append(run_store(args, store, result, monitor))
    finally:
        finish_run(result, monitor.stop(), t_start, load0,
                   memory_mib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB)
        out = write_results(result, stamp, out_dir)
        print(out.with_suffix(".md").read_text())
        print(f"wrote {out} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
