"""Chaos (issue 27, item 2): while C clients create, run commands, pause, resume and fork,
each fault in turn — kill -9 of the API, the data plane, the node worker (and with ``--nodes 2``
the second node's, ``node-b``), the sweeper and Redis, a crash-restart of PostgreSQL, the node
home's disk full, the guest-RAM tmpfs full — then, once repaired and the nodes reconciled, the
invariants (harness/chaos_checks.py, on every node).
Prints a fault × outcome table; writes JSON and markdown to bench/results/.

Everything it breaks is its own: a private redis-server and PostgreSQL cluster, a loop-mounted
filesystem for AENV_HOME and a tmpfs for AENV_SHM_DIR (harness/chaos_services.py). Needs root
and real VMs: run under the VM lock, e.g.

    flock /tmp/aenv-vm.lock .venv/bin/python bench/chaos.py --clients 3 --faults api,dataplane,node,sweeper
    flock /tmp/aenv-vm.lock .venv/bin/python bench/chaos.py --nodes 2 --faults node,node-b --busy 40
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.chaos_clients import FINDINGS  # noqa: E402
from harness.chaos_stack import FAULTS  # noqa: E402


def outcome_cell(row: dict) -> str:
    """One table cell: PASS or what broke."""
    broken = []
    if row["bad_count"]:
        kinds = sorted({r["outcome"] for r in row["bad_requests"]})
        broken.append(f"{row['bad_count']} bad answers ({', '.join(kinds)})")
    for key, what in (("sandboxes", "sandbox"), ("orphans", "orphan"), ("serving", "not serving")):
        if row[key]:
            broken.append(f"{len(row[key])} {what}")
    if row["collateral_deaths"]:
        broken.append("died: " + ", ".join(row["collateral_deaths"]))
    return "PASS" if not broken else "FAIL: " + "; ".join(broken)


def totals(requests: dict) -> dict:
    out: dict[str, int] = {}
    for counts in requests.values():
        for outcome, n in counts.items():
            out[outcome] = out.get(outcome, 0) + n
    return out


def table(result: dict) -> str:
    head = ("| fault | what was done | answering again after | requests: ok / refused (4xx) / clean 5xx / "
            "down / cut / bad | outcome |\n|---|---|---|---|---|")
    lines = [head]
    for row in result["rows"]:
        t = totals(row["requests"])
        bad = sum(t.get(k, 0) for k in FINDINGS)
        lines.append(f"| {row['fault']} | {row['action']} | {row['back_after_fault_s']} s "
                     f"(repair +{row['answering_after_repair_s']} s) | {t.get('ok', 0)} / {t.get('refused', 0)} / "
                     f"{t.get('clean', 0)} / {t.get('down', 0)} / {t.get('cut', 0)} / {bad} | {outcome_cell(row)} |")
    return "\n".join(lines)


def details(result: dict) -> str:
    out = []
    for row in result["rows"]:
        notes = row["sandboxes"] + row["orphans"] + row["serving"] + [
            f"{r['op']} {r['outcome']} {r['status']} after {r['took']} s: {r['detail']}" for r in row["bad_requests"]]
        if notes:
            out.append(f"- **{row['fault']}**: " + "; ".join(notes[:12]))
        answers = [f"{a['count']} × {a['op']} {a['outcome']} {a['status'] or ''} {a['detail']!r}".replace("  ", " ")
                   for a in row.get("answers", [])]
        if answers:
            out.append(f"- {row['fault']}, answers not ok: " + "; ".join(answers[:10]))
    final = result["final"]
    for key in ("sandboxes", "orphans", "serving"):
        if final[key]:
            out.append(f"- **at the end** ({key}): " + "; ".join(final[key][:12]))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20, help="concurrent E2B clients (default 20)")
    parser.add_argument("--faults", help=f"comma-separated, of {','.join(FAULTS)} (default: all; node-b with "
                                          "--nodes 2)")
    parser.add_argument("--busy", type=float, default=20, help="seconds of client work before each fault")
    parser.add_argument("--hold", type=float, default=10, help="seconds each fault lasts before its repair")
    parser.add_argument("--after", type=float, default=20, help="seconds of client work after each repair")
    parser.add_argument("--minutes", type=float, default=0,
                        help="begin no fault that would end later than this many minutes after the start, "
                             "going by the longest so far (0: no limit); the VM lock's 15 min slots: ~11")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="node workers (2: a second one, and the node-b fault kills it)")
    parser.add_argument("--tag", default="", help="a word for the result files' names")
    args = parser.parse_args()
    if args.faults is None:  # every fault this world has
        faults = [f for f in FAULTS if f != "node-b" or args.nodes > 1]
    else:
        faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown fault(s) {sorted(unknown)}")
    if "node-b" in faults and args.nodes < 2:
        parser.error("node-b needs --nodes 2")

    from harness.chaos_run import run  # noqa: PLC0415 - the stack's modules only when running
    from harness.chaos_stack import chaos_world  # noqa: PLC0415

    # a timeout's SIGTERM unwinds (the world's mounts, VMs and private servers removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"chaos-{stamp}{'-' + args.tag if args.tag else ''}"
    partial = []

    def on_row(row: dict) -> None:  # each row kept at once: a run cut short still reports
        partial.append(row)
        print(f"{row['fault']}: {outcome_cell(row)}", flush=True)
        (out_dir / f"{name}.partial.json").write_text(json.dumps(partial, indent=2, default=str))

    stop_at = time.monotonic() + 60 * args.minutes if args.minutes else None
    with chaos_world(args.clients, nodes=args.nodes) as world:
        result = run(world, args.clients, faults, busy=args.busy, hold=args.hold, after=args.after, on_row=on_row,
                     stop_at=stop_at)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result.update({"benchmark": "chaos", "when": stamp, "commit": commit, "clients": args.clients, "nodes": args.nodes,
                   "busy_s": args.busy, "hold_s": args.hold, "after_s": args.after,
                   "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()}})
    skipped = f"not run (--minutes): {', '.join(result['skipped'])}\n\n" if result["skipped"] else ""
    text = (f"# Chaos {stamp} (commit {commit}, {args.clients} clients, {args.nodes} node(s), {os.cpu_count()} CPUs)\n\n"
            f"{table(result)}\n\n{details(result)}\n\n{skipped}cycles {result['cycles']}, sandboxes acknowledged "
            f"{result['acknowledged']}; requests per operation: {json.dumps(result['requests'])}\n")
    print(text)
    (out_dir / f"{name}.partial.json").unlink(missing_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / f"{name}.md").write_text(text)
    print(f"wrote bench/results/{name}.json and .md")
    return 0 if all(outcome_cell(r) == "PASS" for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
