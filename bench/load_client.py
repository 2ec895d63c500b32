"""The load generator of bench/load.py: virtual clients of the official E2B async SDK
(``AsyncSandbox``, as users write it), each looping create → N commands → pause → resume
(connect) → kill until its deadline, and a recorder of every call's outcome.

An outcome is one of three: ok, an admission refusal (a 503 that carries ``Retry-After``:
the API had no node with room; the client waits what it was told and tries again) or an
unexpected error (anything else, a 503 without ``Retry-After`` included). The SDK turns
every 503 into ``ServiceBusyException`` without its headers, so ``install_response_hook``
adds a response hook to the SDK's API client that notes the last 503's ``Retry-After`` in
the calling task's context. The SDK's own retries are off (``retries=0``): every refusal is
seen and counted, and the client honours ``Retry-After`` itself."""
from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections import Counter
from dataclasses import dataclass, field

OPS = ("create", "command", "pause", "resume", "check", "kill")
# what each virtual client's API calls see: {"retry_after": "5"} after a 503 that had one,
# {"timing": "<Server-Timing>"} after a lifecycle call that answered
_LAST_503: contextvars.ContextVar[dict] = contextvars.ContextVar("aenv_load_last_503")


def install_response_hook() -> None:
    """Once per process: the SDK's API client also records each 503's Retry-After."""
    from e2b.api import AsyncApiClient  # noqa: PLC0415

    if getattr(AsyncApiClient, "_aenv_load_hook", False):
        return
    original = AsyncApiClient._logging_event_hooks

    def hooks(self) -> dict:
        async def on_response(response) -> None:
            box = _LAST_503.get(None)
            if box is None:
                return
            if response.status_code == 503:
                box["retry_after"] = response.headers.get("retry-after")
            elif response.headers.get("server-timing"):  # the API's phases of a lifecycle call
                box["timing"] = response.headers["server-timing"]

        out = {k: list(v) for k, v in (original(self) or {}).items()}
        out.setdefault("request", [])
        out.setdefault("response", []).append(on_response)
        return out

    AsyncApiClient._logging_event_hooks = hooks
    AsyncApiClient._aenv_load_hook = True


class Refused(Exception):
    """An admission refusal: wait ``retry_after`` seconds, then try again."""

    def __init__(self, retry_after: float):
        super().__init__(f"refused, retry after {retry_after:g} s")
        self.retry_after = retry_after


@dataclass
class Recorder:
    """Every call's outcome, with its latency (ms) and when it ended (s after the start)."""

    t0: float = field(default_factory=time.monotonic)
    ok: dict = field(default_factory=lambda: {op: [] for op in OPS})
    refused: dict = field(default_factory=lambda: {op: [] for op in OPS})
    errors: dict = field(default_factory=lambda: {op: [] for op in OPS})
    retry_after: Counter = field(default_factory=Counter)
    phases: dict = field(default_factory=lambda: {op: [] for op in OPS})  # Server-Timing of ok calls
    cycles: list = field(default_factory=list)  # (end s, cycle s) of each complete cycle
    cleanup_failures: list = field(default_factory=list)

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)


@dataclass
class Settings:
    template: str = "base"
    commands: int = 20
    sandbox_timeout: int = 900  # the sandbox's own TTL: a crashed run leaves nothing for long
    request_timeout: float = 600.0  # one API call, client side: a create under TCG load is slow, not lost
    command_timeout: float = 120.0
    resume_patience: float = 600.0  # how long a refused resume keeps trying
    metadata: dict = field(default_factory=lambda: {"bench": "load"})


async def _call(rec: Recorder, op: str, coro_fn):
    """Runs one SDK call, records its outcome; a refusal raises Refused, an error re-raises."""
    from e2b import ServiceBusyException  # noqa: PLC0415

    box = _LAST_503.get()
    box.clear()
    t0 = time.perf_counter()
    try:
        result = await coro_fn()
    except ServiceBusyException as exc:
        ms = (time.perf_counter() - t0) * 1e3
        value = box.get("retry_after")
        if value and value.strip().isdigit():
            rec.refused[op].append((rec.at(), ms))
            rec.retry_after[value.strip()] += 1
            raise Refused(float(value)) from None
        rec.errors[op].append((rec.at(), ms, f"503 without Retry-After: {exc}"[:300]))
        raise
    except Exception as exc:
        ms = (time.perf_counter() - t0) * 1e3
        rec.errors[op].append((rec.at(), ms, f"{type(exc).__name__}: {exc}"[:300]))
        raise
    rec.ok[op].append((rec.at(), (time.perf_counter() - t0) * 1e3))
    if box.get("timing"):
        from bench.create_kill import parse_server_timing  # noqa: PLC0415

        rec.phases[op].append(parse_server_timing(box["timing"]))
    return result


