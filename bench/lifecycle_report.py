"""bench/lifecycle.py's results: medians, targets met or missed, the tables and the
JSON + markdown files."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


from bench.lifecycle_common import OVERHEAD_TARGET, TARGETS, WHY_MISSED


def summarize(samples: dict[str, list[float]]) -> dict:
    return {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2),
                "n": len(v)} for k, v in samples.items() if v}


def target_of(name: str):
    """(target, unit) of a sample name, raw or api.<name>; overheads have the 15 ms one."""
    if name.endswith(".overhead"):
        return OVERHEAD_TARGET, "ms"
    base = name[4:] if name.startswith("api.") else name
    return TARGETS.get(base), ("MiB" if name.endswith("_mib") else "ms")


def table(summary: dict) -> list[str]:
    """Markdown table: one row per measured quantity, with the issue's target where it has one."""
    lines = ["| operation | median | min | max | n | unit | target | met? |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for name, s in summary.items():
        target, unit = target_of(name)
        tgt = "" if target is None else f"≤ {target}"
        met = "" if target is None else ("yes" if s["median"] <= target else "**no**")
        lines.append(f"| {name} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {s['n']} | {unit} "
                     f"| {tgt} | {met} |")
    return lines


# The summary: one row per operation of the list. (label, raw key, API key, API call
# whose Server-Timing gives the overhead, target key or None)
ROWS = [
    ("create from template snapshot → envd answering", "create_from_template", "api.create_from_template",
     "api.create_from_template", "create_from_template"),
    ("create from template → first command", "create_from_template_first_command",
     "api.create_from_template_first_command", "api.create_from_template", None),
    ("pause (in memory; the API has no in-memory pause)", "pause", None, None, "pause"),
    ("pause to disk (the API's pause)", "pause_to_disk", "api.pause_to_disk", "api.pause_to_disk",
     "pause_to_disk"),
    ("resume from disk → envd answering (API: connect, 201)", "resume_from_disk", "api.resume_from_disk",
     "api.resume_from_disk", "resume_from_disk"),
    ("connect to a running sandbox (200; raw: nothing to do)", None, "api.connect_running", "api.connect_running",
     None),
    ("snapshot: parent pause window", "snapshot_pause_window", "api.snapshot_pause_window", "api.snapshot_total",
     "snapshot_pause_window"),
    ("snapshot: total", "snapshot_total", "api.snapshot_total", "api.snapshot_total", None),
    ("create from that snapshot → envd answering", "create_from_snapshot", "api.create_from_snapshot",
     "api.create_from_snapshot", None),
    ("fork ×4: parent pause window", "fork4_parent_pause", "api.fork4_parent_pause", "api.fork4", None),
    ("fork ×4: until all 4 answer a command", "fork4_all_answering", "api.fork4_all_answering", "api.fork4",
     "fork4_all_answering"),
    ("fork ×16: parent pause window", "fork16_parent_pause", "api.fork16_parent_pause", "api.fork16",
     "fork16_parent_pause"),
    ("fork ×16: until all 16 answer a command", "fork16_all_answering", "api.fork16_all_answering", "api.fork16",
     "fork16_all_answering"),
    ("host memory per forked child (×4, PSS)", "fork4_child_pss_mib", "api.fork4_child_pss_mib", None,
     "fork4_child_pss_mib"),
    ("host memory per forked child (×16, PSS)", "fork16_child_pss_mib", "api.fork16_child_pss_mib", None,
     "fork16_child_pss_mib"),
]


def summary_rows(summary: dict) -> list[dict]:
    """The operation table as data: raw and API medians, node time, overhead, ratio, verdicts."""
    out = []
    for label, raw_key, api_key, call, target_key in ROWS:
        raw, api = summary.get(raw_key or ""), summary.get(api_key or "")
        node, over = summary.get(f"{call}.node"), summary.get(f"{call}.overhead")
        dispatch = summary.get(f"{call}.dispatch")
        if raw is None and api is None:
            continue
        target = TARGETS.get(target_key) if target_key else None
        unit = "MiB" if (raw_key or api_key).endswith("_mib") else "ms"
        row = {"operation": label, "unit": unit, "raw": raw and raw["median"], "raw_n": raw and raw["n"],
               "api": api and api["median"], "api_n": api and api["n"], "api_call": call,
               "node": node and node["median"], "overhead": over and over["median"],
               "dispatch": dispatch and dispatch["median"],
               "ratio": round(api["median"] / raw["median"], 2) if raw and api and raw["median"] else None,
               "target": target, "overhead_target": OVERHEAD_TARGET if over else None}
        row["met_raw"] = None if target is None or raw is None else raw["median"] <= target
        row["met_api"] = None if target is None or api is None else api["median"] <= target
        row["met_overhead"] = None if over is None else over["median"] <= OVERHEAD_TARGET
        why = []
        if row["met_raw"] is False or row["met_api"] is False:
            why.append(WHY_MISSED.get(target_key, ""))
        if row["met_overhead"] is False:
            why.append("overhead: " + WHY_MISSED["overhead"] if not why else "overhead: control plane")
        row["why_missed"] = "; ".join(w for w in why if w)
        out.append(row)
    return out


def summary_table(rows: list[dict]) -> list[str]:
    def f(v, unit=""):
        return "–" if v is None else f"{v:.1f}{unit}"

    def yn(v):
        return "" if v is None else ("yes" if v else "**no**")

    lines = ["| operation | raw | API | n raw/API | node (Server-Timing) | overhead (API − node) "
             "| of which dispatch | API/raw | target | met? raw / API | overhead ≤ 15 ms? | why missed |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        u = " MiB" if r["unit"] == "MiB" else ""
        target = "" if r["target"] is None else f"≤ {r['target']}{u or ' ms'}"
        met = "" if r["target"] is None else f"{yn(r['met_raw']) or '–'} / {yn(r['met_api']) or '–'}"
        n = f"{r['raw_n'] or '–'}/{r['api_n'] or '–'}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['operation']} | {f(r['raw'], u)} | {f(r['api'], u)} | {n} | {f(r['node'])} "
                     f"| {f(r['overhead'])} | {f(r.get('dispatch'))} | {ratio} | {target} "
                     f"| {met} | {yn(r['met_overhead'])} | {r['why_missed']} |")
    return lines


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"lifecycle-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    host = result.get("host", {})
    head = [f"# lifecycle benchmark {stamp}", "",
            f"shape {result.get('shape')}, ops {result.get('ops')}, repetitions {result.get('repetitions')}, "
            f"host {host.get('machine')} × {host.get('cpus')} cores, kernel {host.get('kernel')}, "
            f"load average at start {host.get('loadavg_at_start')}, at end {host.get('loadavg_at_end')}, "
            f"run took {result.get('duration_s')} s", ""]
    head += [f"- {n}" for n in result.get("notes", [])] + [""]
    body = []
    if result.get("rows"):
        body = ["## Operations: raw driver vs API (medians)", "", *summary_table(result["rows"]), "",
                "node = the node's own time for the request (Server-Timing); overhead = API client time − node "
                "(of which dispatch = the Celery round trip without the node's work, from Server-Timing; the "
                "rest is HTTP, Django, the DB transitions and SandboxEvents); API/raw = API median / raw driver "
                "median (the API's creates, resumes and forks also include envd /init, which the raw driver "
                "call does not). Parent pause windows via the API are the node's capture timings "
                "(SandboxEvents), so their overhead column is the whole call's.", "",
                "## Every measured quantity", ""]
    out.with_suffix(".md").write_text("\n".join(head + body + table(result["summary"])) + "\n")
    return out
