"""RouteTable's shared lookups: concurrent asks share queries, and no answer is older
than its ask (a query already running when a request asks is never joined)."""
import asyncio

import pytest

from dataplane.routes import Route, RouteTable


def _route(sandbox_id: str, generation: int) -> Route:
    return Route(sandbox_id, "running", "127.0.0.1", 1, False, "", generation=generation)


class GatedTable(RouteTable):
    """The database is ``db``; each query waits for ``gate`` and is recorded in ``queries``."""

    def __init__(self):
        super().__init__()
        self.db: dict[str, Route] = {}
        self.queries: list[list[str]] = []
        self.gate = asyncio.Event()
        self.fail = None

    async def get_many(self, sandbox_ids):
        snapshot = dict(self.db)  # what the query reads: the database as the query starts
        self.queries.append(sorted(sandbox_ids))
        await self.gate.wait()
        if self.fail:
            raise self.fail
        return {i: snapshot[i] for i in sandbox_ids if i in snapshot}


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_asks_during_a_query_wait_for_the_next_one_and_share_it():
    table = GatedTable()
    table.db["a"] = _route("a", 1)
    first = asyncio.ensure_future(table.get("a"))
    await _settle()
    assert table.queries == [["a"]]
    table.db["a"] = _route("a", 2)  # e.g. resumed onto a new VM while the first query runs
    later = [asyncio.ensure_future(table.get(i)) for i in ("a", "a", "b", "a")]
    await _settle()
    assert table.queries == [["a"]]  # nobody joined the running query
    table.gate.set()
    assert (await first).generation == 1
    answers = await asyncio.gather(*later)
    assert [r.generation if r else None for r in answers] == [2, 2, None, 2]
    assert table.queries == [["a"], ["a", "b"]]  # four asks, one query


async def test_a_failed_query_fails_its_askers_only():
    table = GatedTable()
    table.db["a"] = _route("a", 1)
    table.fail = RuntimeError("database down")
    asks = [asyncio.ensure_future(table.get("a")) for _ in range(3)]
    await _settle()
    table.gate.set()
    results = await asyncio.gather(*asks, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    table.fail = None
    assert (await table.get("a")).generation == 1


async def test_an_asker_that_goes_away_does_not_hold_up_the_others():
    table = GatedTable()
    table.db["a"] = _route("a", 1)
    gone, stays = asyncio.ensure_future(table.get("a")), asyncio.ensure_future(table.get("a"))
    await _settle()
    gone.cancel()
    table.gate.set()
    assert (await stays).generation == 1
    with pytest.raises(asyncio.CancelledError):
        await gone


# ---- upstream lanes (dataplane.pools) ----------------------------------------------------------

async def test_each_client_connection_gets_its_own_lane_of_the_generations_pool(monkeypatch):
    from dataplane import pools  # noqa: PLC0415

    monkeypatch.setattr(pools, "MAX_LANES", 2)
    p = pools.UpstreamPools(1.0)
    async with p.use("s", (0,), ("10.0.0.1", 1)) as a1:
        pass
    async with p.use("s", (0,), ("10.0.0.1", 1)) as again, p.use("s", (0,), ("10.0.0.2", 2)) as b:
        assert again is a1 and b is not a1  # one lane per client connection
        # both lanes busy at the cap: a third client shares the least recently used one
        async with p.use("s", (0,), ("10.0.0.3", 3)) as c:
            assert c is a1
    # at the cap with idle lanes: the least recently used (10.0.0.2's: 10.0.0.1's lane was
    # just shared) is closed for the new one
    async with p.use("s", (0,), ("10.0.0.4", 4)) as d:
        assert d is not a1 and d is not b
    assert set(p._pools["s"].lanes) == {("10.0.0.1", 1), ("10.0.0.4", 4)}
    async with p.use("s", (1,), ("10.0.0.1", 1)) as newer:  # a new VM generation: all lanes go
        assert newer is not a1
    assert set(p._pools["s"].lanes) == {("10.0.0.1", 1)}
    await p.aclose()


async def test_a_quiet_data_plane_closes_its_idle_upstream_connections(monkeypatch):
    """With no request after the last, an idle lane's guest connection is still closed
    (a timer sweeps, not the next request): a killed guest sends no FIN, so a sweep that
    waited for traffic kept the descriptors of the last pools for ever."""
    import httpx  # noqa: PLC0415

    from dataplane import pools  # noqa: PLC0415

    monkeypatch.setattr(pools, "IDLE_SECONDS", 0.2)
    monkeypatch.setattr(pools, "SWEEP_SECONDS", 0.05)
    closed = asyncio.Event()

    async def guest(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # until the data plane's side closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(guest, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    p = pools.UpstreamPools(1.0)
    try:
        async with p.use("s", (0,), ("10.0.0.1", 1)) as upstream:
            response = await upstream.send(httpx.Request("GET", f"http://127.0.0.1:{port}/"))
            assert await response.aread() == b"ok"
            await response.aclose()
        await asyncio.wait_for(closed.wait(), 5)  # no further request: the timer closed it
        assert len(p) == 0
        await asyncio.sleep(0.15)
        assert p._sweeper.done()  # and the timer stops with the last pool
    finally:
        await p.aclose()
        server.close()
        await server.wait_closed()
