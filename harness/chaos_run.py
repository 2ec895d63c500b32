"""One chaos run, shared by bench/chaos.py and tests/integration/test_chaos.py: clients busy on a
ChaosWorld, each fault in turn injected, held, repaired, then (clients held) the invariants
checked (harness.chaos_checks). Returns one row per fault: what was done, how long the stack
took to answer again, every request's outcome per operation, and the findings."""
from __future__ import annotations

import time

from envd_client import EnvdClient, EnvdError

from harness.chaos_checks import db_rows, orphan_findings, running_ids, sandbox_findings, settle
from harness.chaos_clients import FINDINGS, Clients, Ledger
from harness.chaos_stack import ORPHAN_WAIT, WARM_SLOTS, ChaosWorld, wait_healthy


def _commands_answer(stack, ids: list[str]) -> list[str]:
    """Every running sandbox answers a command through the data plane (running means serving)."""
    out = []
    tokens = {}
    if ids:
        code = ("from sandboxes.models import Sandbox as S\n"
                f"for s in S.objects.filter(pk__in={ids!r}): print(s.pk, s.envd_access_token or '-')")
        tokens = dict(line.split() for line in stack.db(code).strip().splitlines() if line.count(" ") == 1)
    for sid in ids:
        token = tokens.get(sid, "-")
        try:
            with EnvdClient.through_proxy(stack.sandbox_url, sid, None if token == "-" else token, timeout=60) as envd:
                if envd.run("echo alive", deadline=60).stdout.strip() != b"alive":
                    out.append(f"{sid}: running but its command's answer was wrong")
        except EnvdError as exc:
            out.append(f"{sid}: running but a command failed: {exc}")
    return out


def check(world: ChaosWorld, ledger: Ledger, orphan_deadline: float = ORPHAN_WAIT) -> dict:
    """The invariants now (the clients must be holding). Orphans may take up to
    ``orphan_deadline`` to go: a create whose API was killed mid-boot leaves a VM the node's
    reconcile removes once the create counts as abandoned (AENV_RECONCILE_STALE)."""
    stack = world.stack
    rows = settle(stack, list(ledger.acked))
    sandboxes = sandbox_findings(stack, dict(ledger.acked), rows)
    end = time.monotonic() + orphan_deadline
    while True:  # the node's reconcile runs every AENV_RECONCILE_INTERVAL
        orphans = orphan_findings(stack, world.shm.mnt, WARM_SLOTS, world.node_views())
        if not orphans or time.monotonic() > end:
            break
        time.sleep(3)
    running = running_ids(stack, "*")
    states: dict[str, int] = {}
    for row in db_rows(stack, list(ledger.acked)).values():
        states[row["state"]] = states.get(row["state"], 0) + 1
    return {"sandboxes": sandboxes, "orphans": orphans, "serving": _commands_answer(stack, running),
            "states": states}


def one_fault(world: ChaosWorld, clients: Clients, ledger: Ledger, fault: str, *, busy: float, hold: float,
              after: float) -> dict:
    """``fault`` while the clients run; the invariants once it is repaired."""
    start = len(ledger.records)
    time.sleep(busy)  # operations in flight when it strikes
    action = world.inject(fault)
    t_fault = time.monotonic()
    time.sleep(hold)
    world.recover(fault)
    recovered = wait_healthy(world.stack)
    died = world.revive()
    back_s = round(time.monotonic() - t_fault, 1)
    time.sleep(after)  # the clients on the repaired stack
    quiet = clients.quiesce()
    found = check(world, ledger)
    records = ledger.since(start)
    clients.release()
    bad = [r.__dict__ for r in records if r.outcome in FINDINGS]
    return {"fault": fault, "action": action, "hold_s": hold, "answering_after_repair_s": round(recovered, 1),
            "back_after_fault_s": back_s, "collateral_deaths": died, "clients_quiesced": quiet,
            "requests": ledger.summary(records), "answers": Ledger.kinds(records),
            "bad_requests": bad[:50], "bad_count": len(bad), **found}


def run(world: ChaosWorld, clients_n: int, faults: list[str], *, busy: float = 20, hold: float = 10,
        after: float = 20, on_row=None, stop_at: float | None = None) -> dict:
    """``stop_at`` (time.monotonic()): no fault begins that would end after it, going by the
    longest fault so far (a run that fits a slot of the shared VM lock); the rest are
    listed as ``skipped``."""
    ledger = Ledger()
    clients = Clients(clients_n, world.stack, ledger).start()
    rows, skipped, longest = [], [], 0.0
    try:
        for fault in faults:
            if stop_at is not None and (skipped or time.monotonic() + longest > stop_at):
                skipped.append(fault)
                continue
            t = time.monotonic()
            row = one_fault(world, clients, ledger, fault, busy=busy, hold=hold, after=after)
            longest = max(longest, time.monotonic() - t)
            row["took_s"] = round(time.monotonic() - t, 1)
            rows.append(row)
            if on_row:
                on_row(row)
        clients.quiesce()  # every cycle ended: the last check sees no operation in flight
    finally:
        clients.close(deadline=10)  # daemon threads: a run cut short does not wait for them
    final = check(world, ledger)
    return {"rows": rows, "skipped": skipped, "final": final, "cycles": clients.cycles,
            "acknowledged": len(ledger.acked),
            "requests": ledger.summary(ledger.records)}
