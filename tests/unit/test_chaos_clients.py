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
