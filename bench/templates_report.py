"""bench/templates.py's results: the summary of the creates, the tables (build phases, the
cached rebuild against the first build, sandboxes with the ≤ 400 ms target) and the JSON +
Markdown files."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.lifecycle_report import num, summarize

CREATE_TARGET_MS = 400  # issue 11: a create from a built template → envd answering, through the API


def create_summary(creates: dict[str, list[dict]]) -> dict:
    """p50 / p90 / max (…) of each kind's create → envd answering and API answer, and the
    medians of the create's Server-Timing phases."""
    samples: dict[str, list[float]] = {}
    for kind, rows in creates.items():
        samples[f"{kind}.envd_ms"] = [r["envd_ms"] for r in rows]
        samples[f"{kind}.api_ms"] = [r["api_ms"] for r in rows]
        samples[f"{kind}.ram_copy_ms"] = [r["ram_copy_ms"] for r in rows if r.get("ram_copy_ms") is not None]
        for r in rows:
            for phase, v in r["server_timing"].items():
                samples.setdefault(f"{kind}.phase.{phase}", []).append(v)
    return summarize(samples)


def verdict(summary: dict) -> dict:
    t = summary.get("template.envd_ms")
    b = summary.get("base.envd_ms")
    if not t:
        return {}
    return {"target_ms": CREATE_TARGET_MS, "p50_ms": t["median"], "p90_ms": t["p90"],
            "met_p50": t["median"] <= CREATE_TARGET_MS, "met_p90": t["p90"] <= CREATE_TARGET_MS,
            "template_over_base_p50": round(t["median"] / b["median"], 2) if b else None}


def _s(v) -> str:
    return "–" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _mib(n_bytes) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def build_table(b: dict, payload: dict) -> list[str]:
    t = b["timings"]
    img = b.get("image") or {}
    split = b.get("root_disk_split_s") or {}
    rows = [("base: fresh pull + root disk", t.get("base_s"), f"image {img.get('mib', '?')} MiB compressed, "
             f"{img.get('layers', '?')} layers, every blob new to the node"),
            ("… pull (skopeo, from the local registry on 127.0.0.1)", b.get("pull_s"), "log: pulling → pulled"),
            ("… root disk (unpack, ext4, qcow2)", b.get("root_disk_s"),
             " / ".join(f"{k} {_s(v)} s" for k, v in split.items()) +
             (f"; {b['root_disk_mib']} MiB filesystem" if b.get("root_disk_mib") else "")),
            ("build VM boot (cold, TCG)", t.get("boot_s"), "")]
    sizes = {x["step"]: x["size_bytes"] for x in b["layers"]}
    for key in sorted((k for k in t if k.startswith("step_")), key=lambda k: int(k.split("_")[1])):
        n = key.split("_")[1]
        label = (b["labels"].get(n) or "?")
        label = label if len(label) <= 70 else label[:67] + "…"
        rows.append((f"step {n}: `{label}`", t[key], f"sealed layer {_mib(sizes.get(n, 0))}"
                     if sizes.get(n) else "no layer (ENV changes no disk)" if label.startswith("ENV") else ""))
    rows += [("default user + bookkeeping (rest of the total)", b.get("other_s"), ""),
             ("finalize (defaults, start + ready, snapshot)", t.get("finalize_s"), ""),
             ("… the template's defaults written (user, workdir, env)", b.get("defaults_s"), ""),
             ("… start command → ready", b.get("start_to_ready_s"),
              "the ready command (wait_for_port) is retried every 2 s"),
             ("… ready → the snapshot begins", b.get("ready_to_snapshot_s"),
              "the start command's log reader detached (`StartCommand.detach`: close, then join ≤ 5 s)"),
             ("… template snapshot", t.get("snapshot_s"), f"{b.get('snapshot_mib')} MiB stored"),
             ("**builder total** (`timings.total_s`)", t.get("total_s"), ""),
             ("**`Template.build` wall time (SDK)**", b.get("sdk_s"),
              f"{_s(b.get('before_builder_s'))} s before the builder accepted it (request, COPY upload of "
              f"{payload['copy_mib']} MiB, dispatch), {_s(b.get('after_builder_s'))} s after it finished "
              "(the SDK polls every 0.2 s)")]
    lines = ["| phase | s | notes |", "|---|---:|---|"]
    lines += [f"| {name} | {_s(v)} | {note} |" for name, v, note in rows]
    return lines


