"""HAProxy's runtime API (its admin socket), as the hot path uses it: map entries set and
deleted, a guest port's server added, retired (maintenance, its streams shut) and deleted once
no connection to it is left, the counters read.

Why a module: ``dataplane.steer`` changes HAProxy's maps while it serves, with no reload (a
reload would drop the handed-off connections), and tests read its counters to show which
path served a request. One command batch per connection (``;``-separated): nothing of a
session is kept, so a restarted HAProxy is just the next connection.
"""
from __future__ import annotations

import asyncio
import re

# What a key or value sent here may look like: sandbox ids, IPv4/IPv6 addresses, hex digests.
SAFE = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,128}")
# A guest server's idle connection pool (servers added at run time get none by default: no
# purge delay, no room): kept idle up to this long between HAProxy's purges, at most so many.
POOL = "pool-purge-delay 5s pool-max-conn 1000"
# A backend connection in ``show fd``: "... sv=<backend>/<server> mux=..."
_FD_SERVER = re.compile(r" sv=([^/ ]+)/(\S+) ")


# How HAProxy's runtime API says no (its successes are empty or say what was done).
REFUSALS = ("Unknown", "Missing", "Invalid", "No such", "Already", "Only", "Server still", "Can't", "Cannot",
            "Require", "Permission denied")


class AdminError(Exception):
    """HAProxy could not be asked, or refused a command."""


def _checked(word: str) -> str:
    if not SAFE.fullmatch(word):
        raise AdminError(f"refusing to send {word!r} to HAProxy's runtime API")
    return word


class Admin:
    def __init__(self, socket_path: str, timeout: float = 5.0):
        self.socket_path, self.timeout = socket_path, timeout

    async def run(self, *commands: str, check: bool = True) -> str:
        """Runs ``commands`` in one connection and returns everything HAProxy answered;
        raises AdminError when ``check`` and HAProxy refused one."""
        if not commands:
            return ""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.socket_path), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise AdminError(f"HAProxy's admin socket {self.socket_path}: {exc!r}") from exc
        try:
            writer.write(("; ".join(commands) + "\n").encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise AdminError(f"HAProxy's admin socket {self.socket_path}: {exc!r}") from exc
        finally:
            writer.close()
        text = answer.decode("utf-8", "replace")
        for line in text.splitlines() if check else ():
            if line.startswith(REFUSALS) or "not found" in line or "error" in line.lower():
                raise AdminError(f"HAProxy refused {commands!r}: {line}")
        return text

    @staticmethod
    def set_entry(map_path: str, key: str, value: str, known: bool) -> str:
        verb = "set" if known else "add"
        return f"{verb} map {map_path} {_checked(key)} {_checked(value)}"

    @staticmethod
    def del_entry(map_path: str, key: str) -> str:
        return f"del map {map_path} {_checked(key)}"

    @staticmethod
    def clear(map_path: str) -> str:
        return f"clear map {map_path}"

    @staticmethod
    def add_server(backend: str, name: str, address: str, port: int) -> list[str]:
        """A server for one guest port, taking traffic only by name (``use-server``; weight
        0: no balancing ever picks it), with an idle connection pool (``POOL``), enabled (new
        servers start in maintenance)."""
        host = f"[{address}]" if ":" in address else address
        return [f"add server {backend}/{_checked(name)} {_checked(host)}:{int(port)} weight 0 {POOL}",
                f"enable server {backend}/{name}"]

    @staticmethod
    def retire_server(backend: str, name: str) -> list[str]:
        """Maintenance (no new request; its pooled idle connections closed), its streams shut.
        Not deleted: a client's session may still hold an idle connection to it."""
        target = f"{backend}/{_checked(name)}"
        return [f"set server {target} state maint", f"shutdown sessions server {target}"]

    @staticmethod
    def del_server(backend: str, name: str) -> str:
        return f"del server {backend}/{_checked(name)}"

    async def connected_servers(self, backend: str) -> set[str]:
        """The servers of ``backend`` that a connection HAProxy holds open leads to (``show
        fd``: every backend connection with its server, in a session, a pool or a stream)."""
        text = await self.run("show fd", check=False)
        return {m.group(2) for m in _FD_SERVER.finditer(text) if m.group(1) == backend}

    async def stat(self, proxy: str, side: str = "BACKEND") -> dict[str, str]:
        """One line of ``show stat`` (``proxy``'s ``BACKEND`` or ``FRONTEND``) as a dict."""
        text = await self.run("show stat", check=False)
        lines = [line for line in text.splitlines() if line]
        header = lines[0].lstrip("# ").split(",")
        for line in lines[1:]:
            fields = line.split(",")
            if fields[0] == proxy and fields[1] == side:
                return dict(zip(header, fields))
        raise AdminError(f"no {side} {proxy} in HAProxy's stats")
