"""How ``aenv`` shows results: one place for the output conventions.

- Lists (``ls``, ``snapshot ls``, ``template ls``, ``nodes``, ``metrics``) print a table
  when stdout is a terminal and JSON (an array, 2-space indent) when it is not;
  ``-o table|json`` forces either.
- Actions print a short line on stdout (ids alone where scripts capture them), JSON
  with ``-o json``. Warnings, notices and progress go to stderr.
- Progress bars (tqdm, imported only then) only when stderr is a terminal.

The table is drawn here rather than by a library: it is a few lines, and a table
library costs more start-up time than ``aenv ls`` spends on its request."""
from __future__ import annotations

import json
import sys
from datetime import datetime

from .errors import ApiError

MISSING = "-"


def wants_json(args) -> bool:
    """JSON for ``-o json`` (or the old ``--json``), or by default when stdout is piped."""
    choice = getattr(args, "output", None)
    if getattr(args, "json", False):
        choice = "json"
    if choice is None:
        return not sys.stdout.isatty()
    return choice == "json"


def print_json(value) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def cell(value) -> str:
    if value is None or value == "" or value == [] or value == {}:
        return MISSING
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def table(headers: list[str], rows: list[list]) -> str:
    """A box-drawn table (AgentENV's style: a rule under the header only), left-aligned,
    ``-`` for missing cells; the header shows even without rows."""
    text = [[cell(c) for c in row] for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *text)]

    def rule(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * (w + 2) for w in widths) + right

    def line(row) -> str:
        return "│" + "│".join(f" {c:<{w}} " for c, w in zip(row, widths)) + "│"

    out = [rule("┌", "┬", "┐"), line(headers)]
    out.append(rule("├", "┼", "┤"))
    out.extend(line(row) for row in text)
    out.append(rule("└", "┴", "┘"))
    return "\n".join(out)


def print_table(headers: list[str], rows: list[list]) -> None:
    sys.stdout.write(table(headers, rows) + "\n")
    sys.stdout.flush()


def local_time(timestamp) -> str:
    """An RFC 3339 timestamp as local ``YYYY-MM-DD HH:MM:SS`` (as given if unparsable)."""
    if not timestamp:
        return MISSING
    try:
        return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return str(timestamp)


def size(n) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 20.0 MiB, 3.2 GiB."""
    if n is None:
        return MISSING
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def warn(message: str) -> None:
    print(f"aenv: {message}", file=sys.stderr, flush=True)


class Outcomes:
    """Per-item results of an action on several things (pause, rm, ...): a line each on
    stdout (or one JSON array with ``-o json``), failures on stderr, and the exit status
    of the first failure."""

    def __init__(self, args, key: str = "sandboxID"):
        self.key = key
        self.as_json = getattr(args, "output", None) == "json" or bool(getattr(args, "json", False))
        self.results: list[dict] = []
        self.status = 0

    def ok(self, ref: str, line: str, **extra) -> None:
        self.results.append({self.key: ref, "ok": True, **extra})
        if not self.as_json:
            print(line, flush=True)

    def failed(self, ref: str, status: int, message: str) -> None:
        error = ApiError(status, message)
        self.results.append({self.key: ref, "ok": False, "status": status, "message": message})
        warn(f"{ref}: {error.message}")
        if not self.status:
            self.status = error.exit_code

    def finish(self) -> int:
        if self.as_json:
            print_json(self.results)
        return self.status


class Progress:
    """A byte progress bar on stderr while ``total`` bytes move; nothing when stderr is
    not a terminal, when ``quiet``, or for an empty transfer."""

    def __init__(self, total: int, label: str, *, quiet: bool = False):
        self._bar = None
        if total > 0 and not quiet and sys.stderr.isatty():
            from tqdm import tqdm  # noqa: PLC0415 - only for a bar on a terminal

            self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False, dynamic_ncols=True)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
