"""dataplane.steer against a recording stand-in for HAProxy's runtime API: the order of its
writes (never a port without its sandbox's token), what it publishes for handoffs, a
sandbox's servers retired when it leaves or moves and deleted only once no connection leads
to them, and that it empties HAProxy's maps when it cannot vouch for them."""
import asyncio
import time

import pytest

from dataplane.haproxy_admin import POOL, Admin, AdminError
from dataplane.steer import Entry, Steer, token_digest


class Recorder(Admin):
    def __init__(self, fail=False):
        super().__init__("/nonexistent")
        self.batches, self.fail = [], fail
        self.fds = ""  # what "show fd" answers

    async def run(self, *commands, check=True):
        if self.fail:
            raise AdminError("down")
        self.batches.append(list(commands))
        return self.fds if commands == ("show fd",) else ""


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
    assert flat(steer.admin) == [f"add server guest/sb1_8080.1 10.12.0.3:8080 weight 0 {POOL}",
                                 "enable server guest/sb1_8080.1", "add map /maps/ports.map sb1_8080 sb1_8080.1"]
    assert steer.published("sb1", "10.12.0.3", 1, port=8080)
    # a stale route (another address or VM generation) gets no port
    assert asyncio.run(steer.ensure_port("sb1", "10.12.0.9", 2, 8081)) is False

    steer.admin.batches.clear()
    state["now"] = {}
    asyncio.run(steer.sync())
    assert flat(steer.admin) == ["del map /maps/ports.map sb1_8080", "del map /maps/tokens.map sb1",
                                 "set server guest/sb1_8080.1 state maint",
                                 "shutdown sessions server guest/sb1_8080.1", "show fd"]
    assert not steer.published("sb1", "10.12.0.3", 1) and list(steer.retired) == ["sb1_8080.1"]
    steer.admin.batches.clear()
    asyncio.run(steer._collect(now=time.monotonic() + 1))  # the second look found no connection either
    assert flat(steer.admin) == ["show fd", "del server guest/sb1_8080.1"] and steer.retired == {}


def test_a_moved_sandbox_loses_its_ports_until_asked_again():
    steer, state = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}])
    asyncio.run(steer.sync())
    asyncio.run(steer.ensure_port("sb1", "10.12.0.3", 1, 8080))
    steer.admin.batches.clear()
    state["now"] = {"sb1": Entry("10.12.0.9", "", 2)}
    asyncio.run(steer.sync())
    assert flat(steer.admin) == ["del map /maps/ports.map sb1_8080", "set server guest/sb1_8080.1 state maint",
                                 "shutdown sessions server guest/sb1_8080.1", "show fd"]
    assert steer.published("sb1", "10.12.0.9", 2) and not steer.published("sb1", "10.12.0.9", 2, port=8080)
    # back at once, under a new server's name: the old one waits for its connections
    steer.admin.batches.clear()
    assert asyncio.run(steer.ensure_port("sb1", "10.12.0.9", 2, 8080)) is True
    assert flat(steer.admin)[0].startswith("add server guest/sb1_8080.2 10.12.0.9:8080 ")
    assert steer.published("sb1", "10.12.0.9", 2, port=8080) and "sb1_8080.1" in steer.retired


FD_LINE = ("  12 : st=0x010121(cL heopI W:sRa R:srA) ref=0 gid=1 tmask=0x1 owner=0x5 iocb=0x5(sock_conn_iocb) "
           "back=1 cflg=0x50000300 cerr=0 fam=ipv4 lport=51088 rport=8080 sv=guest/{name} mux=H1 ctx=0x5 xprt=RAW\n")


def test_a_retired_server_is_deleted_only_once_no_connection_leads_to_it():
    steer, state = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}])
    asyncio.run(steer.sync())
    asyncio.run(steer.ensure_port("sb1", "10.12.0.3", 1, 8080))
    steer.admin.fds = FD_LINE.format(name="sb1_8080.1") + FD_LINE.format(name="other.7")
    state["now"] = {}
    asyncio.run(steer.sync())
    t = time.monotonic()
    for n in range(1, 5):  # a client's session holds an idle connection to it: kept
        asyncio.run(steer._collect(now=t + n))
    assert "del server guest/sb1_8080.1" not in flat(steer.admin) and steer.retired["sb1_8080.1"].maint
    assert flat(steer.admin).count("set server guest/sb1_8080.1 state maint") == 1
    steer.admin.fds = FD_LINE.format(name="other.7")  # the session ended
    steer.admin.batches.clear()
    asyncio.run(steer._collect(now=t + 5))
    asyncio.run(steer._collect(now=t + 5.1))  # too soon for another look
    assert flat(steer.admin) == ["show fd"]
    asyncio.run(steer._collect(now=t + 6))
    assert flat(steer.admin) == ["show fd", "show fd", "del server guest/sb1_8080.1"] and steer.retired == {}


def test_a_refused_deletion_is_tried_again_and_a_vanished_server_forgotten():
    class Busy(Recorder):
        busy = True

        async def run(self, *commands, check=True):
            answer = await super().run(*commands, check=check)
            if commands[0].startswith("del server") and self.busy:
                raise AdminError("Server still has connections attached to it, cannot remove it.")
            if commands[0].startswith("set server") and "gone" in commands[0]:
                raise AdminError("No such server.")
            return answer

    steer, state = steer_with([{"sb1": Entry("10.12.0.3", "", 1)}], admin=Busy())
    asyncio.run(steer.sync())
    asyncio.run(steer.ensure_port("sb1", "10.12.0.3", 1, 8080))
    state["now"] = {}
    asyncio.run(steer.sync())
    t = time.monotonic()
    asyncio.run(steer._collect(now=t + 1))
    assert "sb1_8080.1" in steer.retired  # HAProxy still had a pooled one
    steer.admin.busy = False
    asyncio.run(steer._collect(now=t + 2))
    assert steer.retired == {}
    from dataplane.steer import Retired
    steer.retired["gone.3"] = Retired()
    asyncio.run(steer._collect(now=t + 3))
    assert steer.retired == {}


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

    wanted = ["clear map /maps/ports.map", "clear map /maps/tokens.map"]

    async def one_round():
        task = asyncio.ensure_future(steer.run())
        deadline = asyncio.get_running_loop().time() + 30  # a round, however slow the host
        while wanted not in steer.admin.batches and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(one_round())
    assert wanted in steer.admin.batches
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
