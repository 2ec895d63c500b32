"""harness.chaos_clients.Clients: a quiesce right after a release (the chaos run's last, after
its last fault's check) finds every client again, also those that never saw the release's
short gap: before, they stayed in their old hold without reporting and the run waited out the
quiesce's deadline (15 min: the test_chaos run that timed out)."""
import threading
from types import SimpleNamespace

from harness import chaos_clients
from harness.chaos_clients import Clients, Ledger


def test_a_quiesce_right_after_a_release_finds_every_client(monkeypatch):
    cycling = threading.Event()

    def cycle(self):
        cycling.set()
        self.stop.wait(0.01)

    monkeypatch.setattr(chaos_clients.Client, "cycle", cycle)
    stack = SimpleNamespace(api_url="http://127.0.0.1:9", sandbox_url="http://127.0.0.1:9", api_key="k")
    clients = Clients(3, stack, Ledger()).start()
    try:
        assert cycling.wait(30)
        for _ in range(5):
            assert clients.quiesce(deadline=30)
            clients.release()  # and at once the next quiesce: no client may be left behind
        assert clients.quiesce(deadline=30)
    finally:
        clients.close(deadline=10)


def test_answers_not_ok_are_grouped_by_what_they_said():
    from harness.chaos_clients import Record

    records = [Record(1.0, 0, "create", "ok", 201, 0.5),
               Record(2.0, 1, "pause", "clean", 503, 0.1,
                      '{"code":503,"message":"node node-1: cannot reach the result store: Error 111"}'),
               Record(3.0, 2, "pause", "clean", 503, 0.2,
                      '{"code":503,"message":"node node-1: cannot reach the result store: Error 111"}'),
               Record(4.0, 3, "fork", "refused", 409, 0.1, '{"code":409,"message":"sandbox i3k9x8a7b6c5d4 is paused"}'),
               Record(5.0, 4, "fork", "refused", 409, 0.1, '{"code":409,"message":"sandbox q0w9e8r7t6y5u4 is paused"}')]
    kinds = Ledger.kinds(records)
    assert [(k["op"], k["outcome"], k["status"], k["count"]) for k in kinds] == [
        ("pause", "clean", 503, 2), ("fork", "refused", 409, 2)]
    assert kinds[1]["detail"] == '{"code":#,"message":"sandbox # is paused"}'