def rebuild_table(first: dict, rebuilds: list[dict]) -> list[str]:
    def med(key: str, src: str = "timings"):
        vals = [(r[src] if src else r).get(key) for r in rebuilds]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def steps(b: dict) -> float:
        return sum(v for k, v in b["timings"].items() if k.startswith("step_"))

    rows = [("`Template.build` wall time (SDK)", first["sdk_s"], med("sdk_s", "")),
            ("builder total", first["timings"].get("total_s"), med("total_s")),
            ("… base (registry check; image and disk cached)", first["timings"].get("base_s"), med("base_s")),
            ("… build VM boot (on the cached layers)", first["timings"].get("boot_s"), med("boot_s")),
            ("… steps run", steps(first), statistics.median(steps(r) for r in rebuilds)),
            ("… finalize (start + ready + snapshot)", first["timings"].get("finalize_s"), med("finalize_s")),
            ("… … of which the snapshot", first["timings"].get("snapshot_s"), med("snapshot_s"))]
    lines = [f"| | first build | cached rebuild (median of {len(rebuilds)}) | rebuild / first |",
             "|---|---:|---:|---:|"]
    for name, a, b in rows:
        ratio = f"{b / a:.2f}×" if a and b is not None else "–"
        lines.append(f"| {name} | {_s(a)} s | {_s(b)} s | {ratio} |")
    cached = [f"{r.get('cached_steps')}/{r.get('steps')}" for r in rebuilds]
    lines.append(f"| steps CACHED | 0/{first.get('steps')} | {', '.join(cached)} | |")
    return lines


def sandbox_table(result: dict) -> list[str]:
    s, first = result["summary"], result["first_sandbox"]
    v = result.get("verdict") or {}

    def row(label, key, target=False):
        x = s.get(key)
        if not x:
            return None
        tgt = f"≤ {CREATE_TARGET_MS} ms" if target else ""
        met = ("yes" if x["median"] <= CREATE_TARGET_MS else "**no**") if target else ""
        return f"| {label} | {num(x['median'])} | {num(x['p90'])} | {num(x['max'])} | {x['n']} | {tgt} | {met} |"

    lines = ["| measurement (ms) | p50 | p90 | max | n | target | met (p50)? |", "|---|---:|---:|---:|---:|---|---|",
             f"| time to first sandbox: `Template.build` returned → `Sandbox.create(name)` returned | "
             f"{num(first['create_ms'])} | | | 1 | | |",
             f"| time to first sandbox: … → first command answered | {num(first['first_command_ms'])} | | | 1 | | |"]
    lines += [r for r in (
        row("create from the built template → envd answering (API + data plane)", "template.envd_ms", True),
        row("… `POST /v2/sandboxes` answered (after envd /init)", "template.api_ms"),
        row("create of `base` → envd answering (same run, same shape)", "base.envd_ms", True),
        row("… `POST /v2/sandboxes` answered", "base.api_ms")) if r]
    if v.get("template_over_base_p50") is not None:
        lines.append(f"| built template / base (p50) | {v['template_over_base_p50']:.2f}× | | | | | |")
    return lines


def phase_line(summary: dict, kind: str) -> str:
    parts = [f"{k.rsplit('.', 1)[1]} {num(x['median'])}" for k, x in summary.items()
             if k.startswith(f"{kind}.phase.")]
    copy = summary.get(f"{kind}.ram_copy_ms")
    if parts and copy:
        parts.append(f"of which the RAM copy of the snapshot (in the background of disk + spawn) {num(copy['median'])}")
    return ", ".join(parts)


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"templates-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    host, shape, payload = result.get("host", {}), result["shape"], result["payload"]
    v = result.get("verdict") or {}
    lines = [f"# templates benchmark {stamp}", "",
             f"shape {shape['cpu']} vCPU / {shape['memory_mb']} MiB (base's), payload: RUN dd {payload['run_mib']} MiB, "
             f"COPY {payload['copy_files']} files / {payload['copy_mib']} MiB; {result['repetitions']['creates']} "
             f"creates of each, {result['repetitions']['rebuilds']} cached rebuild(s); host {host.get('machine')} × "
             f"{host.get('cpus')} cores, kernel {host.get('kernel')}, load average at start "
             f"{host.get('loadavg_at_start')}, at end {host.get('loadavg_at_end')}; run took "
             f"{result.get('duration_s')} s; git {result.get('git', {}).get('commit', '?')}", ""]
    lines += [f"- {n}" for n in result.get("notes", [])] + [""]
    if v:
        lines += [f"**Create from a built template → envd answering, through the API: p50 {num(v['p50_ms'])} ms, "
                  f"p90 {num(v['p90_ms'])} ms; target ≤ {v['target_ms']} ms: "
                  f"{'met' if v['met_p50'] else 'NOT met'} (p50), {'met' if v['met_p90'] else 'not met'} (p90).**",
                  ""]
    lines += ["## First build (fresh pull), from the builder's timings and log timestamps", "",
              *build_table(result["first_build"], payload), ""]
    if result.get("rebuilds"):
        lines += ["## Cached rebuild (the same template again: every step CACHED)", "",
                  *rebuild_table(result["first_build"], result["rebuilds"]), ""]
    lines += ["## Sandboxes from the built template", "", *sandbox_table(result), ""]
    for kind in ("template", "base"):
        p = phase_line(result["summary"], kind)
        if p:
            lines.append(f"- {kind} create, Server-Timing medians (ms): {p}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out
