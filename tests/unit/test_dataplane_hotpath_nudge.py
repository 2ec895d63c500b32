"""A state write nudges the hot path's steering (``sandboxes.route_nudge`` → ``dataplane.steer``):
the routable sandboxes are read again at once, not at the next poll; without a listener the
write goes on as before."""
import asyncio

from dataplane.steer import Steer
from sandboxes import route_nudge
from tests.unit.test_dataplane_steer import Recorder


def test_a_nudge_brings_the_next_read_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    run_dir = tmp_path / "dataplane-hotpath-test"
    run_dir.mkdir()
    reads = []

    async def read():
        reads.append(asyncio.get_running_loop().time())
        return {}

    async def scenario():
        steer = Steer(Recorder(), str(run_dir), interval=3600, read=read)  # the poll never comes
        task = asyncio.ensure_future(steer.run())
        try:
            for _ in range(200):  # the first round, and the socket bound
                if reads and route_nudge.sockets():
                    break
                await asyncio.sleep(0.05)
            assert len(reads) == 1 and route_nudge.sockets() == [steer.nudge_path]
            for n in (2, 3):
                route_nudge.nudge("sb1")
                for _ in range(200):
                    if len(reads) == n:
                        break
                    await asyncio.sleep(0.05)
                assert len(reads) == n
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert route_nudge.sockets() == []  # removed when the steering stops

    asyncio.run(scenario())


def test_a_nudge_with_no_data_plane_listening_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    route_nudge.nudge("sb1")  # no run directory
    stale = tmp_path / "dataplane-hotpath-gone"
    stale.mkdir()
    (stale / route_nudge.SOCKET_NAME).write_text("")  # not a socket (a dead launcher's leftover)
    route_nudge.nudge("sb1")
