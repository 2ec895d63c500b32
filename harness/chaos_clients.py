"""The chaos bench's clients: threads that each loop create → commands → pause → resume →
command → fork (a command in the child, the child killed) → kill, through the API and the data
plane as an E2B client does, and record every request's answer.

Every request gets one outcome class (``classify``): ``ok`` (2xx), ``refused`` (4xx with
E2B's error shape: a conflict, a sandbox that is gone), ``clean`` (502/503/504 with E2B's
error shape: the platform said it cannot now), ``down`` (no process listened: the connection
was refused, an answer of the machine's), ``cut`` (the process serving the request was
killed while it held it) and the findings: ``hang`` (no answer within the client's timeout),
``5xx`` (a 500, or a 5xx without the error shape) and ``shape`` (a 4xx without it).

Every sandbox id the API acknowledged (a create's or a fork child's 201) is kept with what
the client did to it last (``killed`` once a DELETE was sent), so the invariant check can
tell a sandbox the client killed from one that went silently."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

from envd_client import EnvdClient, EnvdError, EnvdUnavailable

FINDINGS = ("hang", "5xx", "shape")
# The longest a request may take before it counts as hung: a node task's deadline (the chaos
# stack's AENV_NODE_TASK_DEADLINE, 180 s) plus room; a command's is its own.
LIFECYCLE_TIMEOUT = 240.0
COMMAND_TIMEOUT = 60.0
# Sandbox / task ids (letters and digits mixed) and numbers, blanked when answers are grouped.
_IDS = re.compile(r"\b(?=[0-9a-z-]*\d)[0-9a-z-]*[a-z][0-9a-z-]{6,}\b|\d+(\.\d+)?")


def _shaped(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and "message" in body and "code" in body


def classify(resp: httpx.Response) -> str:
    if resp.status_code < 400:
        return "ok"
    if resp.status_code in (502, 503, 504):
        return "clean" if _shaped(resp) else "5xx"
    if resp.status_code >= 500:
        return "5xx"
    return "refused" if _shaped(resp) else "shape"


def classify_error(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "hang"
    if isinstance(exc, httpx.ConnectError):
        return "down"
    return "cut"  # read error / remote protocol error: the server went away mid-request


@dataclass
class Record:
    t: float  # seconds since the run began
    client: int
    op: str
    outcome: str
    status: int | None
    took: float
    detail: str = ""


@dataclass
class Ledger:
    """What every client did and got, shared by the clients (one lock)."""

    t0: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    acked: dict = field(default_factory=dict)  # sandbox id -> {"client", "t", "killed": bool, "via"}
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rec: Record) -> None:
        with self.lock:
            self.records.append(rec)

    def ack(self, sid: str, client: int, via: str) -> None:
        with self.lock:
            self.acked[sid] = {"client": client, "t": round(time.monotonic() - self.t0, 1), "killed": False,
                               "via": via}

    def killed(self, sid: str) -> None:
        with self.lock:
            if sid in self.acked:
                self.acked[sid]["killed"] = True

    def since(self, start: int) -> list[Record]:
        with self.lock:
            return self.records[start:]

    @staticmethod
    def kinds(records: list[Record], width: int = 90) -> list[dict]:
        """Every answer that was not ``ok``, grouped by operation, outcome, status and the start
        of its text (ids and numbers blanked), most frequent first: what a row's refusals,
        clean 5xx, ``down`` and ``cut`` were, not only how many."""
        groups: Counter = Counter()
        for r in records:
            if r.outcome != "ok":
                text = _IDS.sub("#", r.detail)[:width]
                groups[(r.op, r.outcome, r.status, text)] += 1
        return [{"op": op, "outcome": outcome, "status": status, "detail": text, "count": n}
                for (op, outcome, status, text), n in groups.most_common()]

    def summary(self, records: list[Record]) -> dict:
        """Per operation: outcome counts; the findings' records listed."""
        per_op: dict[str, Counter] = defaultdict(Counter)
        for r in records:
            per_op[r.op][r.outcome] += 1
        return {op: dict(c) for op, c in sorted(per_op.items())}


