"""bench/load.py's figures from a run's Recorder (bench/load_client.py): per operation the
count, latency p50 / p95 / p99, refusals and unexpected errors; cycles per minute; and the
Markdown table comparing the levels (clients × nodes) of one run."""
from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from bench.lifecycle_common import percentile
from bench.load_client import OPS


def dist(values: list[float]) -> dict:
    """p50 / p95 / p99 / max (ms), nearest rank like the other benchmarks."""
    if not values:
        return {}
    return {"p50": round(percentile(values, 50), 1), "p95": round(percentile(values, 95), 1),
            "p99": round(percentile(values, 99), 1), "max": round(max(values), 1),
            "mean": round(statistics.mean(values), 1), "n": len(values)}


def phase_medians(phases: list[dict]) -> dict:
    names: dict[str, list[float]] = {}
    for p in phases:
        for k, v in p.items():
            names.setdefault(k, []).append(v)
    return {k: {"p50": round(percentile(v, 50), 1), "p95": round(percentile(v, 95), 1)} for k, v in names.items()}


def summarize(rec, duration_s: float) -> dict:
    """What a level's run shows: throughput, per-op latencies, refusals, errors."""
    per_op, attempts, errors_n, refusals_n = {}, 0, 0, 0
    for op in OPS:
        ok, refused, errors = rec.ok[op], rec.refused[op], rec.errors[op]
        attempts += len(ok) + len(refused) + len(errors)
        errors_n += len(errors)
        refusals_n += len(refused)
        per_op[op] = {"ok": len(ok), "refused": len(refused), "errors": len(errors),
                      "latency_ms": dist([ms for _, ms in ok]),
                      "refused_latency_ms": dist([ms for _, ms in refused]),
                      "server_timing_ms": phase_medians(rec.phases[op]),
                      "error_messages": dict(Counter(m for *_, m in errors).most_common(5))}
    wall = getattr(rec, "wall_s", duration_s)
    cycles = len(rec.cycles)
    per_minute = Counter(int(end // 60) for end, _ in rec.cycles)
    return {
        "wall_s": round(wall, 1), "cycles": cycles, "cycles_per_min": round(60 * cycles / wall, 2) if wall else 0.0,
        "ops_ok": sum(v["ok"] for v in per_op.values()), "ops_per_s": round(sum(v["ok"] for v in per_op.values()) / wall, 2),
        "attempts": attempts, "unexpected_errors": errors_n, "admission_refusals": refusals_n,
        "unexpected_error_rate": round(errors_n / attempts, 5) if attempts else 0.0,
        "create_refusal_rate": round(per_op["create"]["refused"] / max(1, per_op["create"]["ok"] + per_op["create"]["refused"]
                                                                     + per_op["create"]["errors"]), 4),
        "retry_after_values": dict(rec.retry_after), "cycle_s": dist([s * 1000 for _, s in rec.cycles]),
        "cycles_by_minute": [per_minute.get(m, 0) for m in range(int(wall // 60) + 1)],
        "cleanup_failures": rec.cleanup_failures, "ops": per_op,
    }


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    if v is None:
        return "–"
    return f"{v / 1000:.1f} s" if v >= 10000 else f"{v:.0f}"


def level_lines(name: str, s: dict) -> list[str]:
    lines = [f"### {name}", "",
             f"{s['cycles']} complete cycles in {s['wall_s']} s ({s['cycles_per_min']}/min), {s['ops_per_s']} calls/s ok; "
             f"unexpected errors {s['unexpected_errors']} of {s['attempts']} calls ({100 * s['unexpected_error_rate']:.2f} %); "
             f"admission refusals {s['admission_refusals']} (creates refused: {100 * s['create_refusal_rate']:.1f} %, "
             f"Retry-After {s['retry_after_values'] or '–'})", "",
             "| operation | ok | p50 ms | p95 ms | p99 ms | max ms | refused | refusal p50 / p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for op, v in s["ops"].items():
        lat, rl = v["latency_ms"], v["refused_latency_ms"]
        refused = f"{_ms(rl, 'p50')} / {_ms(rl, 'p99')}" if rl else "–"
        lines.append(f"| {op} | {v['ok']} | {_ms(lat, 'p50')} | {_ms(lat, 'p95')} | {_ms(lat, 'p99')} | "
                     f"{_ms(lat, 'max')} | {v['refused']} | {refused} | {v['errors']} |")
    timing = {op: v["server_timing_ms"] for op, v in s["ops"].items() if v["server_timing_ms"]}
    if timing:
        lines += ["", "API Server-Timing (p50 / p95 ms): " + "; ".join(
            f"{op}: " + ", ".join(f"{k} {p['p50']:.0f}/{p['p95']:.0f}" for k, p in t.items()) for op, t in timing.items())]
    errs = {op: v["error_messages"] for op, v in s["ops"].items() if v["error_messages"]}
    if errs:
        lines += ["", "Errors: " + json.dumps(errs)[:1500]]
    if s.get("process_cpu_pct_of_core"):
        lines += ["", "CPU, % of one core: " + ", ".join(f"{k} {v}" for k, v in s["process_cpu_pct_of_core"].items())]
    if s.get("postgres_sessions"):
        lines += ["", "PostgreSQL sessions (pg_stat_activity): " + json.dumps(s["postgres_sessions"])[:800]]
    if s.get("py_spy"):
        lines += ["", f"py-spy of {s['py_spy'].get('process')}, hottest frames of aenv's code (% of samples): "
                  + json.dumps(s["py_spy"].get("own_code_pct", {}))[:800]]
    if s.get("nodes_peak"):
        lines += ["", "Sandboxes per node at most: " + ", ".join(f"{k} {v}" for k, v in s["nodes_peak"].items())]
    return lines + [""]


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"load-{stamp}" + (f"-{result['label']}" if result.get("label") else "")
    out = out_dir / f"{name}.json"
    out.write_text(json.dumps(result, indent=2))
    h = result.get("host", {})
    lines = [f"# load benchmark {stamp}", "",
             f"host {h.get('machine')} × {h.get('cpus')} cores, {h.get('memory_mib')} MiB, kernel {h.get('kernel')}; "
             f"load average at start {h.get('loadavg_at_start')}, at end {h.get('loadavg_at_end')}; run took "
             f"{result.get('duration_s')} s; git {result.get('git', {}).get('commit', '?')}; settings "
             f"{json.dumps(result.get('settings', {}))}", ""]
    lines += [f"- {n}" for n in result.get("notes", [])] + ["", "## Levels", "",
              "| level | cycles/min | calls/s | create p50 / p99 | command p50 / p99 ms | resume p50 / p99 ms | "
              "unexpected errors | refusals | refusal p99 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, s in result["levels"].items():
        o = s["ops"]
        lines.append(f"| {key} | {s['cycles_per_min']} | {s['ops_per_s']} | {_ms(o['create']['latency_ms'], 'p50')} / "
                     f"{_ms(o['create']['latency_ms'], 'p99')} | {_ms(o['command']['latency_ms'], 'p50')} / "
                     f"{_ms(o['command']['latency_ms'], 'p99')} | {_ms(o['resume']['latency_ms'], 'p50')} / "
                     f"{_ms(o['resume']['latency_ms'], 'p99')} | {s['unexpected_errors']} | {s['admission_refusals']} | "
                     f"{_ms(o['create']['refused_latency_ms'], 'p99')} |")
    lines.append("")
    for key, s in result["levels"].items():
        lines += level_lines(key, s)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out
