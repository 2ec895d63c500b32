"""bench/rl.py's results: per run (way × N) the throughput, time to first result, rollout
latency percentiles and host memory per live rollout; the fork/fresh ratio per N; the
markdown table and the JSON + markdown files."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.lifecycle_common import percentile

TARGET_RATIO = 2.0  # issue 13: (a) fork rollouts ≥ 2× (b) fresh sandboxes that repeat the setup
WAYS = {"fork": "(a) setup once, fork ×N", "fresh": "(b) N fresh sandboxes, each repeats the setup"}


def run_summary(rows: list[dict], wall_s: float, nodes: int = 1) -> dict:
    """``rows``: one per rollout, ``ok`` (its answer was right), ``latency_s`` (its sandbox's
    request → its answer) and ``result_at_s`` (the run's start → its answer). Throughput counts
    correct rollouts over the run's whole wall time (setup, forks or creates, tasks, kills)."""
    ok = [r for r in rows if r.get("ok")]
    lat_ms = [r["latency_s"] * 1e3 for r in ok]
    at = [r["result_at_s"] for r in ok]
    out = {"n": len(rows), "ok": len(ok), "errors": len(rows) - len(ok), "wall_s": round(wall_s, 2),
           "rollouts_per_hour_per_node": round(len(ok) / wall_s * 3600 / nodes, 1) if wall_s > 0 else None,
           "time_to_first_result_s": round(min(at), 2) if at else None,
           "time_to_last_result_s": round(max(at), 2) if at else None,
           "latency_p50_ms": round(percentile(lat_ms, 50), 1) if lat_ms else None,
           "latency_p99_ms": round(percentile(lat_ms, 99), 1) if lat_ms else None,
           "latency_mean_ms": round(statistics.mean(lat_ms), 1) if lat_ms else None,
           "task_retries": sum(r.get("retries", 0) for r in rows)}
    return out


def memory_summary(pss_kib: list[int], avail_drop_bytes: int | None, live: int) -> dict:
    """Host memory per live rollout: the mean PSS of the rollouts' QEMU processes (sampled with
    the rollout alive, after its answer) and MemAvailable's drop over the live rollouts."""
    out = {"pss_per_rollout_mib": round(statistics.mean(pss_kib) / 1024, 1) if pss_kib else None,
           "pss_samples": len(pss_kib), "live_rollouts_at_sample": live}
    out["memavailable_drop_per_live_rollout_mib"] = (round(avail_drop_bytes / live / 2**20, 1)
                                                     if avail_drop_bytes is not None and live else None)
    return out


def ratio(a: dict, b: dict, key: str = "rollouts_per_hour_per_node") -> float | None:
    x, y = a.get(key), b.get(key)
    return round(x / y, 2) if x and y else None


def _f(v, unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        v = f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return f"{v}{unit}"


def table(runs: dict) -> list[str]:
    """``runs``: {N: {"fork": summary, "fresh": summary, "ratio": x}} → markdown lines."""
    lines = ["| N | way | rollouts/h/node | first result s | p50 ms | p99 ms | PSS/rollout MiB | "
             "MemAvail drop/live rollout MiB | wall s | setup s | ok/N |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(runs, key=int):
        for way in ("fork", "fresh"):
            s = runs[n].get(way)
            if not s:
                continue
            m = s.get("memory") or {}
            lines.append(f"| {n} | {WAYS[way]} | {_f(s.get('rollouts_per_hour_per_node'))} | "
                         f"{_f(s.get('time_to_first_result_s'))} | {_f(s.get('latency_p50_ms'))} | "
                         f"{_f(s.get('latency_p99_ms'))} | {_f(m.get('pss_per_rollout_mib'))} | "
                         f"{_f(m.get('memavailable_drop_per_live_rollout_mib'))} | {_f(s.get('wall_s'))} | "
                         f"{_f(s.get('setup_s'))} | {s.get('ok')}/{s.get('n')} |")
    return lines


def ratio_table(runs: dict) -> list[str]:
    lines = ["| N | throughput (a)/(b) | target | met? | first result (b)/(a) | p50 latency (b)/(a) |",
             "|---:|---:|---:|---|---:|---:|"]
    for n in sorted(runs, key=int):
        a, b = runs[n].get("fork") or {}, runs[n].get("fresh") or {}
        r = runs[n].get("ratio")
        met = "–" if r is None else "yes" if r >= TARGET_RATIO else "no"
        lines.append(f"| {n} | {_f(r)}× | ≥ {TARGET_RATIO:g}× | {met} | "
                     f"{_f(ratio(b, a, 'time_to_first_result_s'))}× | {_f(ratio(b, a, 'latency_p50_ms'))}× |")
    return lines


def markdown(result: dict) -> str:
    h = result.get("host") or {}
    art = result.get("artifacts") or {}
    lines = [f"# RL rollout benchmark {result['when']}", "",
             f"host {h.get('machine')} × {h.get('cpus')} cores, kernel {h.get('kernel')}; template "
             f"`{result.get('template')}` ({(result.get('shape') or {}).get('cpu')} vCPU / "
             f"{(result.get('shape') or {}).get('memory_mb')} MiB); git {result['git']['commit']}; "
             f"run took {result.get('duration_s')} s", "",
             f"Setup: `pip install --no-index` of {', '.join(art.get('packages') or [])} from a "
             f"{_f((art.get('wheelhouse_bytes') or 0) / 2**20)} MiB wheelhouse ({len(art.get('wheels') or {})} wheels), "
             f"`git clone` of a bundle ({art.get('bundle_bytes')} B), a warm Python worker that imported "
             f"{', '.join(art.get('imports') or [])} and the repo; task: a {result.get('steps')}-step rollout "
             "given to the warm worker through a FIFO, answer checked against the host's.", "",
             "## Rollouts", "", *table(result.get("runs") or {}), "",
             "## (a) / (b)", "", *ratio_table(result.get("runs") or {}), ""]
    lines += ["## Definitions", "",
              "- rollouts/h/node: correct rollouts ÷ the run's wall time (from its first API call — "
              "(a): the parent's create and its setup — to the last sandbox killed) × 3600, one node.",
              "- first result: the run's start → the first correct answer.",
              "- latency of a rollout: (a) its fork request (a batch of ≤ 20) → its answer; (b) its create "
              "request → setup → its answer.",
              "- PSS/rollout: mean PSS of a rollout's QEMU process (smaps_rollup) with the rollout alive after "
              "its answer; MemAvail drop: MemAvailable before the run's rollouts − while the most were alive, "
              "÷ that many.", ""]
    if result.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in result["notes"]], ""]
    return "\n".join(lines)


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rl-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    path.with_suffix(".md").write_text(markdown(result))
    return path
