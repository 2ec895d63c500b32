"""dataplane.steer against a recording stand-in for HAProxy's runtime API: the order of its
writes (never a port without its sandbox's token), what it publishes for handoffs, a
sandbox's servers deleted when it leaves or moves, and that it empties HAProxy's maps when
it cannot vouch for them."""
import asyncio

import pytest

from dataplane.haproxy_admin import Admin, AdminError
from dataplane.steer import Entry, Steer, token_digest


class Recorder(Admin):
    def __init__(self, fail=False):
        super().__init__("/nonexistent")
        self.batches, self.fail = [], fail

    async def run(self, *commands):
        if self.fail:
            raise AdminError("down")
        self.batches.append(list(commands))
        return ""


def steer_with(entries: list[dict], admin=None):
    state = {"now": entries[0]}

    async def read():
        if isinstance(state["now"], Exception):
            raise state["now"]
        return state["now"]

    steer = Steer(admin or Recorder(), "/maps", read=read)
    return steer, state


def flat(admin):
    return [c for batch in admin.batches for c in batch]


def test_tokens_go_in_first_ports_after_and_out_first():
    a = Entry("10.12.0.3", token_digest("t"), 1)
    steer, state = steer_with([{"sb1": a}])
    asyncio.run(steer.sync())
    assert flat(steer.admin) == ["clear map /maps/ports.map", "clear map /maps/tokens.map",
                                 f"add map /maps/tokens.map sb1 {token_digest('t')}"]
    assert steer.published("sb1", "10.12.0.3", 1) and not steer.published("sb1", "10.12.0.3", 2)
    assert not steer.published("sb1", "10.12.0.3", 1, port=8080)  # no port before the data plane asks

    steer.admin.batches.clear()
    assert asyncio.run(steer.ensure_port("sb1", "10.12.0.3", 1, 8080)) is True
    assert flat(steer.admin) == ["add server guest/sb1_8080 10.12.0.3:8080 weight 0", "enable server guest/sb1_8080",
                                 "add map /maps/ports.map sb1_8080 10.12.0.3"]
    assert steer.published("sb1", "10.12.0.3", 1, port=8080)
    # a stale route (another address or VM generation) gets no port
    assert asyncio.run(steer.ensure_port("sb1", "10.12.0.9", 2, 8081)) is False

    steer.admin.batches.clear()
    state["now"] = {}
    asyncio.run(steer.sync())
    assert flat(steer.admin) == ["del map /maps/ports.map sb1_8080", "del map /maps/tokens.map sb1",
                                 "set server guest/sb1_8080 state maint", "shutdown sessions server guest/sb1_8080",
                                 "del server guest/sb1_8080"]
    assert not steer.published("sb1", "10.12.0.3", 1) and steer.doomed == set()


def test_a_moved_sandbox_loses_its_ports_until_asked_again():
    steer, state = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}])
    asyncio.run(steer.sync())
    asyncio.run(steer.ensure_port("sb1", "10.12.0.3", 1, 8080))
    steer.admin.batches.clear()
    state["now"] = {"sb1": Entry("10.12.0.9", "", 2)}
    asyncio.run(steer.sync())
    assert flat(steer.admin) == ["del map /maps/ports.map sb1_8080", "set server guest/sb1_8080 state maint",
                                 "shutdown sessions server guest/sb1_8080", "del server guest/sb1_8080"]
    assert steer.published("sb1", "10.12.0.9", 2) and not steer.published("sb1", "10.12.0.9", 2, port=8080)
    assert asyncio.run(steer.ensure_port("sb1", "10.12.0.9", 2, 8080)) is True
    assert steer.published("sb1", "10.12.0.9", 2, port=8080)


def test_nothing_changed_sends_nothing():
    steer, _ = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}])
    asyncio.run(steer.sync())
    steer.admin.batches.clear()
    asyncio.run(steer.sync())
    assert steer.admin.batches == []


def test_a_failed_read_empties_the_maps():
    steer, state = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}])
    steer.interval = 0.01
    asyncio.run(steer.sync())
    steer.admin.batches.clear()
    state["now"] = RuntimeError("database down")

    async def one_round():
        task = asyncio.ensure_future(steer.run())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(one_round())
    assert ["clear map /maps/ports.map", "clear map /maps/tokens.map"] in steer.admin.batches
    assert not steer.published("sb1", "10.12.0.3", 1)


@pytest.mark.parametrize("bad", ["sb1 10.0.0.1", "a;b", "x\nshutdown sessions", ""])
def test_nothing_unsafe_reaches_the_runtime_api(bad):
    with pytest.raises(AdminError):
        Admin.set_entry("/maps/routes.map", bad, "10.0.0.1", known=False)
    with pytest.raises(AdminError):
        Admin.set_entry("/maps/routes.map", "sb1", bad, known=False)


def test_a_dead_launchers_run_directory_is_removed_and_a_live_ones_kept(tmp_path):
    import os
    import socket
    import time

    from dataplane.serve import remove_stale

    dead, live, young = (tmp_path / f"dataplane-hotpath-{n}" for n in ("dead", "live", "young"))
    for path in (dead, live, young):
        path.mkdir()
    (dead / "admin.sock").write_text("")  # a socket file nobody listens on any more
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live / "admin.sock"))
    listener.listen()
    old = time.time() - 3600
    for path in (dead, live):
        os.utime(path, (old, old))
    try:
        remove_stale(tmp_path)
    finally:
        listener.close()
    assert not dead.exists() and live.exists() and young.exists()
