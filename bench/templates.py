"""Benchmark: E2B template builds on aenv's node builder, with real VMs, in one run against
a stack of its own (harness/stack.py) and a local OCI registry (harness/oci_registry.py).

1. A fresh test image (harness/oci_images.py: the small debootstrap Debian + an app layer, a
   run token in both layers, so every blob is new to the node) is pushed to the registry.
2. The official SDK builds it (``Template.build``): FROM the image, a small RUN, a RUN writing
   --run-mib MiB, a COPY of --copy-files files / --copy-mib MiB of random bytes, ENV, WORKDIR,
   a start command (python3 -m http.server) with wait_for_port as the ready check. Per phase
   and step kind: the builder's own ``TemplateBuild.result["timings"]`` and ``["layers"]``
   and its log timestamps (pull vs root disk, start → ready), read through the Django ORM of
   the stack's database (the API does not expose them), and the SDK's wall time.
3. Time to first sandbox: from ``Template.build`` returning to the first command answering in
   ``Sandbox.create(name)`` (then checked to be the template: files, env, workdir, server).
4. Creates through the API with plain httpx (``POST /v2/sandboxes`` → envd ``/health``
   through the data plane answering), --creates of the built template and of ``base``
   alternated (one ``base`` warm-up first), same shape (base's, read from the stack):
   p50 / p90 / max against the issue's ≤ 400 ms target.
5. Cached rebuild: the same definition built again --rebuilds times (every step CACHED):
   its times and the ratio to the first build.

Everything made is removed at the end: sandboxes, the template (API delete), the stack
(processes, VMs, its network instance: prefix ``<--net-prefix>s1`` on a /20 of --net-pool's
/16, never a node's or a test session's), the registry, and on the node's shared images dir
the pulled image (layout entry, disks, blobs) and the layer cache entries of the builds.

    .venv/bin/python bench/templates.py [--quick] [--out DIR] [--creates 10] [--rebuilds 2]
Writes the tables to stdout and JSON + Markdown to bench/results/templates-<UTC stamp>.{json,md}
(--quick: 3 creates, 1 rebuild, small payloads; to var/bench-quick/ unless --out). Needs root
(umoci keeps file owners; network slots).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import templates_runs as runs  # noqa: E402
from bench.lifecycle_common import LoadMonitor, finish_run  # noqa: E402
from bench.templates_report import create_summary, verdict, write_results  # noqa: E402
from harness import oci_images, oci_registry  # noqa: E402


def git_state() -> dict:
    """The commit measured, and tracked files edited but not committed at the time (other
    engineers work in the same tree: the stack runs what is on disk)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted": [line[3:] for line in git("status", "--porcelain", "-uno").splitlines() if line[3:]]}


def base_shape(stack) -> dict:
    """base's shape and the stack's team (the API key's), from the stack's database."""
    return runs.db_json(stack, "import json\nfrom sandboxes.models import ApiKey, Template\n"
                               "t = Template.objects.get(id='base')\nteam = ApiKey.objects.get().team_id\n"
                               "print('BENCH_JSON ' + json.dumps({'cpu': t.cpu_count, 'memory_mb': t.memory_mb, "
                               "'disk_mb': t.disk_size_mb, 'team_id': str(team)}))")


def remove_from_node(images_dir: Path, digests: set[str], team_id: str) -> dict:
    """Once the stack's VMs are gone: the layer cache entries of the stack's own team (their
    team-scoped keys are nobody else's) and the pulled image with its disks and guest image
    dir (``vmm.oci.usage.remove_image``), then the layout's unreachable blobs."""
    from vmm.oci import store, usage  # noqa: PLC0415

    entries = 0
    for meta in (images_dir / "layers").glob("*/meta.json") if team_id else ():
        try:
            mine = json.loads(meta.read_text()).get("team_id") == team_id
        except (OSError, ValueError):
            continue
        if mine:
            shutil.rmtree(meta.parent, ignore_errors=True)
            meta.parent.with_name(f"{meta.parent.name}.lock").unlink(missing_ok=True)
            entries += 1
    removed = []
    for image in usage.inventory(images_dir):
        if image.digest in digests:
            usage.remove_image(images_dir, image)
            removed.append(image.digest)
    return {"layer_entries": entries, "images": removed, "blobs": store.gc(images_dir)}


def pushed_digest(ref: str) -> str:
    """The manifest digest the registry serves for ``ref`` (what the node's pull stores)."""
    proc = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{ref}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    return proc.stdout.strip() if proc.returncode == 0 else ""


