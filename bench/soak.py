"""Benchmark: the soak (issue 27.1). One sandbox does --cycles pause → connect cycles while
--sandboxes others, at the same time, each run a mix of pause → connect, snapshot → create
from it, fork ×2, a network update (PUT /sandboxes/{id}/network), file writes and reads and
commands, each with a long-running counter that must never restart or go back; all through the
official E2B SDK against a stack of its own (API, data plane, node worker with real VMs,
sweeper). What it checks and records: bench/soak_run.py.

    flock /tmp/aenv-vm.lock .venv/bin/python bench/soak.py [--cycles 1000] [--sandboxes 8]
        [--warmup 100] [--window 100]

Prints the tables; JSON + Markdown to bench/results/soak-<UTC stamp>.{json,md}. Exit status 1
when state was lost, an error was answered or something leaked (RSS or descriptors of the node
worker, the API or the data plane more than 10 % above their figures after the warm-up, or a
sandbox, snapshot or fork capture left). Its stack is network instance ``<--net-prefix>s1`` on
the /20 after --net-pool (default aenvk, 10.27.16.0/20), removed at the end. Needs root.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lifecycle_common import LoadMonitor, finish_run, own_stack, parse_stack_args, write_results  # noqa: E402
from bench.templates import git_state  # noqa: E402

WATCHED = ("node", "api", "dataplane", "lifecycle")


def leaders_of(stack) -> dict[str, int]:
    """The process-group leaders the soak watches (the stack starts each in a session of its own)."""
    return {name: stack.procs[name].pid for name in WATCHED if name in stack.procs}


def summarize(cfg, res) -> dict:
    from bench.soak_run import drift, leaks, windows  # noqa: PLC0415

    win = windows(res.samples, max(res.cycles_done, 1), cfg.window)
    return {"config": asdict(cfg), "cycles": res.cycles_done, "worker_ops": res.worker_ops,
            "state_lost": len(res.state_lost), "errors": len(res.errors),
            "state_lost_list": res.state_lost, "error_list": res.errors,
            "windows": win, "drift": drift(win), "points": res.points, "leaks": leaks(res.points),
            "run_s": res.duration_s, "time_limited": res.time_limited}


def verdict(summary: dict) -> list[str]:
    """What failed, as lines (empty: the soak passed)."""
    bad = []
    if summary["state_lost"]:
        bad.append(f"state lost {summary['state_lost']}×")
    if summary["errors"]:
        bad.append(f"{summary['errors']} error(s)")
    for name, leak in summary["leaks"].items():
        if leak.get("leak") and name in ("node", "api", "dataplane", "stack"):
            bad.append(f"leak: {name} {leak}")
    if summary["cycles"] < summary["config"]["cycles"] and not summary["time_limited"]:
        bad.append(f"stopped after {summary['cycles']} of {summary['config']['cycles']} cycles")
    return bad


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# Soak {result['when']} (commit {result['git']['commit']})", "",
             f"{s['cycles']} main cycles (pause → connect → check → command) with {s['config']['sandboxes']} "
             f"sandboxes at once"
             + (f" (each waiting {s['config']['worker_pause']:g} s between its operations)"
                if s["config"].get("worker_pause") else "")
             + f"; run {s['run_s']} s; worker operations: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["worker_ops"].items())), "",
             f"**state lost: {s['state_lost']}, errors: {s['errors']}**", "",
             "## Operation times per window of cycles (p50 / p99, s)", "",
             "| operation | n | first window p50 / p99 | last window p50 / p99 | drift p50 / p99 |",
             "|---|---|---|---|---|"]
    for op, rows in s["windows"].items():
        a, b = rows[0], rows[-1]
        d = s["drift"].get(op, {})
        lines.append(f"| {op} | {sum(r['n'] for r in rows)} | {a['p50_s']} / {a['p99_s']} ({a['cycles']}) | "
                     f"{b['p50_s']} / {b['p99_s']} ({b['cycles']}) | {d.get('p50_ratio', '–')} / "
                     f"{d.get('p99_ratio', '–')} |")
    lines += ["", "## Processes (RSS MiB / open descriptors, of them connections of the soak's own SDK clients)", "",
              "| process | " + " | ".join(f"{p} (cycle {v['cycle']})" for p, v in s["points"].items())
              + " | growth after warm-up (RSS, fds) |",
              "|---" * (len(s["points"]) + 2) + "|"]
    names = next(iter(s["points"].values()))["processes"] if s["points"] else {}
    for name in names:
        cells = [f"{v['processes'][name]['rss_mib']} / {v['processes'][name]['fds']} "
                 f"({v['processes'][name]['own_client_conns']})" for v in s["points"].values()]
        lk = s["leaks"].get(name, {})
        growth = (f"{lk.get('rss_growth', 0):+.1%}, {lk.get('fds_growth', 0):+.1%}"
                  + (" **leak**" if lk.get("leak") else "")) if lk else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {growth} |")
    lines.append("| waited for idle connections to close, s | " + " | ".join(
        str(v.get("settle_s", 0)) for v in s["points"].values()) + " | |")
    for key, label in (("host", "host"), ("stack", "stack")):
        for field in (next(iter(s["points"].values()))[key] if s["points"] else {}):
            lines.append(f"| {label} {field} | " + " | ".join(str(v[key][field]) for v in s["points"].values())
                         + " | |")
    if s["state_lost_list"] or s["error_list"]:
        lines += ["", "## Failures", ""]
        lines += [f"- {e['who']} {e['op']} cycle {e['cycle']} ({e['at']}): {e['error']}"
                  for e in s["state_lost_list"] + s["error_list"]]
    lines += ["", "## Verdict", ""] + ([f"- {b}" for b in result["verdict"]] or ["- passed"])
    lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=1000, help="pause → connect cycles of the main sandbox")
    p.add_argument("--sandboxes", type=int, default=8, help="sandboxes running the mix at the same time")
    p.add_argument("--warmup", type=int, default=100, help="cycles before the leak baseline is taken")
    p.add_argument("--window", type=int, default=100, help="cycles per percentile window")
    p.add_argument("--sdk-retries", type=int, default=0, help="the SDK's retries of 429/5xx answers (0: every "
                                                             "failed answer counts)")
    p.add_argument("--minutes", type=float, default=0, help="stop the cycles after this long (0: no limit): "
                                                              "chunks that fit a slot of the VM lock")
    p.add_argument("--max-errors", type=int, default=25, help="stop early after this many failures")
    p.add_argument("--stop-file", default="", help="stop the cycles cleanly once this file exists (the results "
                                                   "are written as after --minutes)")
    p.add_argument("--worker-pause", type=float, default=0, help="s each worker waits between its operations "
                                                                 "(0: back to back; recorded with the results)")
    args = parse_stack_args(p, "aenvk", "10.27.0.0/20")

    from bench.soak_run import Config, Soak  # noqa: PLC0415

    cfg = Config(cycles=args.cycles, sandboxes=args.sandboxes, warmup=min(args.warmup, args.cycles),
                 window=args.window, sdk_retries=args.sdk_retries, max_errors=args.max_errors,
                 minutes=args.minutes, stop_file=args.stop_file, worker_pause=args.worker_pause)
    t_start, load0 = time.monotonic(), os.getloadavg()
    monitor = LoadMonitor().start()
    result = {"benchmark": "soak", "git": git_state(), "notes": []}
    with own_stack("soak", result) as stack:
        os.environ.update(E2B_API_URL=stack.api_url, E2B_SANDBOX_URL=stack.sandbox_url, E2B_API_KEY=stack.api_key)
        os.environ.pop("E2B_DEBUG", None)
        monitor.phase = "soak"
        res = Soak(cfg, leaders_of(stack), stack.home, log=lambda m: print(m, flush=True)).run()
    summary = summarize(cfg, res)
    result["when"] = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result.update(summary=summary, verdict=verdict(summary), samples=res.samples)
    result["notes"].append(f"SDK retries {cfg.sdk_retries}; sandboxes of the base template; each worker shuffles "
                           "its five operations every round; measurements taken with every worker stopped at an "
                           "operation boundary")
    finish_run(result, monitor.stop(), t_start, load0)
    write_results(args.out, "soak", result, markdown(result))
    return 1 if result["verdict"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
