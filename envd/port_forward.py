"""Re-exposes services that listen only on loopback in the guest at the guest interface's address.

The node reaches any guest port at eth0's address (169.254.0.21, or 10.0.2.15 under slirp), but a
service bound to 127.0.0.1 or ::1 (a Jupyter or MCP server, ``http.server --bind 127.0.0.1``) is
unreachable from there. As E2B's envd does with socat, this module scans the kernel's TCP sockets
every second and, for each port that has a LISTEN socket on loopback and none on the wildcard or
on the interface address, relays ``<interface address>:<port>`` to the loopback address the service
listens on. The forwarder's listening socket is closed when the loopback listener goes away;
connections already relayed finish on their own.

The scan runs every ``interval`` (1 s) while the sandbox is in use, and every ``idle_interval``
(10 s) once nothing has happened for ``ACTIVE_FOR`` seconds: envd calls ``poke()`` on every
request that is someone's work (not /health or /metrics), and a scan that changed the forwards
counts too. A poke during an idle wait brings the next scan to one ``interval`` later. Why: each
scan wakes the guest and runs Python over /proc, which under TCG cost the host about as much
as the rest of an idle guest together (docs/benchmarks.md, "Idle guests"); a service started
while nobody talks to envd is forwarded within ``idle_interval``.

Only the standard library, nothing imported that envd does not already load: envd's start time
matters. Errors are logged and never escape into envd; ports and relayed connections are capped.
"""

import asyncio
import collections
import fcntl
import logging
import os
import socket
import struct
import time

from . import ENVD_PORT

log = logging.getLogger("envd.port_forward")

PROC_FILES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_LISTEN = 0x0A
SIOCGIFADDR = 0x8915
DEFAULT_INTERFACE = "eth0"
INTERFACE_ENV = "AENV_ENVD_FORWARD_IFACE"
DEFAULT_INTERVAL = 1.0
DEFAULT_IDLE_INTERVAL = 10.0
ACTIVE_FOR = 60.0  # seconds of fast scans after envd starts, a poke or a change
MAX_FORWARDS = 256  # forwarded ports at once
MAX_CONNECTIONS = 1024  # relayed connections at once, over all ports
CONNECT_TIMEOUT = 5.0  # to the loopback service
BIND_RETRY = 10.0  # seconds before binding a port that failed is tried again
CHUNK = 64 * 1024

_MAPPED_PREFIX = b"\0" * 10 + b"\xff\xff"  # ::ffff:a.b.c.d
_V6_LOOPBACK = b"\0" * 15 + b"\x01"

# One socket line of /proc/net/tcp{,6}. ``packed`` is the address in network byte order (4 or 16
# bytes); ``address`` is its text form ("127.0.0.1", "::1", "::ffff:127.0.0.1").
Socket = collections.namedtuple("Socket", "address port state inode packed")


# -- /proc/net/tcp ------------------------------------------------------------------------------

