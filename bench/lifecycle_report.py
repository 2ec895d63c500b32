"""bench/lifecycle.py's results: medians, targets met or missed, the tables and the
JSON + markdown files."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable, NamedTuple


from bench.lifecycle_common import OVERHEAD_TARGET, TARGETS, WHY_MISSED, percentile


def summarize(samples: dict[str, list[float]]) -> dict:
    return {k: {"median": round(statistics.median(v), 2), "p90": round(percentile(v, 90), 2),
                "p99": round(percentile(v, 99), 2), "min": round(min(v), 2), "max": round(max(v), 2),
                "n": len(v)} for k, v in samples.items() if v}


def unit_of(name: str) -> str:
    if name.endswith("_mib"):
        return "MiB"
    return "req/s" if name.endswith("_rps") else "ms"


def target_of(name: str):
    """(target, unit) of a sample name, raw or api.<name>; overheads have the 15 ms one."""
    if name.endswith(".overhead"):
        return OVERHEAD_TARGET, "ms"
    base = name[4:] if name.startswith("api.") else name
    return TARGETS.get(base), unit_of(name)


def table(summary: dict) -> list[str]:
    """Markdown table: one row per measured quantity, with the issue's target where it has one."""
    lines = ["| operation | median | p90 | p99 | min | max | n | unit | target | met? |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for name, s in summary.items():
        target, unit = target_of(name)
        tgt = "" if target is None else f"≤ {target}"
        met = "" if target is None else ("yes" if s["median"] <= target else "**no**")
        p90, p99 = (num(s[k]) if k in s else "–" for k in ("p90", "p99"))  # older results had neither
        lines.append(f"| {name} | {num(s['median'])} | {p90} | {p99} | {num(s['min'])} | {num(s['max'])} | {s['n']} "
                     f"| {unit} | {tgt} | {met} |")
    return lines


def ratio(summary: dict, a: str, b: str, stat: str = "median") -> float | None:
    """summary[a][stat] / summary[b][stat], None when either is missing."""
    x, y = summary.get(a, {}).get(stat), summary.get(b, {}).get(stat)
    return round(x / y, 2) if x is not None and y else None


def ratios(summary: dict) -> dict:
    """The networking comparisons of issue 10 (None when a side was not measured)."""
    return {
        "create_netns_over_slirp": ratio(summary, "create_from_template", "create_from_template_slirp"),
        "create_first_command_netns_over_slirp": ratio(summary, "create_from_template_first_command",
                                                       "create_from_template_slirp_first_command"),
        "userport_p50_proxy_over_direct": ratio(summary, "api.userport_get", "userport_get"),
        "userport_p99_proxy_over_direct": ratio(summary, "api.userport_get", "userport_get", "p99"),
        "userport_rps_proxy_over_direct": ratio(summary, "api.userport_rps", "userport_rps"),
        "userport_concurrent_p50_proxy_over_direct": ratio(summary, "api.userport_get_concurrent",
                                                           "userport_get_concurrent"),
        "userport_concurrent_p99_proxy_over_direct": ratio(summary, "api.userport_get_concurrent",
                                                           "userport_get_concurrent", "p99"),
        "userport_concurrent_rps_proxy_over_direct": ratio(summary, "api.userport_concurrent_rps",
                                                           "userport_concurrent_rps"),
    }


def num(v: float) -> str:
    """One decimal, two below 1 (a warm slot handover is hundredths of a millisecond)."""
    return f"{v:.2f}" if abs(v) < 1 else f"{v:.1f}"


def _stat(summary: dict, key: str, stat: str, unit: str = " ms") -> str:
    v = summary.get(key, {}).get(stat)
    return "–" if v is None else f"{num(v)}{unit}"


def _times(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _p90(key: str) -> Callable[[dict], str]:
    return lambda s: f"p90 {_stat(s, key, 'p90')}" if key in s else ""


def _p99(key: str) -> Callable[[dict], str]:
    return lambda s: (f"p99 direct {_stat(s, key, 'p99')} / proxy {_stat(s, 'api.' + key, 'p99')} "
                      f"(proxy/direct {_times(ratio(s, 'api.' + key, key, 'p99'))})")


def _slot_handover(s: dict) -> str:
    parts = []
    if "create.net_attach" in s:
        parts.append(f"p90 {_stat(s, 'create.net_attach', 'p90')}")
    if "create_slirp.net_attach" in s:
        parts.append(f"slirp (a host port): {_stat(s, 'create_slirp.net_attach', 'median')}")
    if "fork16.net_attach" in s:
        parts.append(f"in a fork ×16 (16 at once, from the warm pool): {_stat(s, 'fork16.net_attach', 'median')} median, "
                     f"{_stat(s, 'fork16.net_attach', 'max')} max")
    return "; ".join(parts)


class Row(NamedTuple):
    label: str
    raw: str | None  # sample key of the raw column
    api: str | None  # and of the API column
    call: str | None  # the API call whose Server-Timing gives node time and overhead
    target: str | None  # TARGETS key
    note: Callable[[dict], str] | None = None  # summary → an extra remark (p90, a comparison)


# The summary: one row per operation of the list.
ROWS = [
    Row("network slot: make one (netns, veth, tap, addresses, nftables; raw slots, no pool)", "slot_create", None,
        None, None, _p90("slot_create")),
    Row("network slot: destroy one", "slot_destroy", None, None, None, _p90("slot_destroy")),
    Row("network slot: hand one out from a warm SlotPool", "slot_pool_acquire_warm", None, None, None,
        lambda s: f"{_p90('slot_pool_acquire_warm')(s)}; from an empty pool "
                  f"{_stat(s, 'slot_pool_acquire_cold', 'median')}; release (destroys) "
                  f"{_stat(s, 'slot_pool_release', 'median')}"),
    Row("create from template snapshot → envd answering (netns: a slot of its own)", "create_from_template",
        "api.create_from_template", "api.create_from_template", "create_from_template"),
    Row("… of which the network handover (NetnsBackend.attach: warm slot + egress policy)", "create.net_attach",
        None, None, None, _slot_handover),
    Row("create from template snapshot → envd answering (restricted slirp)", "create_from_template_slirp", None,
        None, None, lambda s: f"netns / slirp {_times(ratio(s, 'create_from_template', 'create_from_template_slirp'))}"),
    Row("create from template → first command (netns)", "create_from_template_first_command",
        "api.create_from_template_first_command", "api.create_from_template", None),
    Row("create from template → first command (restricted slirp)", "create_from_template_slirp_first_command", None,
        None, None, lambda s: "netns / slirp " + _times(ratio(s, "create_from_template_first_command",
                                                              "create_from_template_slirp_first_command"))),
    Row("pause (in memory; the API has no in-memory pause)", "pause", None, None, "pause"),
    Row("pause to disk (the API's pause; netns: gives the slot back)", "pause_to_disk", "api.pause_to_disk",
        "api.pause_to_disk", "pause_to_disk"),
    Row("resume from disk → envd answering (a fresh slot; API: connect, 201)", "resume_from_disk",
        "api.resume_from_disk", "api.resume_from_disk", "resume_from_disk"),
    Row("connect to a running sandbox (200; raw: nothing to do)", None, "api.connect_running", "api.connect_running",
        None),
    Row("snapshot: parent pause window", "snapshot_pause_window", "api.snapshot_pause_window", "api.snapshot_total",
        "snapshot_pause_window"),
    Row("snapshot: total", "snapshot_total", "api.snapshot_total", "api.snapshot_total", None),
    Row("create from that snapshot → envd answering", "create_from_snapshot", "api.create_from_snapshot",
        "api.create_from_snapshot", None),
    Row("fork ×4: parent pause window", "fork4_parent_pause", "api.fork4_parent_pause", "api.fork4", None),
    Row("fork ×4: until all 4 answer a command, networking on (a slot per child)", "fork4_all_answering",
        "api.fork4_all_answering", "api.fork4", "fork4_all_answering"),
    Row("fork ×16: parent pause window", "fork16_parent_pause", "api.fork16_parent_pause", "api.fork16",
        "fork16_parent_pause"),
    Row("fork ×16: until all 16 answer a command, networking on (a slot per child)", "fork16_all_answering",
        "api.fork16_all_answering", "api.fork16", "fork16_all_answering"),
    Row("host memory per forked child (×4, PSS)", "fork4_child_pss_mib", "api.fork4_child_pss_mib", None,
        "fork4_child_pss_mib"),
    Row("host memory per forked child (×16, PSS)", "fork16_child_pss_mib", "api.fork16_child_pss_mib", None,
        "fork16_child_pss_mib"),
    Row("user port: GET latency p50, 1 keep-alive client (raw: host → slot address; API: data plane)",
        "userport_get", "api.userport_get", None, None, _p99("userport_get")),
    Row("user port: GETs/s, 1 keep-alive client (raw: direct; API: data plane)", "userport_rps",
        "api.userport_rps", None, None),
    Row("user port: GET latency p50, concurrent clients (raw: direct; API: data plane)", "userport_get_concurrent",
        "api.userport_get_concurrent", None, None, _p99("userport_get_concurrent")),
    Row("user port: GETs/s, concurrent clients (raw: direct; API: data plane)", "userport_concurrent_rps",
        "api.userport_concurrent_rps", None, None),
]


def summary_rows(summary: dict) -> list[dict]:
    """The operation table as data: raw and API medians, node time, overhead, ratio, verdicts."""
    out = []
    for label, raw_key, api_key, call, target_key, note in ROWS:
        raw, api = summary.get(raw_key or ""), summary.get(api_key or "")
        node, over = summary.get(f"{call}.node"), summary.get(f"{call}.overhead")
        dispatch = summary.get(f"{call}.dispatch")
        if raw is None and api is None:
            continue
        target = TARGETS.get(target_key) if target_key else None
        unit = unit_of(raw_key or api_key)
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
        row["note"] = note(summary) if note else ""
        out.append(row)
    return out


def summary_table(rows: list[dict]) -> list[str]:
    def f(v, unit=""):
        return "–" if v is None else f"{num(v)}{unit}"

    def yn(v):
        return "" if v is None else ("yes" if v else "**no**")

    lines = ["| operation | raw | API | n raw/API | node (Server-Timing) | overhead (API − node) "
             "| of which dispatch | API/raw | target | met? raw / API | overhead ≤ 15 ms? | notes / why missed |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        u = "" if r["unit"] == "ms" else f" {r['unit']}"
        target = "" if r["target"] is None else f"≤ {r['target']}{u or ' ms'}"
        met = "" if r["target"] is None else f"{yn(r['met_raw']) or '–'} / {yn(r['met_api']) or '–'}"
        n = f"{r['raw_n'] or '–'}/{r['api_n'] or '–'}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['operation']} | {f(r['raw'], u)} | {f(r['api'], u)} | {n} | {f(r['node'])} "
                     f"| {f(r['overhead'])} | {f(r.get('dispatch'))} | {ratio} | {target} "
                     f"| {met} | {yn(r['met_overhead'])} | {'; '.join(x for x in (r.get('note'), r['why_missed']) if x)} |")
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
                "(SandboxEvents), so their overhead column is the whole call's. Network slot and slirp rows are "
                "raw only; the user-port rows are both measured in the API part: raw = this host straight to "
                "the sandbox's slot address, API = through the data plane, so their API/raw is proxy / direct.",
                ""]
        r = result.get("ratios") or {}
        if any(v is not None for v in r.values()):
            body += ["## Networking comparisons (issue 10)", "",
                     *[f"- {k.replace('_', ' ')}: {_times(v)}" for k, v in r.items() if v is not None], ""]
        body += ["## Every measured quantity", ""]
    out.with_suffix(".md").write_text("\n".join(head + body + table(result["summary"])) + "\n")
    return out
