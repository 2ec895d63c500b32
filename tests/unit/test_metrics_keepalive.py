"""The node's metrics sampler keeps one connection per guest and asks idle guests less often
(issue 26): each request is emulated work in a TCG guest, and a new connection every 5 s per
guest cost an idle sandbox more host CPU than the guest itself. A loopback envd stand-in
counts the connections and requests it gets; the sampler's clock is the test's."""
from __future__ import annotations

import json
import os
import socket
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from django.utils import timezone

from harness.polling import until
from tests.hostile_envd import GOOD


class KeptEnvd:
    """An HTTP/1.1 ``/metrics`` that keeps connections open; ``cpu`` is what it reports."""

    def __init__(self, cpu: float = 1.0):
        self.cpu, self.connections, self.requests, self.open = cpu, 0, 0, 0
        self.sockets: set = set()
        lock, outer = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with lock:
                    outer.connections += 1
                    outer.open += 1
                    outer.sockets.add(self.connection)

            def finish(self):
                with lock:
                    outer.open -= 1
                super().finish()

            def do_GET(self):  # noqa: N802 - http.server's name
                with lock:
                    outer.requests += 1
                body = json.dumps({**GOOD, "cpu_used_pct": outer.cpu}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="kept-envd").start()

    def row(self, sandbox_id: str) -> dict:
        return {"id": sandbox_id, "envd_host": "127.0.0.1", "envd_port": self.port, "envd_access_token": ""}

    def close(self) -> None:
        """Stops listening and cuts the open connections (envd gone, the guest killed)."""
        self.server.shutdown()
        self.server.server_close()
        for sock in list(self.sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def envd():
    server = KeptEnvd()
    yield server
    server.close()


@pytest.fixture
def scraper_of():
    made = []

    def make(**kw):
        from agent.metrics import Scraper  # noqa: PLC0415

        clock = Clock()
        scraper = Scraper(kw.pop("interval", 5.0), kw.pop("idle_interval", 25.0), clock=clock, **kw)
        made.append(scraper)
        return scraper, clock
    yield make
    for scraper in made:
        scraper.close()


def rounds(scraper, clock, rows, count: int, step: float = 5.0) -> list[list[str]]:
    """``count`` rounds ``step`` s apart; the ids asked (and answering) in each."""
    asked = []
    for _ in range(count):
        asked.append(sorted(s.sandbox_id for s in scraper.collect(scraper.due(rows), 2.0)))
        clock.now += step
    return asked


def test_one_connection_per_guest_is_kept_from_round_to_round(envd, scraper_of):
    scraper, clock = scraper_of(idle_interval=5.0)  # every round
    assert rounds(scraper, clock, [envd.row("a")], 4) == [["a"]] * 4
    assert envd.requests == 4
    assert envd.connections == 1  # a new connection per request would be 4


def test_an_idle_guest_is_asked_every_idle_interval_a_busy_one_every_round(envd, scraper_of):
    busy = KeptEnvd(cpu=40.0)
    try:
        scraper, clock = scraper_of()
        rows = [envd.row("idle"), busy.row("busy")]
        asked = rounds(scraper, clock, rows, 11)  # t = 0, 5, ... 50
        assert [("idle" in r, "busy" in r) for r in asked] == \
            [(i in (0, 5, 10), True) for i in range(11)]  # the idle one at 0, 25, 50 s
        assert envd.requests == 3 and busy.requests == 11
        # the idle guest gets busy: its next sample says so, and from then on it is asked every round
        envd.cpu = 60.0
        asked = rounds(scraper, clock, rows, 6)  # t = 55 ... 80: asked at 75, then every round
        assert ["idle" in r for r in asked] == [False, False, False, False, True, True]
        assert envd.connections == 1 and busy.connections == 1
    finally:
        busy.close()


def test_a_vm_busy_on_the_host_is_asked_every_round_though_its_last_sample_was_idle(envd, scraper_of):
    """What the host reads of the VM (its process's CPU time) brings an idle-looking guest
    back to every round at once, without waiting for the idle interval."""
    vm = {"a": 0.0}
    scraper, clock = scraper_of(host_cpu=lambda: dict(vm))
    rows = [envd.row("a")]
    assert rounds(scraper, clock, rows, 3) == [["a"], [], []]  # idle: 0.0 s of host CPU
    vm["a"] += 1.0  # 1 s of CPU in the last 5 s: 20 % of a core
    assert rounds(scraper, clock, rows, 1) == [["a"]]
    vm["a"] += 0.05  # 1 %: idle again, and its sample says idle
    assert rounds(scraper, clock, rows, 2) == [[], []]


def test_a_failed_request_is_retried_next_round_on_a_new_connection(envd, scraper_of):
    scraper, clock = scraper_of()
    rows = [envd.row("a")]
    assert rounds(scraper, clock, rows, 1) == [["a"]]
    envd.close()  # the guest's envd went away: the kept connection is dead
    assert rounds(scraper, clock, rows, 2) == [[], []]  # idle, not yet due
    assert rounds(scraper, clock, rows, 3) == [[], [], []]  # due at 25 s, fails; asked again each round
    assert scraper.seen["a"].cpu_pct is None
    back = KeptEnvd()
    try:
        rows = [{**back.row("a")}]  # the same sandbox, its envd answering again (resumed elsewhere)
        assert rounds(scraper, clock, rows, 1) == [["a"]]
        assert back.connections == 1
    finally:
        back.close()


def test_a_sandbox_no_longer_sampled_has_its_connection_closed(envd, scraper_of):
    scraper, clock = scraper_of(idle_interval=5.0)
    rounds(scraper, clock, [envd.row("a")], 2)
    assert envd.open == 1
    rounds(scraper, clock, [], 1)  # paused or killed: not among the running rows any more
    until(lambda: envd.open == 0, "the kept connection closed", deadline=10)
    assert "a" not in scraper.seen


def test_closing_the_scraper_closes_its_connections_and_loop(envd, scraper_of):
    scraper, clock = scraper_of(idle_interval=5.0)
    rounds(scraper, clock, [envd.row("a")], 1)
    scraper.close()
    assert scraper.loop.is_closed()
    until(lambda: envd.open == 0, "the kept connection closed", deadline=10)


def test_vm_cpu_seconds_reads_running_vms_only():
    from agent.metrics import vm_cpu_seconds  # noqa: PLC0415
    from vmm.driver import VMStatus  # noqa: PLC0415

    infos = [SimpleNamespace(sandbox_id="here", pid=os.getpid(), status=VMStatus.RUNNING),
             SimpleNamespace(sandbox_id="paused", pid=os.getpid(), status=VMStatus.PAUSED),
             SimpleNamespace(sandbox_id="saved", pid=0, status=VMStatus.SAVED),
             SimpleNamespace(sandbox_id="gone", pid=2**22 + 1, status=VMStatus.RUNNING)]
    got = vm_cpu_seconds(SimpleNamespace(list=lambda: infos))
    assert set(got) == {"here"} and got["here"] > 0


@pytest.mark.django_db
def test_the_sampler_asks_idle_sandboxes_less_often_and_counts_only_those_asked(envd, node, team, base_template):
    from agent.metrics import MetricsSampler, Scraper  # noqa: PLC0415
    from sandboxes.models import Sandbox, SandboxMetric  # noqa: PLC0415

    sb = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                envd_host="127.0.0.1", envd_port=envd.port, end_at=timezone.now() + timedelta(hours=1))
    counts = []
    sampler = MetricsSampler("n1", 5.0, 3600, on_round=lambda asked, stored: counts.append((asked, stored)),
                             idle_interval=25.0)
    clock = Clock()
    sampler.scraper = Scraper(5.0, 25.0, clock=clock)
    try:
        for _ in range(6):
            sampler.sample_once()
            clock.now += 5.0
    finally:
        sampler.close()
    assert counts == [(1, 1), (0, 0), (0, 0), (0, 0), (0, 0), (1, 1)]
    assert SandboxMetric.objects.filter(sandbox=sb).count() == 2
    assert envd.connections == 1
