"""How fast ``aenv`` starts: wall time of ``aenv --help`` (no request; the parser only)
and ``aenv ls`` (one authenticated list call; piped, so JSON) per ``aenv`` executable,
best and median of N runs, as JSON. The API is whatever the environment names
(E2B_API_URL / E2B_API_KEY or the credentials file), e.g. a running scripts/up.sh.

    .venv/bin/python bench/cli_start.py --aenv .venv/bin/aenv --aenv /tmp/standalone/bin/aenv
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def wall_ms(argv: list[str], runs: int) -> dict:
    times = []
    for _ in range(runs + 1):  # the first run warms the page cache and writes .pyc files
        started = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, timeout=60)
        times.append((time.perf_counter() - started) * 1000)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.decode()[-500:]}")
    times = times[1:]
    return {"best_ms": round(min(times), 1), "median_ms": round(statistics.median(times), 1), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aenv", action="append", required=True, help="an aenv executable (repeatable)")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    result = {exe: {"help": wall_ms([exe, "--help"], args.runs), "ls": wall_ms([exe, "ls"], args.runs)}
              for exe in args.aenv}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
