"""Hands a client's keep-alive connection to the hot path (HAProxy) once the data plane has
answered its first user-port request: the connection's later requests are relayed by HAProxy
at a fraction of the data plane's per-request cost (``dataplane.hotpath_config`` says which;
the rest comes back to the data plane over HTTP).

Why after an answer, and how: the client's socket itself is passed (SCM_RIGHTS over a
socketpair the launcher made, ``dataplane.serve``) to HAProxy's ``sockpair@`` listener, which
serves it as a connection it accepted. For that, not one byte of the next request may have
been read here: the connection's reading is paused just before the last piece of the answer
is written, and the handoff happens only when nothing else was read meanwhile (no pipelined
request, not even part of one), the answer has left uvicorn's buffer, and the connection is
kept alive. Then uvicorn's transport is aborted: its descriptor closes, the socket lives on
in HAProxy (a close is not a shutdown: no FIN). Anything else, and the connection just
stays here. Only uvicorn's httptools protocol is known well enough for this; under another
server or protocol nothing is handed off.

What is handed off: connections whose request was a bodiless GET, HEAD or OPTIONS to a user
port (not envd's: its streams need the data plane's reset when a sandbox dies, which
HAProxy cannot give) of a sandbox that HAProxy serves at that very address and VM
generation (``dataplane.steer``), not already sent here by HAProxy (``VIA_HEADER``), not on
the API's ``/proxy`` mount, with none of the headers HAProxy leaves to the data plane, and
answered by the guest in HTTP/1.1 kept alive (HAProxy passes a guest's HTTP/1.0 status line
on as it is, where the data plane answers in HTTP/1.1: such clients stay here).
"""
from __future__ import annotations

import array
import asyncio
import logging
import os
import socket

from envd import ENVD_PORT

from dataplane.addressing import API_MOUNT
from dataplane.haproxy_admin import Admin
from dataplane.headers import VIA_HEADER
from dataplane.steer import Steer

log = logging.getLogger(__name__)

# Set by dataplane.serve for the uvicorn it starts.
ENV_FD, ENV_ADMIN, ENV_MAPS = "AENV_HOTPATH_FD", "AENV_HOTPATH_ADMIN", "AENV_HOTPATH_MAPS"
METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LEFT_TO_US = (b"x-api-key", b"upgrade", b"x-agentenv-sandbox-id", b"x-agentenv-target-port",
              b"content-length", b"transfer-encoding")


class _Held:
    """A connection whose reading is paused for a handoff."""

    __slots__ = ("transport", "protocol", "cycle")

    def __init__(self, transport, protocol, cycle):
        self.transport, self.protocol, self.cycle = transport, protocol, cycle


class Handoff:
    def __init__(self, fd: int, steer: Steer):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.steer = steer
        self._task: asyncio.Task | None = None
        self.handed = 0  # connections handed off (tests, logs)

    @classmethod
    def from_env(cls) -> "Handoff | None":
        """The handoff the launcher set up for this process, or None (no hot path)."""
        fd = os.environ.get(ENV_FD)
        if not fd:
            return None
        return cls(int(fd), Steer(Admin(os.environ[ENV_ADMIN]), os.environ[ENV_MAPS]))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.steer.run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()

    async def ready(self, scope, headers: dict[bytes, bytes], route, port: int) -> bool:
        """Whether this request's connection may be handed off after its answer; makes
        HAProxy able to serve the port first (its server: ``Steer.ensure_port``). A request
        HAProxy sent here (its connection is HAProxy's already) only gets the port served
        again, e.g. after the auto-resume it came for."""
        if port == ENVD_PORT or scope.get(API_MOUNT) or scope.get("method") not in METHODS:
            return False
        if scope.get("http_version") != "1.1" or any(name in headers for name in LEFT_TO_US):
            return False
        host, _ = route.address(port) or ("", 0)
        if not self.steer.published(route.sandbox_id, host, route.generation):
            return False
        served = await self.steer.ensure_port(route.sandbox_id, host, route.generation, port)
        return served and VIA_HEADER not in headers

    @staticmethod
    def hold(receive) -> _Held | None:
        """Pauses the connection's reading (before the answer's last write), or None when
        this connection cannot be handed off."""
        cycle = getattr(receive, "__self__", None)
        protocol = getattr(getattr(cycle, "on_response", None), "__self__", None)
        transport = getattr(cycle, "transport", None)
        if protocol is None or transport is None or not hasattr(protocol, "pipeline"):
            return None
        if getattr(protocol, "cycle", None) is not cycle or transport.is_closing():
            return None
        transport.pause_reading()
        return _Held(transport, protocol, cycle)

    def release(self, held: _Held) -> bool:
        """After the answer's last write: hands the connection to HAProxy (True), or resumes
        reading it here."""
        if self._clean(held):
            sock = held.transport.get_extra_info("socket")
            try:
                fd = sock.fileno()
                self.sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            except (OSError, AttributeError) as exc:
                log.info("hot path: handoff failed (%r); the connection stays here", exc)
            else:
                self.handed += 1
                held.transport.abort()  # our descriptor only: HAProxy holds the socket now
                return True
        if not held.transport.is_closing() and not held.protocol.flow.read_paused:
            held.transport.resume_reading()
        return False

    @staticmethod
    def _clean(held: _Held) -> bool:
        """Nothing of a next request was read, the answer is out, the connection stays open."""
        protocol, cycle, transport = held.protocol, held.cycle, held.transport
        return (cycle.response_complete and cycle.keep_alive and not protocol.pipeline
                and protocol.cycle is cycle and protocol.scope is cycle.scope
                and not transport.is_closing() and transport.get_write_buffer_size() == 0)
