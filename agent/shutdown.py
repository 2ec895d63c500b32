"""A node worker that is told to stop (SIGTERM: ``systemctl stop``, ``scripts/down.sh``)
pauses every running sandbox of its node to disk, with memory, before it exits — like
AgentENV — so nothing keeps running unattended and a reboot loses no running state.

Each pause is the API's (``running → pausing → paused`` with its events, the node's
``pause_to_disk``), several at once, within ``AENV_NODE_STOP_TIMEOUT`` seconds: what is not
paused by then stays running (the next start reattaches it). The next start resumes
nothing by itself: a connect, or traffic to an auto-resume sandbox, does."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait

from django.db import close_old_connections
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import SandboxState as S
from sandboxes.transitions import transition_sync

from agent import moves
from agent.stores import get_store

log = logging.getLogger(__name__)

PARALLEL = 4  # pauses at once: each is a QEMU save (device state) plus its exit


def _event(sandbox_id: str, actor: str, outcome: str, from_state: str, started=None, t0=None, message="",
           details=None) -> SandboxEvent:
    return SandboxEvent(sandbox_id=sandbox_id, operation="pause", outcome=outcome, from_state=from_state,
                        started_at=started or timezone.now(),
                        duration_ms=round((time.monotonic() - t0) * 1000, 1) if t0 else None,
                        message=message, details={"memory": True, "reason": "node shutdown", **(details or {})},
                        actor=actor)


def pause_one(driver, sandbox_id: str, actor: str) -> str:
    """One sandbox through the pause transitions; returns what happened."""
    started, t0 = timezone.now(), time.monotonic()
    try:
        if not transition_sync(sandbox_id, [S.RUNNING], S.PAUSING, _event(sandbox_id, actor, "started", S.RUNNING)):
            return "skipped"  # not running any more
        try:
            timings = driver.pause_to_disk(sandbox_id)
        except Exception as exc:  # noqa: BLE001 - it keeps running; reported
            transition_sync(sandbox_id, [S.PAUSING], S.RUNNING,
                            _event(sandbox_id, actor, "error", S.PAUSING, started, t0, message=str(exc)))
            return f"failed: {exc}"
        transition_sync(sandbox_id, [S.PAUSING], S.PAUSED,
                        _event(sandbox_id, actor, "ok", S.PAUSING, started, t0,
                               details={"timings": {k: round(float(v), 2) for k, v in (timings or {}).items()}}))
        return "paused"
    finally:
        close_old_connections()


def pause_all(node_id: str, driver, timeout: float) -> dict[str, str]:
    """Pauses every running sandbox of ``node_id``; returns {sandbox id: outcome}."""
    actor = f"node:{node_id}"
    ids = list(Sandbox.objects.filter(node_id=node_id, state=S.RUNNING).values_list("pk", flat=True))
    if not ids:
        return {}
    log.info("stopping: pausing %d running sandbox(es) to disk (at most %.0f s)", len(ids), timeout)
    t0 = time.monotonic()
    done: dict[str, str] = {}
    pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="stop-pause")
    futures = {pool.submit(pause_one, driver, sid, actor): sid for sid in ids}
    finished, late = wait(futures, timeout=timeout)
    for future in finished:
        sid = futures[future]
        done[sid] = future.result() if future.exception() is None else f"failed: {future.exception()}"
        log.info("stopping: %s %s", sid, done[sid])
    for future in late:
        done[futures[future]] = "not paused in time"
    pool.shutdown(wait=False, cancel_futures=True)
    driver.settle(max(1.0, timeout - (time.monotonic() - t0)))  # paused memory safely on disk before exit
    if moves.shared_store():  # resumable on another node while this one is away
        store = get_store()
        for sid in [s for s, v in done.items() if v == "paused"]:
            if time.monotonic() - t0 > timeout:
                break
            try:
                moves.export_now(driver, store, sid)
            except Exception:  # noqa: BLE001 - it stays resumable here
                log.exception("stopping: exporting %s to the store failed", sid)
    paused = sum(1 for v in done.values() if v == "paused")
    log.info("stopping: %d of %d sandbox(es) paused in %.1f s", paused, len(ids), time.monotonic() - t0)
    return done