def parse_address(text):
    """``"0100007F:1F90"`` → ``(b"\\x7f\\0\\0\\x01", 8080)``.

    The kernel prints an address as 32-bit words, each in host byte order (little-endian on x86
    and arm64), and the port as a plain number. Raises ValueError on anything else."""
    host, sep, port = text.partition(":")
    if not sep or len(host) not in (8, 32) or not port:
        raise ValueError(f"bad socket address {text!r}")
    packed = b"".join(struct.pack("=I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
    return packed, int(port, 16)


def parse_proc_net_tcp(text, state=None):
    """The socket lines of a /proc/net/tcp or tcp6 file (only those in ``state`` if given, e.g.
    ``TCP_LISTEN``); the header and malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
        if len(fields) < 10 or not fields[0].endswith(":") or not fields[0][:-1].isdigit():
            continue
        try:
            st = int(fields[3], 16)
            if state is not None and st != state:
                continue
            packed, port = parse_address(fields[1])
            inode = int(fields[9])
        except ValueError:
            continue
        family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
        out.append(Socket(socket.inet_ntop(family, packed), port, st, inode, packed))
    return out


def _as_ipv4(packed):
    """The IPv4 address of an IPv4 or IPv4-mapped IPv6 address, else None."""
    if len(packed) == 4:
        return packed
    if packed[:12] == _MAPPED_PREFIX:
        return packed[12:]
    return None


def is_loopback(packed):
    """127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104."""
    v4 = _as_ipv4(packed)
    return v4[0] == 127 if v4 is not None else packed == _V6_LOOPBACK


def is_wildcard(packed):
    """0.0.0.0, :: and ::ffff:0.0.0.0: reachable from outside already."""
    v4 = _as_ipv4(packed)
    return v4 == b"\0\0\0\0" if v4 is not None else packed == bytes(16)


def connect_host(packed):
    """The host to dial for a loopback listener: mapped addresses are dialled over IPv4."""
    v4 = _as_ipv4(packed)
    if v4 is not None:
        return socket.inet_ntop(socket.AF_INET, v4)
    return socket.inet_ntop(socket.AF_INET6, packed)


def _target_rank(host):
    return (0 if host == "127.0.0.1" else 1 if ":" not in host else 2, host)


def plan(sockets, listen_address, skip_ports=(), own_inodes=()):
    """Which ports to forward: ``{port: loopback host to dial}``.

    A port qualifies when it has a LISTEN socket on loopback and none on the wildcard or on
    ``listen_address`` (the service is reachable from outside already), and is not in
    ``skip_ports``. Sockets whose inode is in ``own_inodes`` (the forwarder's) are ignored.
    With several loopback listeners on one port, 127.0.0.1 is preferred, then IPv4, then ::1."""
    listen_packed = socket.inet_aton(listen_address)
    exposed, targets = set(), {}
    for s in sockets:
        if s.state != TCP_LISTEN or s.inode in own_inodes:
            continue
        if is_wildcard(s.packed) or _as_ipv4(s.packed) == listen_packed:
            exposed.add(s.port)
        elif is_loopback(s.packed):
            targets.setdefault(s.port, set()).add(connect_host(s.packed))
    return {port: min(hosts, key=_target_rank) for port, hosts in targets.items()
            if port not in exposed and port not in skip_ports}


def read_listeners(paths=PROC_FILES):
    """LISTEN sockets of this network namespace; a missing file (no IPv6) counts as empty."""
    out = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                text = f.read().decode("ascii", "replace")
        except FileNotFoundError:
            continue
        out.extend(parse_proc_net_tcp(text, TCP_LISTEN))
    return out


def interface_ipv4(name):
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), or None (no such device, no address)."""
    encoded = name.encode()
    if not encoded or len(encoded) > 15:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            # struct ifreq: 16-byte name, then the sockaddr_in (family, port, address at offset 20).
            reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("16s24x", encoded))
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


# -- the forwarder --------------------------------------------------------------------------------

class _Forward:
    """One forwarded port: its listening server and the loopback host it relays to."""

    __slots__ = ("port", "target", "server", "inode")

    def __init__(self, port, target, inode):
        self.port = port
        self.target = target
        self.server = None
        self.inode = inode


class PortForwarder:
    """Scans for loopback-only listeners every ``interval`` seconds and relays them.

    ``listen_address`` fixes the IPv4 address to listen on (tests); without it the address of
    ``interface`` (env ``AENV_ENVD_FORWARD_IFACE``, default eth0) is read at every scan, and the
    forwarder idles while there is none. ``skip_ports`` always includes envd's port."""

    def __init__(self, *, listen_address=None, interface=None, interval=DEFAULT_INTERVAL,
                 idle_interval=DEFAULT_IDLE_INTERVAL, active_for=ACTIVE_FOR, skip_ports=(),
                 max_forwards=MAX_FORWARDS, max_connections=MAX_CONNECTIONS, proc_files=PROC_FILES):
        if listen_address is not None:
            socket.inet_aton(listen_address)  # OSError unless an IPv4 address
        if not interval > 0:
            raise ValueError("interval must be positive")
        if not idle_interval >= interval:
            raise ValueError("idle_interval must be at least interval")
        self.interface = interface or os.environ.get(INTERFACE_ENV) or DEFAULT_INTERFACE
        self.interval = float(interval)
        self.idle_interval = float(idle_interval)
        self.active_for = float(active_for)
        self._active_until = time.monotonic() + self.active_for
        self._idle_wait = None  # the future an idle wait sleeps on (a poke resolves it)
        self.skip_ports = frozenset(skip_ports) | {ENVD_PORT}
        self.max_forwards = max_forwards
        self.max_connections = max_connections
        self._fixed_address = listen_address
        self._proc_files = proc_files
        self._address = None  # the address the current forwards listen on
        self._forwards = {}  # port -> _Forward
        self._failed = {}  # port -> monotonic time before which binding it is not retried
        self._relays = set()  # _Relay of every open relayed connection
        self._task = None
        self._last_error = None
        self._warned_forward_limit = False
        self._warned_connection_limit = None

    # -- lifecycle -----------------------------------------------------------------
    def start(self):
        """Starts scanning on the running loop (idempotent). The first scan runs one period later,
        once envd is listening, so the forwarder adds nothing to envd's start."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="envd-port-forward")

    def close(self):
        """Stops scanning, closes every forwarded listener and aborts the relayed connections."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._close_all("envd is stopping")
        for relay in list(self._relays):
            relay.abort()
        self._relays.clear()

    def poke(self):
        """Someone is using the sandbox: scan every ``interval`` for the next ``active_for``
        seconds (the next scan one ``interval`` from now if an idle wait was running)."""
        self._active_until = time.monotonic() + self.active_for
        wait, self._idle_wait = self._idle_wait, None
        if wait is not None and not wait.done():
            wait.set_result(None)

    @property
    def active(self):
        """True while scans run every ``interval`` (else every ``idle_interval``)."""
        return time.monotonic() < self._active_until

    async def _pause(self):
        """Waits until the next scan is due: ``interval`` while active, else ``idle_interval``
        cut short by a poke (then one ``interval`` more, as if the sandbox had been active)."""
        if self.active:
            await asyncio.sleep(self.interval)
            return
        loop = asyncio.get_running_loop()
        wait = self._idle_wait = loop.create_future()
        timer = loop.call_later(self.idle_interval, lambda: wait.done() or wait.set_result(None))
        try:
            await wait
        finally:
            timer.cancel()
            if self._idle_wait is wait:
                self._idle_wait = None
        if self.active:
            await asyncio.sleep(self.interval)

    @property
    def address(self):
        """The address the forwards listen on now (None while idle)."""
        return self._address

    @property
    def forwards(self):
        """``{port: loopback host}`` of the ports forwarded now."""
        return {port: fw.target for port, fw in self._forwards.items()}

    @property
    def active_connections(self):
        return len(self._relays)

    async def _run(self):
        while True:
            await self._pause()
            try:
                before = (self._address, dict(self.forwards))
                await self.scan_once()
                if (self._address, self.forwards) != before:
                    self._active_until = time.monotonic() + self.active_for
                self._last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a scan never takes envd down; each new error is logged once
                if repr(exc) != self._last_error:
                    log.exception("port forward scan failed")
                self._last_error = repr(exc)

    # -- one scan --------------------------------------------------------------------
    async def scan_once(self):
        """Brings the forwards in line with the current listeners and interface address."""
        address = self._fixed_address or interface_ipv4(self.interface)
        if address != self._address:
            self._close_all(f"the listen address changed to {address}")
            self._failed.clear()
            self._address = address
        if address is None:
            return
        own = {fw.inode for fw in self._forwards.values()}
        wanted = plan(read_listeners(self._proc_files), address, self.skip_ports, own)
        for port in [p for p in self._forwards if p not in wanted]:
            self._close_forward(port, "no loopback-only listener any more")
        self._failed = {p: t for p, t in self._failed.items() if p in wanted}
        now = time.monotonic()
        for port, target in sorted(wanted.items()):
            fw = self._forwards.get(port)
            if fw is not None:
                fw.target = target  # e.g. the service moved from 127.0.0.1 to ::1
                continue
            if len(self._forwards) >= self.max_forwards:
                if not self._warned_forward_limit:
                    log.warning("not forwarding port %d (and maybe others): %d ports are forwarded already",
                                port, self.max_forwards)
                    self._warned_forward_limit = True
                break
            if self._failed.get(port, 0.0) > now:
                continue
            try:
                await self._open_forward(address, port, target)
            except OSError as exc:
                if port not in self._failed:
                    log.warning("cannot forward %s:%d to %s: %s (retrying every %.0f s)",
                                address, port, target, exc, BIND_RETRY)
                self._failed[port] = now + BIND_RETRY
        if len(self._forwards) < self.max_forwards:
            self._warned_forward_limit = False

    async def _open_forward(self, address, port, target):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(128)
            sock.setblocking(False)
            fw = _Forward(port, target, os.fstat(sock.fileno()).st_ino)
            # An already bound socket: no name resolution, no executor thread; without
            # start_serving this await never suspends, so a cancel cannot lose the server.
            fw.server = await asyncio.get_running_loop().create_server(
                lambda: _Side(_Relay(self, fw), upstream=False), sock=sock, start_serving=False)
        except BaseException:
            sock.close()
            raise
        self._forwards[port] = fw  # from here on close() closes it
        self._failed.pop(port, None)
        log.info("forwarding %s:%d to %s:%d", address, port, target, port)
        await fw.server.start_serving()

    def _close_forward(self, port, why):
        fw = self._forwards.pop(port, None)
        if fw is None:
            return
        fw.server.close()  # closes the listening socket only; relayed connections carry on
        log.info("stopped forwarding %s:%d: %s", self._address, port, why)

    def _close_all(self, why):
        for port in list(self._forwards):
            self._close_forward(port, why)

    def _admit(self, relay):
        if len(self._relays) < self.max_connections:
            self._relays.add(relay)
            return True
        now = time.monotonic()
        if self._warned_connection_limit is None or now - self._warned_connection_limit > 10:
            log.warning("refusing forwarded connections: %d are open already", self.max_connections)
            self._warned_connection_limit = now
        return False


# -- relaying -----------------------------------------------------------------------------------

CLIENT, UPSTREAM = 0, 1


class _Relay:
    """One relayed connection: the accepted client and the connection to the service, piped
    both ways with the peers' flow control; a FIN is passed on (half-close) and the relay is
    closed once both sides sent theirs, or aborted on both sides when either fails."""

    __slots__ = ("forwarder", "fw", "transports", "eof", "dial")

    def __init__(self, forwarder, fw):
        self.forwarder = forwarder
        self.fw = fw
        self.transports = [None, None]  # CLIENT, UPSTREAM
        self.eof = [False, False]  # that side sent its FIN
        self.dial = None  # the task connecting to the service

    def made(self, side, transport):
        self.transports[side] = transport
        if side == CLIENT:
            if not self.forwarder._admit(self):
                transport.abort()
                return
            transport.pause_reading()  # until the service is connected
            self.dial = asyncio.get_running_loop().create_task(self._dial())
        elif self.transports[CLIENT].is_closing():  # the client left meanwhile
            transport.abort()

    async def _dial(self):
        host, port = self.fw.target, self.fw.port
        try:
            await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                lambda: _Side(self, upstream=True), host, port), CONNECT_TIMEOUT)
        except asyncio.CancelledError:
            self.transports[CLIENT].abort()
            raise
        except (OSError, asyncio.TimeoutError) as exc:
            log.debug("forwarded connection to %s:%d failed: %s", host, port, exc)
            self.transports[CLIENT].abort()
            return
        finally:
            self.dial = None
        client = self.transports[CLIENT]
        if not client.is_closing():
            client.resume_reading()

    def data(self, side, data):
        other = self.transports[1 - side]
        if other is not None and not other.is_closing():
            other.write(data)

    def got_eof(self, side):
        self.eof[side] = True
        other = self.transports[1 - side]
        if other is None:
            self.transports[side].abort()
        elif self.eof[1 - side]:
            for t in self.transports:
                t.close()  # both directions are done: close after flushing
        elif not other.is_closing() and other.can_write_eof():
            other.write_eof()  # half-close: the other direction keeps flowing

    def lost(self, side, exc):
        other = self.transports[1 - side]
        if side == CLIENT:
            self.forwarder._relays.discard(self)
            if self.dial is not None:
                self.dial.cancel()
        if other is not None and not other.is_closing():
            if exc is None:
                other.close()
            else:
                other.abort()

    def throttle(self, side, pause):
        """``side``'s send buffer crossed a water mark: pause or resume reading the other side."""
        other = self.transports[1 - side]
        if other is None or other.is_closing() or self.eof[1 - side]:
            return
        if pause:
            other.pause_reading()
        else:
            other.resume_reading()

    def abort(self):
        if self.dial is not None:
            self.dial.cancel()
        for t in self.transports:
            if t is not None:
                t.abort()


class _Side(asyncio.Protocol):
    """The protocol of one of a relay's two connections; everything goes to the relay."""

    __slots__ = ("relay", "side")

    def __init__(self, relay, upstream):
        self.relay = relay
        self.side = UPSTREAM if upstream else CLIENT

    def connection_made(self, transport):
        self.relay.made(self.side, transport)

    def data_received(self, data):
        self.relay.data(self.side, data)

    def eof_received(self):
        self.relay.got_eof(self.side)
        return True  # keep the transport: the other direction may still be flowing

    def connection_lost(self, exc):
        self.relay.lost(self.side, exc)

    def pause_writing(self):
        self.relay.throttle(self.side, True)

    def resume_writing(self):
        self.relay.throttle(self.side, False)