class Client(threading.Thread):
    """One E2B client looping its cycle until ``stop``; between cycles it waits while
    ``hold`` is set (the bench quiesces the clients for its checks)."""

    def __init__(self, n: int, api_url: str, sandbox_url: str, api_key: str, ledger: Ledger,
                 stop: threading.Event, hold: threading.Event, idle: threading.Semaphore, rounds: list[int]):
        super().__init__(daemon=True, name=f"chaos-client-{n}")
        self.n, self.api_url, self.sandbox_url, self.ledger = n, api_url, sandbox_url, ledger
        self.stop, self.hold, self.idle, self.rounds = stop, hold, idle, rounds
        self.http = httpx.Client(base_url=api_url, headers={"X-API-Key": api_key}, timeout=LIFECYCLE_TIMEOUT)
        self.cycles = 0

    # -- one request, recorded --------------------------------------------------------------

    def _api(self, op: str, method: str, path: str, **kwargs) -> httpx.Response | None:
        t = time.monotonic()
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self._record(op, classify_error(exc), None, t, f"{type(exc).__name__}: {exc}"[:200])
            return None
        outcome = classify(resp)
        self._record(op, outcome, resp.status_code, t, "" if outcome == "ok" else resp.text[:200])
        return resp

    def _record(self, op: str, outcome: str, status: int | None, t: float, detail: str = "") -> None:
        now = time.monotonic()
        self.ledger.add(Record(round(t - self.ledger.t0, 2), self.n, op, outcome, status, round(now - t, 2), detail))

    def _command(self, sid: str, token: str | None) -> bool:
        t = time.monotonic()
        try:
            with EnvdClient.through_proxy(self.sandbox_url, sid, token, timeout=COMMAND_TIMEOUT,
                                          stream_idle_timeout=COMMAND_TIMEOUT) as envd:
                result = envd.run(f"echo chaos-{self.n}", deadline=COMMAND_TIMEOUT)
            ok = result.exit_code == 0 and result.stdout.strip() == f"chaos-{self.n}".encode()
            self._record("command", "ok" if ok else "5xx", 200, t, "" if ok else repr(result)[:200])
            return ok
        except EnvdUnavailable as exc:
            took = time.monotonic() - t
            outcome = "hang" if took >= COMMAND_TIMEOUT - 1 else (
                "down" if "ConnectError" in str(exc) else "cut")
            self._record("command", outcome, None, t, str(exc)[:200])
        except EnvdError as exc:
            status = exc.status
            outcome = "clean" if status in (502, 503, 504) else ("5xx" if (status or 0) >= 500 else "refused")
            self._record("command", outcome, status, t, str(exc)[:200])
        return False

    # -- the cycle --------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stop.is_set():
            if self.hold.is_set():
                held = self.rounds[0]
                self.idle.release()
                # a new quiesce right after a release (the run's last) may set ``hold`` again
                # before this thread saw it clear: the round's number tells it to report again
                while self.hold.is_set() and self.rounds[0] == held and not self.stop.is_set():
                    time.sleep(0.2)
                continue
            try:
                self.cycle()
            except Exception as exc:  # noqa: BLE001 - a client bug is recorded, not a dead thread
                self._record("client", "5xx", None, time.monotonic(), f"client error {type(exc).__name__}: {exc}")
                time.sleep(1)
            self.cycles += 1
        self.http.close()

    def cycle(self) -> None:
        resp = self._api("create", "POST", "/v2/sandboxes",
                         json={"templateID": "base", "timeout": 900, "metadata": {"chaos": str(self.n)}})
        if resp is None or resp.status_code != 201:
            time.sleep(1)
            return
        body = resp.json()
        sid, token = body["sandboxID"], body.get("envdAccessToken")
        self.ledger.ack(sid, self.n, "create")
        try:
            self._command(sid, token)
            self._command(sid, token)
            paused = self._api("pause", "POST", f"/sandboxes/{sid}/pause")
            if paused is not None and paused.status_code == 204:
                resumed = self._api("resume", "POST", f"/sandboxes/{sid}/connect", json={"timeout": 900})
                if resumed is not None and resumed.status_code in (200, 201):
                    token = resumed.json().get("envdAccessToken") or token
            self._command(sid, token)
            forked = self._api("fork", "POST", f"/sandboxes/{sid}/fork", json={"count": 1})
            if forked is not None and forked.status_code == 201:
                for child in _children(forked):
                    self.ledger.ack(child["sandboxID"], self.n, "fork")
                    self._command(child["sandboxID"], child.get("envdAccessToken"))
                    self.ledger.killed(child["sandboxID"])
                    self._api("kill", "DELETE", f"/sandboxes/{child['sandboxID']}")
        finally:
            self.ledger.killed(sid)
            self._api("kill", "DELETE", f"/sandboxes/{sid}")


def _children(resp: httpx.Response) -> list[dict]:
    try:
        body = resp.json()
    except json.JSONDecodeError:
        return []
    items = body if isinstance(body, list) else body.get("sandboxes", body.get("children", []))
    return [item["sandbox"] for item in items if isinstance(item, dict) and isinstance(item.get("sandbox"), dict)]


class Clients:
    """``count`` clients started together; ``quiesce`` waits until each has finished its cycle
    and holds (the checks need no operation in flight), ``release`` lets them go on."""

    def __init__(self, count: int, stack, ledger: Ledger):
        self.stop, self.hold, self.idle = threading.Event(), threading.Event(), threading.Semaphore(0)
        self.rounds = [0]  # quiesces so far: each client reports idle once per round
        self.ledger = ledger
        self.clients = [Client(n, stack.api_url, stack.sandbox_url, stack.api_key, ledger, self.stop, self.hold,
                               self.idle, self.rounds) for n in range(count)]

    def start(self) -> "Clients":
        for c in self.clients:
            c.start()
        return self

    def quiesce(self, deadline: float = 900) -> bool:
        self.rounds[0] += 1
        self.hold.set()
        end = time.monotonic() + deadline
        for _ in self.clients:
            if not self.idle.acquire(timeout=max(0.0, end - time.monotonic())):
                return False
        return True

    def release(self) -> None:
        self.hold.clear()

    def close(self, deadline: float = 600) -> None:
        self.stop.set()
        self.hold.clear()
        for c in self.clients:
            c.join(deadline)

    @property
    def cycles(self) -> int:
        return sum(c.cycles for c in self.clients)
