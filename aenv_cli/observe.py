"""Watching sandboxes and the cluster: ``aenv logs`` (E2B's sandbox logs), ``aenv metrics``
(E2B's ``GET /sandboxes/{id}/metrics``) and ``aenv nodes`` (``GET /nodes``, AgentENV's
shape: every figure with an operator's ``AENV_ADMIN_TOKEN``, else the team's view).

Logs come from ``GET /v2/sandboxes/{id}/logs`` (``{logs: [{timestamp, level, message,
fields}]}``, ``cursor`` = a unix time in ms, ``direction=forward``); a server without it
is asked the v1 path (``{logs: [{timestamp, line}], logEntries?}``, ``start``), and a
server with neither is told apart from an unknown sandbox and said to be too old."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime, timezone

import httpx

from . import errors, output
from .api import check, client, message_of, segment
from .config import Config
from .errors import ApiError, CliError

FOLLOW_EVERY = 1.0  # seconds between log polls while following
METRICS_EVERY = 5.0  # seconds between metrics polls while following (the node samples every few seconds)
GONE_CHECK_EVERY = 5  # polls between checks that a followed sandbox still exists
LEVEL_ORDER = {"debug": 0, "info": 1, "warn": 2, "warning": 2, "error": 3}
_FRACTION = re.compile(r"(\.\d{6})\d+")


def epoch_ms(timestamp) -> int:
    """An RFC 3339 timestamp (any fraction digits, ``Z``) as unix milliseconds; 0 if unreadable."""
    text = _FRACTION.sub(r"\1", str(timestamp)).replace("Z", "+00:00")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return 0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


# --------------------------------------------------------------------------- logs


class LogSource:
    """Pages of a sandbox's log entries from whichever logs API the server has, each entry
    as ``{timestamp, level, message, fields}``."""

    def __init__(self, api: httpx.Client, sandbox_id: str, *, limit: int, level: str | None):
        self.api, self.sandbox_id, self.limit, self.level = api, sandbox_id, limit, level
        self.version: int | None = None  # 2 or 1, once known

    def page(self, cursor) -> tuple[list[dict], object]:
        """The entries from ``cursor`` (unix ms, or the server's ``nextCursor``) on, and
        the server's ``nextCursor`` when it gives one."""
        if self.version in (None, 2):
            params = {"limit": self.limit, "direction": "forward", **({"cursor": cursor} if cursor else {}),
                      **({"level": self.level} if self.level else {})}
            resp = self.api.get(f"/v2/sandboxes/{segment(self.sandbox_id)}/logs", params=params)
            if resp.status_code != 404 or self.version == 2:
                body = check(resp).json()
                self.version = 2
                return [_v2_entry(e) for e in body.get("logs") or []], body.get("nextCursor")
        params = {"limit": self.limit, **({"start": cursor} if cursor else {})}
        resp = self.api.get(f"/sandboxes/{segment(self.sandbox_id)}/logs", params=params)
        if resp.status_code == 404 and self.version is None:
            self._explain_404(resp)
        body = check(resp).json()
        self.version = 1
        if body.get("logEntries"):
            entries = [_v2_entry(e) for e in body["logEntries"]]
        else:
            entries = [{"timestamp": e.get("timestamp"), "level": "info", "message": e.get("line", ""), "fields": {}}
                       for e in body.get("logs") or []]
        floor = LEVEL_ORDER.get(self.level or "debug", 0)
        return [e for e in entries if LEVEL_ORDER.get(e["level"], 1) >= floor], None

    def _explain_404(self, resp: httpx.Response) -> None:
        sandbox = self.api.get(f"/sandboxes/{segment(self.sandbox_id)}")
        if sandbox.status_code == 404:
            raise ApiError(404, message_of(sandbox))
        check(sandbox)
        raise CliError(f"this server does not serve sandbox logs (GET /v2/sandboxes/{{id}}/logs and "
                       f"/sandboxes/{{id}}/logs answered 404: {message_of(resp)}); it predates them",
                       errors.NOT_FOUND)


def _v2_entry(e: dict) -> dict:
    return {"timestamp": e.get("timestamp"), "level": str(e.get("level") or "info").lower(),
            "message": e.get("message", ""), "fields": e.get("fields") or {}}


def format_entry(entry: dict) -> str:
    fields = " ".join(f"{k}={v}" for k, v in (entry.get("fields") or {}).items())
    text = f"{output.local_time(entry['timestamp'])} {entry['level'].upper():<5} {entry['message']}"
    return f"{text}  {fields}" if fields else text


class LogReader:
    """New entries, oldest first, each once. The cursor is a time in ms, which entries
    may share: the ones already shown at the newest ms are remembered and skipped; a
    full page of only those (more than a page in one ms) moves on to the next ms."""

    def __init__(self, source: LogSource):
        self.source = source
        self.newest: int | None = None
        self.at_newest: set = set()
        self.next_cursor = None

    def read(self) -> tuple[list[dict], bool]:
        """(fresh entries, whether a full page came back: more may be waiting)."""
        entries, self.next_cursor = self.source.page(self.next_cursor or self.newest)
        fresh = []
        for entry in entries:
            ms = epoch_ms(entry["timestamp"])
            key = (entry["timestamp"], entry["level"], entry["message"])
            if self.newest is not None and (ms < self.newest or (ms == self.newest and key in self.at_newest)):
                continue
            if self.newest is None or ms > self.newest:
                self.newest, self.at_newest = ms, set()
            self.at_newest.add(key)
            fresh.append(entry)
        full = len(entries) >= self.source.limit
        if full and not fresh and not self.next_cursor and self.newest is not None:
            self.newest += 1
            self.at_newest = set()
        return fresh, full and (bool(fresh) or not self.next_cursor)


def cmd_logs(args, config: Config) -> int:
    as_json = args.output == "json"
    polls = 0
    with client(config) as api:
        reader = LogReader(LogSource(api, args.sandbox_id, limit=args.limit, level=args.level))
        while True:
            try:
                fresh, more = reader.read()
            except ApiError as exc:
                if exc.status == 404 and args.follow and reader.source.version is not None:
                    output.warn(f"sandbox {args.sandbox_id} no longer exists")
                    return 0
                raise
            for entry in fresh:
                sys.stdout.write((json.dumps(entry) if as_json else format_entry(entry)) + "\n")
            sys.stdout.flush()
            if more:
                continue
            if not args.follow:
                return 0
            polls += 1
            if polls % GONE_CHECK_EVERY == 0 and api.get(f"/sandboxes/{segment(args.sandbox_id)}").status_code == 404:
                output.warn(f"sandbox {args.sandbox_id} no longer exists")
                return 0
            time.sleep(FOLLOW_EVERY)


# --------------------------------------------------------------------------- metrics


def metric_row(m: dict) -> list:
    return [output.local_time(m.get("timestamp")), f"{float(m.get('cpuUsedPct', 0)):.1f} % of {m.get('cpuCount')}",
            f"{output.size(m.get('memUsed'))} / {output.size(m.get('memTotal'))}",
            f"{output.size(m.get('diskUsed'))} / {output.size(m.get('diskTotal'))}"]


METRIC_COLUMNS = ["TIME", "CPU", "MEMORY", "DISK"]


def cmd_metrics(args, config: Config) -> int:
    as_json = output.wants_json(args)
    params = {"start": int(time.time()) - args.since} if args.since is not None else {}
    path = f"/sandboxes/{segment(args.sandbox_id)}/metrics"
    with client(config) as api:
        rows = check(api.get(path, params=params)).json()
        if not args.follow:
            if as_json:
                output.print_json(rows)
            else:
                output.print_table(METRIC_COLUMNS, [metric_row(m) for m in rows])
            return 0
        widths = [19, 18, 24, 24]
        if not as_json:
            print("  ".join(c.ljust(w) for c, w in zip(METRIC_COLUMNS, widths)).rstrip(), flush=True)
        while True:
            for m in rows:
                line = json.dumps(m) if as_json else "  ".join(c.ljust(w) for c, w in zip(metric_row(m), widths))
                print(line.rstrip(), flush=True)
            last = max((int(m.get("timestampUnix", 0)) for m in rows), default=int(time.time()) - 1)
            time.sleep(METRICS_EVERY)
            rows = check(api.get(path, params={"start": last + 1})).json()


# --------------------------------------------------------------------------- nodes


NODE_COLUMNS = ["NODE ID", "STATUS", "ADDRESS", "RUNNING", "PAUSED", "STARTING", "vCPU (alloc/cap)",
                "MEMORY (alloc/cap)", "HOST CPU", "VERSION"]
# What a team's key is shown (the server's tenant view: the counts are the team's own).
TENANT_NODE_COLUMNS = ["NODE ID", "STATUS", "RUNNING", "PAUSED", "STARTING"]
# An operator's token (the server's AENV_ADMIN_TOKEN): ``aenv nodes`` then shows every figure.
ADMIN_TOKEN_ENV = "AENV_ADMIN_TOKEN"


def node_row(n: dict) -> list:
    metrics, capacity = n.get("metrics") or {}, n.get("capacity") or {}
    return [n.get("id"), n.get("status"), n.get("address"), n.get("sandboxCount"), n.get("sandboxPausedCount"),
            n.get("sandboxStartingCount"), f"{metrics.get('allocatedCPU', '-')}/{capacity.get('cpu', '-')}",
            f"{output.size(metrics.get('allocatedMemoryBytes'))}/{output.size(capacity.get('memoryBytes'))}",
            f"{float(metrics.get('cpuPercent', 0)):.0f} %", n.get("version")]


def tenant_node_row(n: dict) -> list:
    return [n.get("id"), n.get("status"), n.get("sandboxCount"), n.get("sandboxPausedCount"),
            n.get("sandboxStartingCount")]


def cmd_nodes(args, config: Config) -> int:
    with client(config) as api:
        if os.environ.get(ADMIN_TOKEN_ENV):
            api.headers["X-Admin-Token"] = os.environ[ADMIN_TOKEN_ENV]
        if args.node_id:
            node = check(api.get(f"/nodes/{segment(args.node_id)}")).json()
            if output.wants_json(args):
                output.print_json(node)
            else:
                output.print_table(["FIELD", "VALUE"], [[k, output.cell(v)] for k, v in node.items()])
            return 0
        nodes = check(api.get("/nodes")).json()
    if output.wants_json(args):
        output.print_json(nodes)
    else:
        if any("address" in n for n in nodes):
            output.print_table(NODE_COLUMNS, [node_row(n) for n in nodes])
        else:
            output.print_table(TENANT_NODE_COLUMNS, [tenant_node_row(n) for n in nodes])
    return 0
