"""envd re-exposes services listening only on loopback (envd/port_forward.py).

On the host there is no guest eth0, so the forwarder is given a loopback alias to listen on:
Linux routes all of 127.0.0.0/8 to lo, so ``127.0.0.2:<port>`` stands in for
``169.254.0.21:<port>`` and the services under test listen on 127.0.0.1 / ::1.
"""
import asyncio
import hashlib
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from envd import ENVD_PORT
from envd import port_forward as pf
from envd.server import _port_forwarder, parse_args
from tests.envd.conftest import EnvdServer
from harness.ports import free_port as _free_port

ALIAS = "127.0.0.2"  # the in-process forwarder's "eth0 address"
ENVD_ALIAS = "127.0.0.3"  # the envd subprocess's

# Every forwarder here mirrors all of the host's loopback listeners onto the same aliases: two
# at once (pytest-xdist workers) would take each other's ports, so the module runs on one worker.
pytestmark = pytest.mark.xdist_group("loopback-aliases")

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
HEADER6 = ("  sl  local_address                         remote_address                        st tx_queue "
           "rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
TAIL = " 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0"


def line(n, local, remote, state, inode):
    return f"  {n:>2}: {local} {remote} {state}" + TAIL.format(inode=inode)


V4 = HEADER + "\n".join([
    line(0, "0100007F:1F90", "00000000:0000", "0A", 1001),  # 127.0.0.1:8080 LISTEN
    line(1, "0500007F:0BB8", "00000000:0000", "0A", 1002),  # 127.0.0.5:3000 LISTEN
    line(2, "00000000:0050", "00000000:0000", "0A", 1003),  # 0.0.0.0:80 LISTEN
    line(3, "1500FEA9:1F91", "00000000:0000", "0A", 1004),  # 169.254.0.21:8081 LISTEN
    line(4, "0100007F:1F90", "0100007F:D2F0", "01", 1005),  # 127.0.0.1:8080 <- :54000 ESTABLISHED
    line(5, "0100007F:2328", "0100007F:D2F1", "06", 0),  # 127.0.0.1:9000 TIME_WAIT
    line(6, "0100007F:C343", "00000000:0000", "0A", 1006),  # 127.0.0.1:49987 LISTEN
]) + "\n"

V6 = HEADER6 + "\n".join([
    line(0, "00000000000000000000000001000000:22B8", "00000000000000000000000000000000:0000", "0A", 2001),  # [::1]:8888
    line(1, "0000000000000000FFFF00000100007F:1F92", "00000000000000000000000000000000:0000", "0A", 2002),  # [::ffff:127.0.0.1]:8082
    line(2, "00000000000000000000000000000000:0050", "00000000000000000000000000000000:0000", "0A", 2003),  # [::]:80
    line(3, "00000000000000000000000001000000:0BB8", "00000000000000000000000000000000:0000", "0A", 2004),  # [::1]:3000
    line(4, "0000000000000000FFFF000000000000:1F93", "00000000000000000000000000000000:0000", "0A", 2005),  # [::ffff:0.0.0.0]:8083
    line(5, "000080FE00000000000000000100000A:1F94", "00000000000000000000000000000000:0000", "0A", 2006),  # [fe80::a00:1]:8084
    line(6, "00000000000000000000000001000000:1F95", "00000000000000000000000001000000:D2F2", "01", 2007),  # [::1]:8085 ESTABLISHED
    line(7, "0000000000000000FFFF00001500FEA9:22B8", "00000000000000000000000000000000:0000", "0A", 2008),  # [::ffff:169.254.0.21]:8888
]) + "\n"


# -- parsing --------------------------------------------------------------------------------------

def test_parse_address_ipv4_ipv6_mapped():
    assert pf.parse_address("0100007F:1F90") == (bytes([127, 0, 0, 1]), 8080)
    assert pf.parse_address("1500FEA9:0050") == (bytes([169, 254, 0, 21]), 80)
    assert pf.parse_address("00000000000000000000000001000000:22B8") == (b"\0" * 15 + b"\1", 8888)
    packed, port = pf.parse_address("0000000000000000FFFF00000100007F:1F92")
    assert socket.inet_ntop(socket.AF_INET6, packed) == "::ffff:127.0.0.1" and port == 8082
    for bad in ("", "0100007F", "100007F:1F90", "0100007F:", "XYZ0007F:1F90"):
        with pytest.raises(ValueError):
            pf.parse_address(bad)


def test_parse_proc_net_tcp_v4():
    socks = pf.parse_proc_net_tcp(V4)
    assert [(s.address, s.port, s.state, s.inode) for s in socks] == [
        ("127.0.0.1", 8080, 0x0A, 1001),
        ("127.0.0.5", 3000, 0x0A, 1002),
        ("0.0.0.0", 80, 0x0A, 1003),
        ("169.254.0.21", 8081, 0x0A, 1004),
        ("127.0.0.1", 8080, 0x01, 1005),
        ("127.0.0.1", 9000, 0x06, 0),
        ("127.0.0.1", 49987, 0x0A, 1006),
    ]
    listening = pf.parse_proc_net_tcp(V4, pf.TCP_LISTEN)
    assert [s.inode for s in listening] == [1001, 1002, 1003, 1004, 1006]


def test_parse_proc_net_tcp_v6_and_mapped():
    socks = pf.parse_proc_net_tcp(V6, pf.TCP_LISTEN)
    assert [(s.address, s.port) for s in socks] == [
        ("::1", 8888), ("::ffff:127.0.0.1", 8082), ("::", 80), ("::1", 3000),
        ("::ffff:0.0.0.0", 8083), ("fe80::a00:1", 8084), ("::ffff:169.254.0.21", 8888),
    ]
    assert all(len(s.packed) == 16 for s in socks)


def test_parse_skips_header_and_garbage():
    text = HEADER + "garbage\n   x: 0100007F:1F90 00000000:0000 0A\n" + \
        line(0, "0100007F:ZZZZ", "00000000:0000", "0A", 1) + "\n" + line(1, "0100007F:0016", "00000000:0000", "0A", 7)
    assert [(s.address, s.port) for s in pf.parse_proc_net_tcp(text)] == [("127.0.0.1", 22)]
    assert pf.parse_proc_net_tcp("") == []


def test_address_classes():
    lo4, lo4b = socket.inet_aton("127.0.0.1"), socket.inet_aton("127.9.8.7")
    lo6 = socket.inet_pton(socket.AF_INET6, "::1")
    mapped = socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1")
    any4, any6 = bytes(4), bytes(16)
    any_mapped = socket.inet_pton(socket.AF_INET6, "::ffff:0.0.0.0")
    eth = socket.inet_aton("169.254.0.21")
    for a in (lo4, lo4b, lo6, mapped):
        assert pf.is_loopback(a) and not pf.is_wildcard(a)
    for a in (any4, any6, any_mapped):
        assert pf.is_wildcard(a) and not pf.is_loopback(a)
    assert not pf.is_loopback(eth) and not pf.is_wildcard(eth)
    assert not pf.is_loopback(socket.inet_pton(socket.AF_INET6, "::2"))
    assert pf.connect_host(mapped) == "127.0.0.1" and pf.connect_host(lo6) == "::1"


def test_plan():
    socks = pf.parse_proc_net_tcp(V4, pf.TCP_LISTEN) + pf.parse_proc_net_tcp(V6, pf.TCP_LISTEN)
    # 8080: 127.0.0.1 only. 3000: 127.0.0.5 and ::1 -> IPv4 preferred. 8082: mapped loopback.
    # 8888: ::1, but also listening on the eth0 address (mapped) -> reachable already.
    # 80, 8083: wildcard. 8081: eth0 address only. 8084: link-local only. 8085, 9000: not LISTEN.
    assert pf.plan(socks, "169.254.0.21") == {8080: "127.0.0.1", 3000: "127.0.0.5", 8082: "127.0.0.1",
                                             49987: "127.0.0.1"}
    # Another listen address: 8888 is loopback-only there.
    assert pf.plan(socks, "10.0.2.15")[8888] == "::1"
    assert 49987 not in pf.plan(socks, "169.254.0.21", skip_ports={49987})


def test_plan_loopback_plus_wildcard_on_one_port():
    text = HEADER + "\n".join([
        line(0, "0100007F:1F90", "00000000:0000", "0A", 1),  # 127.0.0.1:8080
        line(1, "00000000:1F90", "00000000:0000", "0A", 2),  # 0.0.0.0:8080
        line(2, "0100007F:1F91", "00000000:0000", "0A", 3),  # 127.0.0.1:8081
    ]) + "\n"
    text6 = HEADER6 + line(0, "00000000000000000000000000000000:1F91",
                           "00000000000000000000000000000000:0000", "0A", 4) + "\n"  # [::]:8081
    socks = pf.parse_proc_net_tcp(text, pf.TCP_LISTEN) + pf.parse_proc_net_tcp(text6, pf.TCP_LISTEN)
    assert pf.plan(socks, "169.254.0.21") == {}


def test_plan_ignores_the_forwarders_own_sockets():
    # The forwarder listening on 127.0.0.2:8080 (its own inode 9) is neither a loopback
    # listener to forward nor a sign that 8080 is reachable already.
    text = HEADER + "\n".join([
        line(0, "0100007F:1F90", "00000000:0000", "0A", 1),  # 127.0.0.1:8080 (the service)
        line(1, "0200007F:1F90", "00000000:0000", "0A", 9),  # 127.0.0.2:8080 (the forwarder)
    ]) + "\n"
    socks = pf.parse_proc_net_tcp(text)
    assert pf.plan(socks, "127.0.0.2", own_inodes={9}) == {8080: "127.0.0.1"}
    # Someone else's listener on the listen address: the port is reachable already.
    assert pf.plan(socks, "127.0.0.2") == {}


def test_plan_skips_envd_port():
    text = HEADER + line(0, f"0100007F:{ENVD_PORT:04X}", "00000000:0000", "0A", 1) + "\n"
    socks = pf.parse_proc_net_tcp(text)
    assert pf.plan(socks, "169.254.0.21") == {ENVD_PORT: "127.0.0.1"}  # the plan alone does not know envd
    assert ENVD_PORT in pf.PortForwarder().skip_ports
    assert pf.PortForwarder(skip_ports={5}).skip_ports == {5, ENVD_PORT}


def test_read_listeners_sees_a_real_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port, inode = s.getsockname()[1], os.fstat(s.fileno()).st_ino
        found = [x for x in pf.read_listeners() if x.inode == inode]
        assert [(x.address, x.port, x.state) for x in found] == [("127.0.0.1", port, pf.TCP_LISTEN)]
    assert not [x for x in pf.read_listeners() if x.inode == inode]


def test_interface_address():
    assert pf.interface_ipv4("lo") == "127.0.0.1"
    assert pf.interface_ipv4("aenv-none0") is None
    assert pf.interface_ipv4("x" * 40) is None
    assert pf.interface_ipv4("") is None


def test_interface_from_env(monkeypatch):
    monkeypatch.setenv(pf.INTERFACE_ENV, "ens3")
    assert pf.PortForwarder().interface == "ens3"
    monkeypatch.delenv(pf.INTERFACE_ENV)
    assert pf.PortForwarder().interface == "eth0"
    assert pf.PortForwarder(interface="lo").interface == "lo"


def test_bad_arguments():
    with pytest.raises(OSError):
        pf.PortForwarder(listen_address="::1")
    with pytest.raises(ValueError):
        pf.PortForwarder(interval=0)


def test_cli_enables_forwarding_in_the_guest_only():
    assert _port_forwarder(parse_args(["--host", "127.0.0.1"])) is None  # envd on a host (tests)
    guest = _port_forwarder(parse_args(["--host", "0.0.0.0", "--port", "49983"]))
    assert isinstance(guest, pf.PortForwarder) and guest.interval == 1.0 and ENVD_PORT in guest.skip_ports
    assert _port_forwarder(parse_args(["--host", "0.0.0.0", "--forward-loopback", "never"])) is None
    fixed = _port_forwarder(parse_args(["--host", "127.0.0.1", "--port", "1234", "--forward-address",
                                        ALIAS, "--forward-interval", "0.5"]))
    assert fixed.interval == 0.5 and {1234, ENVD_PORT} <= fixed.skip_ports
    assert _port_forwarder(parse_args(["--host", "127.0.0.1", "--forward-loopback", "always"])) is not None
    with pytest.raises(SystemExit):
        parse_args(["--forward-address", "not-an-ip"])
    with pytest.raises(SystemExit):
        parse_args(["--forward-interval", "0"])


# -- relaying (in process) ----------------------------------------------------------------------


async def _eventually(check, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _refused(host, port):
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except ConnectionRefusedError:
        return True
    w.close()
    return False


async def _echo(reader, writer):
    """Echoes everything, passes the client's FIN back once all is sent, then closes."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
    finally:
        writer.close()


async def _roundtrip(host, port, payload):
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)

    async def send():
        writer.write(payload)
        await writer.drain()
        writer.write_eof()  # half-close: the reply still has to come back

    sender = asyncio.create_task(send())
    received = await asyncio.wait_for(reader.read(), 30)
    await sender
    writer.close()
    return received


@pytest.fixture
async def forwarder():
    fwd = pf.PortForwarder(listen_address=ALIAS, interval=0.1)
    yield fwd
    fwd.close()


async def test_forwards_a_loopback_service_and_stops_with_it(forwarder):
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    forwarder.start()

    async def reachable():
        try:
            return await _roundtrip(ALIAS, port, b"ping") == b"ping"
        except OSError:
            return False

    await _eventually(reachable, what=f"{ALIAS}:{port} to reach the service")
    assert forwarder.forwards.get(port) == "127.0.0.1" and forwarder.address == ALIAS
    # Big transfer both ways at once (flow control), half-closed by the client.
    payload = os.urandom(8 << 20)
    got = await _roundtrip(ALIAS, port, payload)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()

    server.close()
    await server.wait_closed()

    async def gone():
        return port not in forwarder.forwards and await _refused(ALIAS, port)

    await _eventually(gone, what="the forwarded listener to go away")
    await _eventually(lambda: _zero(forwarder), what="relayed connections to be released")


async def _zero(fwd):
    return fwd.active_connections == 0


async def test_ipv6_loopback_service():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    port = _free_port()
    try:
        server = await asyncio.start_server(_echo, "::1", port)
    except OSError as exc:
        pytest.skip(f"cannot listen on [::1]: {exc}")
    fwd = pf.PortForwarder(listen_address=ALIAS)
    try:
        await fwd.scan_once()
        assert fwd.forwards.get(port) == "::1"
        assert await _roundtrip(ALIAS, port, b"over v6") == b"over v6"
    finally:
        fwd.close()
        server.close()


async def test_wildcard_and_envd_ports_get_no_forwarder():
    # Control: a loopback-only service is forwarded by the same scan.
    control_port = _free_port()
    control = await asyncio.start_server(_echo, "127.0.0.1", control_port)
    # Listening on 0.0.0.0 only.
    wild_port = _free_port()
    wild = await asyncio.start_server(_echo, "0.0.0.0", wild_port)
    # Listening on 127.0.0.1 and on [::] (IPv6 only): reachable already, nothing to forward.
    both_port = _free_port()
    both = await asyncio.start_server(_echo, "127.0.0.1", both_port)
    six = None
    if socket.has_ipv6:
        try:
            six = await asyncio.start_server(_echo, "::", both_port)  # asyncio sets IPV6_V6ONLY
        except OSError:
            six = None
    # envd's own port (as envd passes it) on loopback.
    envd_port = _free_port()
    envd_like = await asyncio.start_server(_echo, "127.0.0.1", envd_port)
    fwd = pf.PortForwarder(listen_address=ALIAS, skip_ports={envd_port})
    try:
        for _ in range(3):
            await fwd.scan_once()
        assert fwd.forwards.get(control_port) == "127.0.0.1"
        assert wild_port not in fwd.forwards and envd_port not in fwd.forwards
        assert await _refused(ALIAS, envd_port)
        if six is not None:
            assert both_port not in fwd.forwards
            assert await _refused(ALIAS, both_port)
    finally:
        fwd.close()
        for s in (control, wild, both, six, envd_like):
            if s is not None:
                s.close()


async def test_existing_connections_outlive_the_forwarder():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    fwd = pf.PortForwarder(listen_address=ALIAS)
    try:
        await fwd.scan_once()
        reader, writer = await asyncio.open_connection(ALIAS, port)
        writer.write(b"one")
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"one"
        server.close()  # the listening socket only: the accepted connection stays (Python 3.11)
        await fwd.scan_once()
        assert port not in fwd.forwards and await _refused(ALIAS, port)
        writer.write(b"two")
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"two"
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await _eventually(lambda: _zero(fwd), what="the relay to be released")
    finally:
        fwd.close()
        server.close()


async def test_connection_limit_and_close():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    fwd = pf.PortForwarder(listen_address=ALIAS, max_connections=2)
    conns = []
    try:
        await fwd.scan_once()
        for _ in range(2):
            reader, writer = await asyncio.open_connection(ALIAS, port)
            writer.write(b"x")
            assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
            conns.append((reader, writer))
        assert fwd.active_connections == 2
        # The third is accepted by the kernel and dropped at once.
        reader, writer = await asyncio.open_connection(ALIAS, port)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass
        writer.close()
        assert fwd.active_connections == 2
        # Stopping aborts the relays.
        fwd.close()
        for reader, _ in conns:
            try:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            except ConnectionResetError:
                pass
        assert fwd.active_connections == 0 and fwd.forwards == {}
        assert await _refused(ALIAS, port)
    finally:
        fwd.close()
        for _, writer in conns:
            writer.close()
        server.close()


async def test_service_refusing_closes_the_client():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    fwd = pf.PortForwarder(listen_address=ALIAS)
    try:
        await fwd.scan_once()
        server.close()
        await server.wait_closed()
        # Between the service going and the next scan, a client is accepted and dropped.
        reader, writer = await asyncio.open_connection(ALIAS, port)
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        writer.close()
        await _eventually(lambda: _zero(fwd), what="the relay to be released")
    finally:
        fwd.close()


async def test_idles_without_an_interface_address():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    fwd = pf.PortForwarder(interface="aenv-none0")
    try:
        await fwd.scan_once()
        assert fwd.address is None and fwd.forwards == {}
    finally:
        fwd.close()
        server.close()


async def test_scan_errors_do_not_stop_the_scanner(tmp_path, caplog):
    # A directory where /proc/net/tcp should be: every scan fails, the loop carries on.
    fwd = pf.PortForwarder(listen_address=ALIAS, interval=0.05, proc_files=(str(tmp_path),))
    fwd.start()
    try:
        await asyncio.sleep(0.5)
        assert fwd._task is not None and not fwd._task.done()
        errors = [r for r in caplog.records if r.name == "envd.port_forward" and "scan failed" in r.getMessage()]
        assert len(errors) == 1  # the same error is logged once, not every scan
    finally:
        fwd.close()


async def test_bind_failure_is_retried_later(caplog):
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    blocker = socket.socket()
    blocker.bind((ALIAS, port))  # bound, not listening: the forwarder cannot bind, nor is it "exposed"
    fwd = pf.PortForwarder(listen_address=ALIAS)
    try:
        await fwd.scan_once()
        await fwd.scan_once()
        assert port not in fwd.forwards
        warnings = [r for r in caplog.records if r.name == "envd.port_forward" and "cannot forward" in r.getMessage()]
        assert len(warnings) == 1
        blocker.close()
        fwd._failed[port] = 0.0  # skip the retry delay
        await fwd.scan_once()
        assert fwd.forwards.get(port) == "127.0.0.1"
    finally:
        blocker.close()
        fwd.close()
        server.close()


# -- through a real envd -----------------------------------------------------------------------

class _Hello(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from loopback"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _wait(check, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _refused_sync(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _get(url):
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def test_envd_reexposes_a_loopback_http_server():
    envd = EnvdServer("--forward-address", ENVD_ALIAS, "--forward-interval", "0.2")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://{ENVD_ALIAS}:{port}/"
        _wait(lambda: (r := _get(url)) is not None and r.text == "hello from loopback",
              what=f"envd to forward {url}")
        # envd itself (127.0.0.1:<its port>) is not re-exposed.
        assert _refused_sync(ENVD_ALIAS, envd.port)
        assert httpx.get(envd.url + "/health").status_code == 204
        httpd.shutdown()
        httpd.server_close()
        _wait(lambda: _refused_sync(ENVD_ALIAS, port), what="the forward to go away with the service")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
    finally:
        httpd.shutdown()
        httpd.server_close()
        envd.stop()