async def _wait(seconds: float, stop_at: float) -> None:
    """A refused client's back-off: what it was told plus a little jitter, never past the end."""
    await asyncio.sleep(max(0.0, min(seconds * (1 + 0.2 * random.random()), stop_at - time.monotonic())))


async def _cycle(rec: Recorder, cfg: Settings, conn: dict, index: int, stop_at: float) -> bool:
    """One create → commands → pause → resume → check → kill; False if it was refused at
    create (nothing made). Errors propagate after the sandbox, if any, was killed."""
    from e2b import AsyncSandbox  # noqa: PLC0415

    try:
        sbx = await _call(rec, "create", lambda: AsyncSandbox.create(
            cfg.template, timeout=cfg.sandbox_timeout, metadata={**cfg.metadata, "client": str(index)}, **conn))
    except Refused as refused:
        await _wait(refused.retry_after, stop_at)
        return False
    started = time.monotonic()
    try:
        marker = f"c{index}-{random.getrandbits(32):08x}"
        for k in range(cfg.commands):
            cmd = f"echo {marker} > /tmp/load-marker; echo {k}" if k == 0 else f"echo {k}"
            out = await _call(rec, "command", lambda cmd=cmd: sbx.commands.run(cmd, timeout=cfg.command_timeout,
                                                                               request_timeout=cfg.command_timeout))
            if out.stdout.strip() != str(k):
                raise AssertionError(f"command {k} answered {out.stdout!r}")
        await _call(rec, "pause", lambda: sbx.pause(**conn))
        give_up = time.monotonic() + cfg.resume_patience
        while True:
            try:
                await _call(rec, "resume", lambda: sbx.connect(timeout=cfg.sandbox_timeout, **conn))
                break
            except Refused as refused:  # no room to resume it now: it stays paused, try again
                if time.monotonic() > give_up:
                    raise RuntimeError(f"resume refused for {cfg.resume_patience:g} s") from None
                await asyncio.sleep(refused.retry_after)
        if cfg.commands:  # (none: a node without guests, bench/load.py --fake)
            out = await _call(rec, "check", lambda: sbx.commands.run("cat /tmp/load-marker",
                                                                     timeout=cfg.command_timeout,
                                                                     request_timeout=cfg.command_timeout))
            if out.stdout.strip() != marker:
                raise AssertionError(f"state lost over pause/resume: {out.stdout!r} != {marker!r}")
        await _call(rec, "kill", lambda: sbx.kill(**conn))
    except BaseException:
        try:
            await AsyncSandbox.kill(sbx.sandbox_id, **conn)
        except Exception as exc:  # noqa: BLE001 - reported; the run's cleanup kills what is left
            rec.cleanup_failures.append(f"{sbx.sandbox_id}: {type(exc).__name__}: {exc}"[:300])
        raise
    rec.cycles.append((rec.at(), round(time.monotonic() - started, 2)))
    return True


async def virtual_client(rec: Recorder, cfg: Settings, conn: dict, index: int, stop_at: float) -> None:
    """Cycles until ``stop_at`` (a cycle under way is finished)."""
    _LAST_503.set({})
    while time.monotonic() < stop_at:
        try:
            await _cycle(rec, cfg, conn, index, stop_at)
        except Exception:  # noqa: BLE001 - recorded by _call; the client goes on, as a user's would
            await asyncio.sleep(1.0)


async def run_clients(clients: int, duration: float, cfg: Settings, conn: dict, ramp_s: float = 0.0) -> Recorder:
    """``clients`` virtual clients for ``duration`` seconds (each started ``ramp_s / clients``
    after the previous one); returns the recorder once every client has finished."""
    install_response_hook()
    rec = Recorder()
    stop_at = rec.t0 + duration

    async def delayed(i: int) -> None:
        await asyncio.sleep(ramp_s * i / max(clients, 1))
        await virtual_client(rec, cfg, conn, i, stop_at)

    await asyncio.gather(*(delayed(i) for i in range(clients)))
    rec.wall_s = time.monotonic() - rec.t0
    return rec
