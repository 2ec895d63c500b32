"""The node's metrics sampler against guests that replaced envd (issue 21 item 2): a
hostile envd on loopback (tests/hostile_envd.py) sends an endless body, drips a byte a
second, or sends numbers no column holds. The round ends by its deadline, reads no more
than the cap, stores the good sandboxes' samples and drops only the bad ones'. The store
tests run on SQLite and again on PostgreSQL (they use the database), where an out-of-range
integer is a DataError rather than sqlite3's OverflowError."""
from __future__ import annotations

import threading
import time
import tracemalloc
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.hostile_envd import GOOD, HostileEnvd, json_with, metrics_body

# What a guest may send instead of a sample; each costs its own sandbox's sample only.
BAD_BODIES = {
    "overflowing float": json_with("mem_used", "1e999"),
    "infinite cpu": json_with("cpu_used_pct", "1e999"),
    "NaN cpu": json_with("cpu_used_pct", "NaN"),
    "negative bytes": metrics_body(disk_used=-1),
    "2**70 bytes": metrics_body(mem_total=2**70),
    "2**40 vcpus": metrics_body(cpu_count=2**40),
    "cpu over 100": metrics_body(cpu_used_pct=250.0),
    "string number": metrics_body(mem_used="123"),
    "float bytes": metrics_body(mem_used=1.5),
    "bool": metrics_body(cpu_count=True),
    "list": b"[1, 2, 3]",
    "missing field": b'{"ts": 1}',
    "not json": b"\x00\xffgarbage",
    "huge json": metrics_body(padding="x" * (1 << 20)),
}


@pytest.fixture
def sandboxes(db, node, team, base_template):
    """make(port) → a running sandbox of node n1 whose envd is at 127.0.0.1:port."""
    from sandboxes.models import Sandbox  # noqa: PLC0415

    def make(port: int) -> Sandbox:
        return Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                      envd_host="127.0.0.1", envd_port=port, end_at=timezone.now() + timedelta(hours=1))
    return make


def run_bounded(fn, limit: float):
    """fn() in a thread; (result, seconds) if it ended within ``limit``, else fails (the
    thread, stuck in the guest's read, is left to end when the guest goes away)."""
    out = {}

    def target():
        out["result"] = fn()
    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting on the guests after {limit} s"
    return out.get("result"), time.monotonic() - started


@pytest.mark.timeout(30)  # before the fix the round never ended (the dripping guests)
def test_a_round_ends_by_its_deadline_and_stores_only_the_good_guests_samples(sandboxes):
    from agent.metrics import MetricsSampler, round_deadline  # noqa: PLC0415
    from sandboxes.models import SandboxMetric  # noqa: PLC0415

    servers = [HostileEnvd("good"), HostileEnvd("good"), HostileEnvd("drip"), HostileEnvd("drip_headers"),
               HostileEnvd("endless")] + [HostileEnvd("body", body=b) for b in BAD_BODIES.values()]
    for s in servers:
        s.__enter__()
    try:
        made = [sandboxes(s.port) for s in servers]
        rounds = []
        sampler = MetricsSampler("n1", 2.0, 3600, on_round=lambda asked, stored: rounds.append((asked, stored)))
        deadline = round_deadline(sampler.interval)
        started = time.monotonic()
        stored = sampler.sample_once()  # in this thread: the test's database transaction
        took = time.monotonic() - started
        assert took < deadline + 1.5, took
        assert stored == 2 and rounds == [(len(servers), 2)]
        rows = list(SandboxMetric.objects.all())
        assert {m.sandbox_id for m in rows} == {made[0].id, made[1].id}
        assert all(m.mem_total == GOOD["mem_total"] and m.cpu_used_pct == GOOD["cpu_used_pct"] for m in rows)
        # the endless guest's body was read up to the cap, not on and on
        assert servers[4].requests == 1
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_a_bad_answer_drops_that_sandboxs_sample_only(name):
    from agent.metrics import collect  # noqa: PLC0415

    with HostileEnvd("good") as good, HostileEnvd("body", body=BAD_BODIES[name]) as bad:
        samples, _ = run_bounded(lambda: collect([good.row("good"), bad.row("bad")], 2.0), 5)
    assert [s.sandbox_id for s in samples] == ["good"]


def test_a_dripping_guest_costs_the_round_its_deadline_not_more():
    from agent.metrics import collect  # noqa: PLC0415

    with HostileEnvd("good") as good, HostileEnvd("drip", interval=0.2) as drip, \
            HostileEnvd("drip_headers", interval=0.2) as slow_head:
        samples, took = run_bounded(lambda: collect([drip.row("d"), slow_head.row("h"), good.row("g")], 1.0), 4)
    assert [s.sandbox_id for s in samples] == ["g"]
    assert 0.9 < took < 2.0, took


def test_an_endless_body_is_read_up_to_the_cap_only():
    from agent.metrics import collect  # noqa: PLC0415
    from envd_client import limits  # noqa: PLC0415

    with HostileEnvd("endless") as endless:
        tracemalloc.start()
        try:
            samples, _ = run_bounded(lambda: collect([endless.row("e")], 2.0), 5)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert samples == []
    assert peak < limits.METRICS_BYTES + (4 << 20), peak  # the cap plus the client's own overhead


def test_rounds_leave_no_threads_behind():
    from agent.metrics import collect  # noqa: PLC0415

    def ours() -> list[str]:  # the threads not of the hostile server
        return [t.name for t in threading.enumerate() if not t.name.startswith("hostile-envd")]

    with HostileEnvd("drip", interval=0.1) as drip:
        before = ours()
        for _ in range(3):
            collect([drip.row("d")] * 5, 0.5)
            assert ours() == before


@pytest.mark.django_db
def test_store_keeps_the_others_when_a_value_does_not_fit_its_column(sandboxes):
    """Samples made by anyone (not only the checked client): the one with a value no
    column holds is dropped, the others are stored, on SQLite and PostgreSQL alike."""
    from agent.metrics import store  # noqa: PLC0415
    from sandboxes.models import SandboxMetric  # noqa: PLC0415

    made = [sandboxes(1000 + i) for i in range(6)]

    def sample(sb, **bad):
        fields = {k: v for k, v in GOOD.items() if k != "ts"}
        return SandboxMetric(sandbox_id=sb.id, timestamp=timezone.now(), **{**fields, **bad})

    samples = [sample(made[0]), sample(made[1], mem_total=2**70), sample(made[2], cpu_count=2**40),
               sample(made[3], cpu_used_pct=float("nan")), sample(made[4], disk_used=-1), sample(made[5])]
    assert store(samples) == 2
    assert set(SandboxMetric.objects.values_list("sandbox_id", flat=True)) == {made[0].id, made[5].id}


@pytest.mark.django_db
def test_store_survives_the_database_refusing_a_value(sandboxes, monkeypatch):
    """Should a value pass the checks and still be refused (a DataError on PostgreSQL,
    OverflowError from sqlite3), the bulk insert falls back to one by one."""
    from agent import metrics  # noqa: PLC0415
    from sandboxes.models import SandboxMetric  # noqa: PLC0415

    made = [sandboxes(2000 + i) for i in range(3)]
    monkeypatch.setattr(metrics, "valid", lambda s: True)
    fields = {k: v for k, v in GOOD.items() if k != "ts"}
    samples = [SandboxMetric(sandbox_id=sb.id, timestamp=timezone.now(), **fields) for sb in made]
    samples[1].mem_used = 2**70
    assert metrics.store(samples) == 2
    assert set(SandboxMetric.objects.values_list("sandbox_id", flat=True)) == {made[0].id, made[2].id}