def delete_template(stack, name: str) -> int:
    import httpx  # noqa: PLC0415

    return httpx.delete(f"{stack.api_url}/templates/{name}", headers=stack.headers(), timeout=120).status_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 creates, 1 rebuild, small payloads; var/bench-quick/")
    parser.add_argument("--out", type=Path, help="where the JSON + Markdown go (default bench/results/)")
    parser.add_argument("--creates", type=int, default=10, help="timed creates of each template")
    parser.add_argument("--rebuilds", type=int, default=2, help="cached rebuilds")
    parser.add_argument("--run-mib", type=int, default=64, help="MiB the RUN step writes (dd)")
    parser.add_argument("--copy-files", type=int, default=200)
    parser.add_argument("--copy-mib", type=float, default=32)
    parser.add_argument("--net-prefix", default="aenvbt", help="network instance prefix (the stack's: <prefix>s1)")
    parser.add_argument("--net-pool", default="10.17.0.0/20", help="the stack takes the next /20 of its /16")
    args = parser.parse_args()
    if args.quick:
        args.creates, args.rebuilds, args.run_mib, args.copy_files, args.copy_mib = 3, 1, 8, 20, 4
    out_dir = args.out or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "bench" / "results")
    reason = oci_registry.available() or oci_images.available()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool
    from harness.stack import Stack, shared_images_dir  # noqa: PLC0415

    t_start, load0 = time.monotonic(), os.getloadavg()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    # short: a build VM's QMP socket is <AENV_HOME>/sandboxes/build-<32 hex>/qmp.sock, and a
    # Unix socket path has at most 107 bytes (longer homes fail every build's boot)
    home = ROOT / "var" / "bench-runs" / f"t-{uuid.uuid4().hex[:8]}"
    images_dir = shared_images_dir()
    monitor = LoadMonitor().start()
    result: dict = {"benchmark": "templates", "when": stamp, "quick": args.quick, "git": git_state(),
                    "payload": {"run_mib": args.run_mib, "copy_files": args.copy_files, "copy_mib": args.copy_mib},
                    "repetitions": {"creates": args.creates, "rebuilds": args.rebuilds}, "notes": []}
    stack = creates = None
    name, digests, team_id = f"bench-tpl-{uuid.uuid4().hex[:6]}", set(), ""
    try:
        registry = oci_registry.start(home / "registry")
        image, prep_s = runs.fresh_image(registry.host, f"bench-{uuid.uuid4().hex[:12]}")
        digests.add(pushed_digest(image.ref))
        result["image"] = {"ref": image.ref, "prep_s": round(prep_s, 1), "digest": sorted(digests)[0]}
        print(f"pushed {image.ref} in {prep_s:.0f} s", flush=True)
        stack = Stack(home=home / "s")
        stack.start()
        os.environ.update(E2B_API_URL=stack.api_url, E2B_SANDBOX_URL=stack.sandbox_url, E2B_API_KEY=stack.api_key)
        os.environ.pop("E2B_DEBUG", None)
        shape = base_shape(stack)
        team_id = shape.pop("team_id")
        result["shape"] = shape
        context = runs.make_context(home / "context", args.copy_files, args.copy_mib)
        template = runs.definition(image.ref, context, args.run_mib)

        monitor.phase = "build"
        print(f"building {name} from {image.ref} ...", flush=True)
        sdk = runs.build(template, name, shape["cpu"], shape["memory_mb"])
        first_sandbox = runs.first_sandbox(name, args.run_mib, args.copy_files)  # right after build returned
        result["first_sandbox"] = first_sandbox
        first = result["first_build"] = runs.phases(sdk, runs.build_record(stack, sdk["build_id"]), images_dir)
        digests.add((first.get("image") or {}).get("digest", ""))
        print(f"first build: {first['sdk_s']:.1f} s (builder {first['timings'].get('total_s')} s); first sandbox's "
              f"first command {first_sandbox['first_command_ms']:.0f} ms after it", flush=True)

        monitor.phase = "creates"
        creates = runs.Creates(stack.api_url, stack.sandbox_url, stack.api_key)
        creates.one("base")  # warm-up (page cache, connections); the template's was its first sandbox
        rows: dict[str, list[dict]] = {"template": [], "base": []}
        for _ in range(args.creates):  # alternated: both see the same host load
            rows["template"].append(creates.one(name))
            rows["base"].append(creates.one("base"))
        events = runs.create_events(stack, [*creates.made, first_sandbox["sandbox_id"]])
        for kind, kind_rows in rows.items():
            restored = sum(1 for r in kind_rows if (events.get(r["sandbox_id"]) or {}).get("restored"))
            result["notes"].append(f"{kind} creates restored from a template snapshot: {restored} of {len(kind_rows)}")
            ready = sum(1 for r in kind_rows if (events.get(r["sandbox_id"]) or {}).get("ram_ready_made") == 1)
            result["notes"].append(f"{kind} creates that found their RAM file made ahead (AENV_WARM_RAM_COPIES): "
                                   f"{ready} of {len(kind_rows)}")
            for r in kind_rows:
                r.update(events.get(r["sandbox_id"]) or {})
        result["creates"] = rows
        result["summary"] = create_summary(rows)
        result["verdict"] = verdict(result["summary"])

        monitor.phase = "rebuild"
        result["rebuilds"] = []
        for i in range(args.rebuilds):
            sdk_r = runs.build(template, name, shape["cpu"], shape["memory_mb"])
            again = runs.phases(sdk_r, runs.build_record(stack, sdk_r["build_id"]), images_dir)
            result["rebuilds"].append(again)
            if again.get("cached_steps") != again.get("steps"):
                result["notes"].append(f"rebuild {i + 1}: only {again.get('cached_steps')} of {again.get('steps')} "
                                       "steps were CACHED")
            print(f"cached rebuild {i + 1}: {again['sdk_s']:.1f} s (builder {again['timings'].get('total_s')} s)",
                  flush=True)
    finally:
        cleanup: dict = {}
        if creates is not None:
            creates.close()
        if stack is not None:
            try:
                cleanup["template_delete_status"] = delete_template(stack, name)
            except Exception as exc:  # noqa: BLE001 - the stack goes anyway
                cleanup["template_delete_status"] = f"failed: {exc}"
            stack.shutdown()  # processes, VMs, its slots, nftables table and resolver
        cleanup["registry_stopped"] = oci_registry.stop(home / "registry")
        digests.discard("")
        try:
            cleanup["node"] = remove_from_node(images_dir, digests, team_id)
        except Exception as exc:  # noqa: BLE001 - reported; the node's image cache would evict them later
            cleanup["node"] = f"failed: {exc}"
        shutil.rmtree(home, ignore_errors=True)
        result["cleanup"] = cleanup
    finish_run(result, monitor.stop(), t_start, load0)
    out = write_results(result, stamp, out_dir)
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
