"""envd_client takes no more from a guest than envd_client.limits allows (issue 21 item 2):
a call's timeout is its total deadline (a guest dripping headers or body a byte at a time
does not hold a node thread), an answer is read up to its cap (EnvdAnswerTooLarge), an
error answer is read up to ERROR_BYTES, a command's kept output is capped, and a
malformed answer is an EnvdError, never a TypeError or an OverflowError in the caller.
Against a hostile envd on loopback (tests/hostile_envd.py): real sockets, so the
blocking client's deadline transport is what is tested."""
from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
import pytest

from envd.wire import FLAG_END_STREAM, encode_json, envelope
from envd_client import AsyncEnvdClient, EnvdAnswerTooLarge, EnvdClient, EnvdError, EnvdUnavailable, limits
from tests.hostile_envd import HostileEnvd


def bounded(fn, limit: float):
    """(result or exception, seconds) of fn() in a thread; fails if it outlives ``limit``."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["value"] = exc
    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"the call still waits on the guest after {limit} s"
    return out["value"], time.monotonic() - started


@pytest.mark.parametrize("mode", ["drip", "drip_headers"])
def test_sync_call_ends_at_its_total_deadline_whatever_the_guest_drips(mode):
    with HostileEnvd(mode, interval=0.1) as guest, EnvdClient.at(guest.host, guest.port) as envd:
        result, took = bounded(lambda: envd.metrics(timeout=1.0), 5)
        assert isinstance(result, EnvdUnavailable), result
        assert took < 1.6, took
        result, took = bounded(lambda: envd.init({}, timeout=1.0), 5)
        assert isinstance(result, EnvdUnavailable) and took < 1.6, (result, took)


@pytest.mark.parametrize("mode", ["drip", "drip_headers"])
def test_async_call_ends_at_its_total_deadline(mode):
    async def ask(guest):
        async with AsyncEnvdClient.at(guest.host, guest.port) as envd:
            return await envd.metrics(timeout=1.0)

    with HostileEnvd(mode, interval=0.1) as guest:
        result, took = bounded(lambda: asyncio.run(ask(guest)), 5)
    assert isinstance(result, EnvdUnavailable), result
    assert took < 1.6, took


def test_an_endless_answer_stops_at_the_cap():
    with HostileEnvd("endless") as guest, EnvdClient.at(guest.host, guest.port) as envd:
        result, _ = bounded(lambda: envd.metrics(timeout=5.0), 8)
        assert isinstance(result, EnvdAnswerTooLarge) and result.code == "resource_exhausted", result
        assert "the guest sent too much" in str(result) and str(limits.METRICS_BYTES) in str(result)
        result, _ = bounded(lambda: envd.list(), 15)
        assert isinstance(result, EnvdAnswerTooLarge), result


def test_an_endless_error_answer_is_read_up_to_its_cap():
    def endless():
        while True:
            yield b"x" * 65536

    transport = httpx.MockTransport(lambda r: httpx.Response(500, stream=_Iter(endless())))
    with EnvdClient("http://envd", transport=transport) as envd:
        result, _ = bounded(envd.list, 5)
    assert isinstance(result, EnvdError) and result.status == 500, result


class _Iter(httpx.SyncByteStream):
    def __init__(self, it):
        self._it = it

    def __iter__(self):
        return self._it


def frames(*messages, end=True) -> bytes:
    out = b"".join(envelope(encode_json(m)) for m in messages)
    return out + (envelope(b"{}", FLAG_END_STREAM) if end else b"")


def test_run_keeps_the_first_output_bytes_and_passes_all_to_the_callback():
    chunk = b"y" * 32768
    count = limits.RUN_OUTPUT_BYTES // len(chunk) + 8
    data = {"event": {"data": {"stdout": base64.b64encode(chunk).decode()}}}

    def stream():
        yield frames({"event": {"start": {"pid": 7}}}, end=False)
        for _ in range(count):
            yield envelope(encode_json(data))
        yield frames({"event": {"end": {"exitCode": 0, "exited": True}}})

    seen = []
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=_Iter(stream())))
    with EnvdClient("http://envd", transport=transport) as envd:
        result = envd.run_argv("yes", on_stdout=lambda b: seen.append(len(b)))
    assert result.ok and result.truncated
    assert len(result.stdout) == limits.RUN_OUTPUT_BYTES
    assert sum(seen) == count * len(chunk)


def test_run_ends_after_its_deadline_even_if_the_guest_keeps_the_stream_open(monkeypatch):
    monkeypatch.setattr(limits, "RUN_DEADLINE_GRACE", 0.5)
    keepalive = envelope(encode_json({"event": {"keepalive": {}}}))
    with HostileEnvd("repeat", body=keepalive, interval=0.1) as guest, EnvdClient.at(guest.host, guest.port) as envd:
        result, took = bounded(lambda: envd.run_argv("sleep", ["1000"], deadline=1.0), 6)
    assert isinstance(result, EnvdUnavailable), result
    assert took < 2.1, took


@pytest.mark.parametrize("message", [{"event": {"start": {"pid": "x"}}}, {"event": {"start": {"pid": 1e300}}},
                                     {"event": {"end": {"exitCode": [1]}}}, {"event": {"data": {"stdout": "!!"}}},
                                     {"event": "start"}, [1, 2]])
def test_a_malformed_event_is_an_envd_error(message):
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=_Iter(iter([frames(message)]))))
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdError):
        envd.run_argv("true")


@pytest.mark.parametrize("answer", [b"[]", b'{"entries": 5}', b'{"entries": [{"path": "/a", "size": "big"}]}',
                                    b'{"entries": [{"path": "/a", "mode": 1e999}]}'])
def test_a_malformed_listing_is_an_envd_error(answer):
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=answer))
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdError):
        envd.list_dir("/")


@pytest.mark.parametrize("answer", [b"[]", b'{"processes": [{"pid": "x"}]}', b'{"processes": 3}'])
def test_a_malformed_process_list_is_an_envd_error(answer):
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=answer))
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdError):
        envd.list()


def test_an_enclosing_deadline_holds_for_every_call_inside():
    from envd_client import deadline  # noqa: PLC0415

    with HostileEnvd("drip", interval=0.1) as guest, EnvdClient.at(guest.host, guest.port) as envd:
        def two_calls():
            with deadline.within(1.0):
                return envd.sync(timeout=60)
        result, took = bounded(two_calls, 5)
    assert isinstance(result, EnvdUnavailable) and took < 1.6, (result, took)
