"""The node egress proxy's judgement, as a mitmproxy addon (loaded by run.py beside it, or by
``mitmdump -s``; its folder is on ``sys.path`` then, so it holds no module named like a
library: vmm/net/dns.py there would hide dnspython).

Why mitmproxy: a sandbox whose ``allowOut`` names domains has its new TCP connections that
no CIDR allows sent here by its slot and the node (vmm.net.slots, vmm.net.host_table: DNATs
that keep the guest's port until the last, which ``SO_ORIGINAL_DST`` returns: the client's
``sockname``); mitmproxy's transparent mode does the connection handling, the TLS
ClientHello parsing and the HTTP parsing, this addon only decides. It runs in
mitmproxy's own Python environment (vmm.net.egress starts it), so it imports nothing of aenv
but vmm/net/domains.py, loaded by its path: the same matcher the API checked the entries with.

Per connection:

- the sandbox is the client's address (its slot address: the slot SNATs the guest to it);
  its allowed domains are in ``<dir>/slots/<address>.json``, written by the node before its
  nftables rules send anything here; no file: refused;
- TLS (on any port): the SNI must match; the connection is passed through unmodified (no
  interception); HTTP (on any port): every request's Host must match (a later request on the
  same connection naming another host gets a 403); the upstream port is the guest's;
- **pinned**: the proxy connects to an address the node's resolver gives for that name right
  now — never to the address the guest chose — and never to the node or an always-denied
  range (``<dir>/node.json``); a guest that names an allowed domain and dials another
  address reaches the allowed name's server or nothing;
- anything else (no SNI, an SNI or Host that does not match, other protocols, which cannot
  be judged by name) is closed or answered 403: ``server_connect`` lets a connection out only
  to an address this addon pinned for that client;
- one sandbox holds at most ``max_connections`` connections through the proxy at once (the
  proxy is shared by the node's sandboxes): past it a new one is closed at once.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import logging
import os
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.resolver
from mitmproxy import ctx, http

log = logging.getLogger("aenv.egress")

_spec = importlib.util.spec_from_file_location("aenv_domains", Path(__file__).resolve().parents[1] / "domains.py")
domains = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(domains)

DNS_TIMEOUT = 3.0


class SlotPolicies:
    """The allowed domains of each slot address, re-read when its file changes."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.cache: dict[str, tuple[tuple[int, int], tuple[str, ...] | None]] = {}

    def domains_of(self, address: str) -> tuple[str, ...] | None:
        path = self.directory / f"{address}.json"
        try:
            st = os.stat(path)
        except OSError:
            self.cache.pop(address, None)
            return None
        key = (st.st_mtime_ns, st.st_size)
        hit = self.cache.get(address)
        if hit and hit[0] == key:
            return hit[1]
        try:
            found = tuple(json.loads(path.read_text())["domains"])
        except (OSError, ValueError, KeyError, TypeError):
            found = None
        self.cache[address] = (key, found)
        return found


class EgressPolicy:
    def __init__(self):
        self.policies: SlotPolicies | None = None
        self.resolver: dns.asyncresolver.Resolver | None = None
        self.node: list = []  # never: the node's addresses and the operator's extra denials
        self.denied: list = []  # the always-denied ranges ...
        self.reopened: list = []  # ... except what the operator reopened (AENV_NET_ALLOW_EXTRA)
        self.pinned: dict[str, set[tuple[str, int]]] = {}  # client id -> addresses it may reach
        self.max_connections = 0
        self.open: dict[str, int] = {}  # slot address -> its connections now
        self.counted: dict[str, str] = {}  # client id -> slot address, for the connections in ``open``

    def load(self, loader):
        loader.add_option("aenv_egress_dir", str, "", "aenv: the directory with node.json and slots/")

    def configure(self, updated):
        if "aenv_egress_dir" not in updated or not ctx.options.aenv_egress_dir:
            return
        directory = Path(ctx.options.aenv_egress_dir)
        node = json.loads((directory / "node.json").read_text())
        self.policies = SlotPolicies(directory / "slots")
        self.resolver = dns.asyncresolver.Resolver(configure=False)
        self.resolver.nameservers = [node["resolver"]]
        self.resolver.lifetime = DNS_TIMEOUT
        self.node = [ipaddress.ip_network(c) for c in node["node"]]
        self.denied = [ipaddress.ip_network(c) for c in node["denied"]]
        self.reopened = [ipaddress.ip_network(c) for c in node.get("reopened", ())]
        self.max_connections = int(node["max_connections"])

    # -- the decisions ------------------------------------------------------------------------

    def _reachable(self, address: str) -> bool:
        """What the slot's own table lets a guest reach (vmm.net.slots), judged the same way."""
        ip = ipaddress.ip_address(address)
        if any(ip in net for net in self.node):
            return False
        return not any(ip in net for net in self.denied) or any(ip in net for net in self.reopened)

    async def _pin(self, client, host: str | None, port: int) -> str | None:
        """The address ``client`` may reach for ``host`` on ``port`` (recorded), or None."""
        allowed = self.policies.domains_of(client.peername[0]) if self.policies else None
        if not allowed or not domains.matches(host, allowed):
            return None
        try:
            answer = await self.resolver.resolve(host, "A")
        except (dns.exception.DNSException, OSError):
            return None
        for record in answer:
            if self._reachable(record.address):
                self.pinned.setdefault(client.id, set()).add((record.address, port))
                return record.address
        return None

    @staticmethod
    def _guest_port(client) -> int | None:
        """The port the guest dialled (transparent mode: the connection's original destination)."""
        return client.sockname[1] if client.sockname else None

    async def tls_clienthello(self, data):
        data.ignore_connection = True  # passed through as it is: no interception
        client = data.context.client
        host = domains.host_of(data.client_hello.sni)
        port = self._guest_port(client)
        address = await self._pin(client, host, port) if port else None
        if address is None:
            log.info("refused %s: TLS to %r on port %s", client.peername[0], host, port)
            return  # server_connect closes it
        data.context.server.address = (address, port)

    async def requestheaders(self, flow: http.HTTPFlow):
        client = flow.client_conn
        host_header = flow.request.host_header
        host = domains.host_of(host_header)
        port = self._guest_port(client)
        address = await self._pin(client, host, port) if port else None
        if address is None:
            log.info("refused %s: HTTP to %r on port %s", client.peername[0], host, port)
            flow.response = http.Response.make(
                403, f"aenv: this sandbox's network policy does not allow {host or 'this request'}\n".encode(),
                {"content-type": "text/plain"})
            return
        flow.request.host, flow.request.port = address, port
        flow.request.host_header = host_header  # setting the address rewrote it

    def server_connect(self, data):
        if data.server.address not in self.pinned.get(data.client.id, ()):
            data.server.error = "refused by the sandbox's network policy"

    def client_connected(self, client):
        address = client.peername[0]
        if self.open.get(address, 0) >= self.max_connections:
            log.info("refused %s: %d connections through the proxy already", address, self.max_connections)
            client.error = "too many connections through the egress proxy"
            return
        self.open[address] = self.open.get(address, 0) + 1
        self.counted[client.id] = address

    def client_disconnected(self, client):
        self.pinned.pop(client.id, None)
        address = self.counted.pop(client.id, None)
        if address is not None:
            self.open[address] -= 1
            if not self.open[address]:
                del self.open[address]


addons = [EgressPolicy()]
