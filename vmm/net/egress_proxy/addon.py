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
  interception) unless the SNI matches a host of the slot's ``rules``: only then is it
  ended here with a leaf of the node's CA (mitmproxy's confdir holds it as
  ``mitmproxy-ca.pem``), and the upstream server's certificate is verified as a client would
  (mitmproxy's ``ssl_verify_upstream_trusted_ca``, else its CA bundle); HTTP (on any port):
  every request's Host must match (a later request on the same connection naming another
  host gets a 403); the upstream port is the guest's;
- **rules**: a request to a ruled host (its Host for HTTP, the connection's SNI for
  intercepted TLS: the server proved that name) gets each matching rule's ``headers`` set
  (replacing the guest's), their ``${e2b.secrets.NAME}`` markers filled by
  vmm/egress_secrets.py (loaded by its path) from the API; a refused secret answers 403 and
  an unavailable one 502: a marker never leaves unfilled, a value never reaches the guest;
- **pinned**: the proxy connects to an address the node's resolver gives for that name right
  now — never to the address the guest chose — and never to the node or an always-denied
  range (``<dir>/node.json``); a guest that names an allowed domain and dials another
  address reaches the allowed name's server or nothing;
- anything else (no SNI, an SNI or Host that does not match, other protocols, which cannot
  be judged by name) is closed or answered 403: ``server_connect`` lets a connection out only
  to an address this addon pinned for that client;
- one sandbox holds at most ``max_connections`` connections through the proxy at once (the
  proxy is shared by the node's sandboxes): past it a new one is closed at once;
- **upstream** (``network.egressProxy``, the slot file's ``upstream``): a connection judged
  by name as above is named to the upstream by that name (the upstream resolves it, as E2B's
  remote DNS does); one the slot's table lets out by address reaches the relay listener
  (``chain_port`` in node.json, vmm.net.host_table's ``chained``), is checked against the
  slot file's CIDRs and the always-denied ranges again and passed through unparsed (any
  protocol, server-first ones included); either way it leaves through the upstream
  (upstream_chain.py), never directly: an upstream that fails fails the connection.
"""
from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import json
import logging
import os
import sys
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.resolver
from mitmproxy import ctx, http

log = logging.getLogger("aenv.egress")



def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


domains = _load("aenv_domains", Path(__file__).resolve().parents[1] / "domains.py")
egress_secrets = _load("aenv_egress_secrets", Path(__file__).resolve().parents[2] / "egress_secrets.py")

try:  # python-socks missing: no chaining (the node refuses egressProxy), everything else works
    import upstream_chain  # this folder's (first on sys.path)
except ImportError:  # pragma: no cover - scripts/setup.sh installs it
    upstream_chain = None

DNS_TIMEOUT = 3.0


class SlotPolicy:
    """One slot's file: its sandbox, allowed domains and rules (pattern -> header sets)."""

    def __init__(self, data: dict):
        self.sandbox = str(data.get("sandbox") or "")
        self.domains = tuple(data["domains"])
        rules = data.get("rules") or {}
        self.rules = {str(p): [dict(h) for h in sets] for p, sets in rules.items()}
        self.upstream = dict(data["upstream"]) if data.get("upstream") else None
        self.allow = [ipaddress.ip_network(c) for c in data.get("allow") or ()]
        self.deny = [ipaddress.ip_network(c) for c in data.get("deny") or ()]

    def address_allowed(self, address: str) -> bool:
        """What the slot's table lets out by address (allow wins over deny, else allowed)."""
        ip = ipaddress.ip_address(address)
        return any(ip in net for net in self.allow) or not any(ip in net for net in self.deny)

    def headers_for(self, host: str | None) -> list[dict] | None:
        """The header sets of the rules whose pattern matches ``host``, in order (None: no rule)."""
        matching = [sets for pattern, sets in self.rules.items() if domains.matches(host, [pattern])]
        return [h for sets in matching for h in sets] if matching else None


class SlotPolicies:
    """The policy of each slot address, re-read when its file changes."""

    def __init__(self, directory: Path, on_change=None):
        self.directory = directory
        self.cache: dict[str, tuple[tuple[int, int, int], SlotPolicy | None]] = {}  # (mtime, size, inode)
        self.on_change = on_change  # called with a sandbox id whose policy changed or went

    def _changed(self, address: str) -> None:
        hit = self.cache.pop(address, None)
        if hit and hit[1] is not None and self.on_change:
            self.on_change(hit[1].sandbox)

    def policy_of(self, address: str) -> SlotPolicy | None:
        path = self.directory / f"{address}.json"
        try:
            st = os.stat(path)
        except OSError:
            self._changed(address)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        hit = self.cache.get(address)
        if hit and hit[0] == key:
            return hit[1]
        self._changed(address)  # a removed rule stops sending a kept value at once
        try:
            found = SlotPolicy(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            found = None
        self.cache[address] = (key, found)
        return found


class EgressPolicy:
    def __init__(self):
        self.policies: SlotPolicies | None = None
        self.resolver: dns.asyncresolver.Resolver | None = None
        self.resolver_ip = ""  # where a slot's DNAT sends a domain sandbox's connections
        self.node: list = []  # never: the node's addresses and the operator's extra denials
        self.denied: list = []  # the always-denied ranges ...
        self.reopened: list = []  # ... except what the operator reopened (AENV_NET_ALLOW_EXTRA)
        self.pinned: dict[str, set[tuple[str, int]]] = {}  # client id -> addresses it may reach
        self.max_connections = 0
        self.open: dict[str, int] = {}  # slot address -> its connections now
        self.counted: dict[str, str] = {}  # client id -> slot address, for the connections in ``open``
        self.intercept = False  # the confdir holds the node's CA (rules on HTTPS can be applied)
        self.secrets = None  # a SecretResolver when the node handed the proxy its configuration
        self.passwords = None  # upstream proxies' passwords (upstream_chain.Passwords), same configuration
        self.allow_private_upstream = False  # AENV_EGRESS_PROXY_ALLOW_PRIVATE
        self.relays: dict[tuple, object] = {}  # a relay's address -> its upstream_chain.Relay, while connected
        self.relayed: dict[tuple, tuple] = {}  # a relay's address -> (client id, the real destination), per client
        self.relayed_of: dict[str, list] = {}  # client id -> its relays' addresses (dropped with the client)
        self.tasks: set = set()
        self.chain_port = 0
        self.chain_server = None  # the relay listener for address-allowed connections of chained slots

    def load(self, loader):
        loader.add_option("aenv_egress_dir", str, "", "aenv: the directory with node.json and slots/")

    def configure(self, updated):
        if "aenv_egress_dir" not in updated or not ctx.options.aenv_egress_dir:
            return
        directory = Path(ctx.options.aenv_egress_dir)
        node = json.loads((directory / "node.json").read_text())
        self.policies = SlotPolicies(directory / "slots", on_change=self._forget)
        self.resolver = dns.asyncresolver.Resolver(configure=False)
        self.resolver.nameservers = [node["resolver"]]
        self.resolver_ip = node["resolver"]
        self.chain_port = int(node.get("chain_port") or 0)
        self.resolver.lifetime = DNS_TIMEOUT
        self.node = [ipaddress.ip_network(c) for c in node["node"]]
        self.denied = [ipaddress.ip_network(c) for c in node["denied"]]
        self.reopened = [ipaddress.ip_network(c) for c in node.get("reopened", ())]
        self.max_connections = int(node["max_connections"])
        self.intercept = bool(node.get("intercept"))
        self.allow_private_upstream = bool(node.get("allow_private_upstream"))
        self.secrets = self.passwords = None
        secrets_file = Path(ctx.options.confdir).expanduser() / "secrets.json"
        if secrets_file.exists():
            config = json.loads(secrets_file.read_text())
            self.secrets = egress_secrets.SecretResolver.from_config(config)
            if upstream_chain is not None:
                self.passwords = upstream_chain.Passwords(config, egress_secrets.post_json)

    def _forget(self, sandbox: str) -> None:
        if self.secrets is not None and sandbox:
            self.secrets.forget(sandbox)
        if self.passwords is not None and sandbox:
            self.passwords.forget(sandbox)

    # -- the decisions ------------------------------------------------------------------------

    def _reachable(self, address: str) -> bool:
        """What the slot's own table lets a guest reach (vmm.net.slots), judged the same way."""
        ip = ipaddress.ip_address(address)
        if any(ip in net for net in self.node):
            return False
        return not any(ip in net for net in self.denied) or any(ip in net for net in self.reopened)

    def _policy(self, client) -> SlotPolicy | None:
        return self.policies.policy_of(client.peername[0]) if self.policies else None

    async def _pin(self, client, host: str | None, port: int) -> str | None:
        """The address ``client`` may reach for ``host`` on ``port`` (recorded), or None."""
        policy = self._policy(client)
        if policy is None or not policy.domains or not domains.matches(host, policy.domains):
            return None
        if policy.upstream is not None:  # the upstream resolves the name (E2B: remote DNS)
            self.pinned.setdefault(client.id, set()).add((host, port))
            return host
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
        data.ignore_connection = True  # passed through as it is unless the host has rules
        client = data.context.client
        host = domains.host_of(data.client_hello.sni)
        port = self._guest_port(client)
        address = await self._pin(client, host, port) if port else None
        if address is None:
            log.info("refused %s: TLS to %r on port %s", client.peername[0], host, port)
            return  # server_connect closes it
        data.context.server.address = (address, port)
        policy = self._policy(client)
        if self.intercept and policy is not None and policy.headers_for(host) is not None:
            data.ignore_connection = False  # ended here: the rules' headers go into its requests

    @staticmethod
    def _answer(flow: http.HTTPFlow, status: int, text: str) -> None:
        flow.response = http.Response.make(status, f"aenv: {text}\n".encode(), {"content-type": "text/plain"})

    async def requestheaders(self, flow: http.HTTPFlow):
        client = flow.client_conn
        host_header = flow.request.host_header
        port = self._guest_port(client)
        if client.tls:  # intercepted: judged by the SNI, already pinned at the ClientHello
            host = domains.host_of(client.sni)
            server = flow.server_conn.address
            relayed = self.relayed.get(tuple(server[:2])) if server else None
            address = (relayed[1][0] if relayed else server[0]) if server else None
            if address is None or (address, port) not in self.pinned.get(client.id, ()):
                address = None
            elif relayed:  # the server connection is the relay's: requests keep using it
                address, port = server[0], server[1]
        else:
            host = domains.host_of(host_header)
            address = await self._pin(client, host, port) if port else None
        if address is None:
            log.info("refused %s: HTTP to %r on port %s", client.peername[0], host, port)
            self._answer(flow, 403, f"this sandbox's network policy does not allow {host or 'this request'}")
            return
        flow.request.host, flow.request.port = address, port
        flow.request.host_header = host_header  # setting the address rewrote it
        policy = self._policy(client)
        rules = policy.headers_for(host) if policy is not None else None
        if rules:
            await self._transform(flow, policy.sandbox, host, rules)

    async def _transform(self, flow: http.HTTPFlow, sandbox: str, host: str, rules: list[dict]) -> None:
        """The rules' headers into the request, markers filled; on any failure an answer instead."""
        wanted: dict[str, str] = {}
        for headers in rules:
            wanted.update(headers)
        needs_secrets = any(egress_secrets.MARKER.search(v) for v in wanted.values())
        if needs_secrets and self.secrets is None:
            self._answer(flow, 502, "this node's egress proxy cannot fill secrets (no API configured)")
            return
        try:
            filled = (await asyncio.to_thread(self.secrets.fill_headers, sandbox, host, wanted)
                      if needs_secrets else wanted)
        except egress_secrets.SecretRefused as exc:
            log.info("refused %s: a secret for %r: %s", sandbox, host, exc.status)
            self._answer(flow, 403, f"a secret in this sandbox's rules for {host} was refused ({exc.message})")
            return
        except egress_secrets.SecretUnavailable:
            self._answer(flow, 502, f"a secret in this sandbox's rules for {host} could not be fetched")
            return
        for name, value in filled.items():
            flow.request.headers[name] = value

    async def server_connect(self, data):
        relayed = self.relayed.get(tuple(data.server.address[:2]))
        if relayed is not None and relayed[0] == data.client.id:  # a new connection for a relayed one's requests
            data.server.address = relayed[1]
        if data.server.address not in self.pinned.get(data.client.id, ()):
            data.server.error = "refused by the sandbox's network policy"
            return
        policy = self._policy(data.client)
        if policy is not None and policy.upstream is not None:
            await self._chain(data, policy)

    async def _chain(self, data, policy: SlotPolicy) -> None:
        """Dials the slot's upstream for this server connection and points the connection at
        a relay joined to it; on any failure the connection fails (never goes out directly)."""
        host, port = data.server.address[:2]
        upstream = policy.upstream
        try:
            if upstream_chain is None:
                raise RuntimeError("python-socks is not installed")
            password = None
            if upstream.get("credential"):
                if self.passwords is None:
                    raise upstream_chain.UpstreamFailed("no API configured to ask for the proxy's password")
                password = await asyncio.to_thread(self.passwords.password, policy.sandbox, upstream["credential"])
            streams = await upstream_chain.dial(upstream, password, host, port, self.allow_private_upstream, self.node)
            relay = upstream_chain.Relay(streams)
            try:
                relay_address = await relay.open()
            except OSError:
                relay.close()
                raise
        except Exception as exc:  # UpstreamFailed, OSError: the message never carries the password
            log.warning("failed %s: %s:%s through its upstream: %s", data.client.peername[0], host, port, exc)
            data.server.error = "the sandbox's egress proxy (upstream) failed"
            return
        self.relays[relay_address] = relay
        self.relayed[relay_address] = (data.client.id, (host, port))
        self.relayed_of.setdefault(data.client.id, []).append(relay_address)
        data.server.address = relay_address

    async def running(self):
        if upstream_chain is not None and self.chain_port and self.chain_server is None:
            self.chain_server = await asyncio.start_server(self._chained, self.resolver_ip, self.chain_port)

    async def done(self):
        if self.chain_server is not None:
            self.chain_server.close()

    async def _chained(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A chained slot's connection its table let out by address: judged again, then
        joined to the upstream unparsed."""
        slot = writer.get_extra_info("peername")[0]
        counted, host, port = False, "?", 0
        try:
            host, port = upstream_chain.original_dst(writer.get_extra_info("socket"))
            policy = self.policies.policy_of(slot) if self.policies else None
            if (policy is None or policy.upstream is None or not self._reachable(host)
                    or not policy.address_allowed(host)):
                # a slot with an upstream should never send what its table denies: worth a warning
                level = logging.INFO if policy is None or policy.upstream is None else logging.WARNING
                log.log(level, "refused %s: %s:%s by address", slot, host, port)
                return
            if self.open.get(slot, 0) >= self.max_connections:
                log.info("refused %s: %d connections through the proxy already", slot, self.max_connections)
                return
            self.open[slot] = self.open.get(slot, 0) + 1
            counted = True
            password = None
            if policy.upstream.get("credential"):
                if self.passwords is None:
                    raise upstream_chain.UpstreamFailed("no API configured to ask for the proxy's password")
                password = await asyncio.to_thread(self.passwords.password, policy.sandbox,
                                                   policy.upstream["credential"])
            streams = await upstream_chain.dial(policy.upstream, password, host, port, self.allow_private_upstream,
                                                self.node)
            await upstream_chain.join(reader, writer, streams)
        except Exception as exc:  # UpstreamFailed, OSError: the message never carries the password
            log.warning("failed %s: %s:%s through its upstream: %s", slot, host, port, exc)
        finally:
            writer.close()
            if counted:
                self.open[slot] -= 1
                if not self.open[slot]:
                    del self.open[slot]

    def server_connected(self, data):
        relay = self.relays.get(tuple(data.server.address[:2])) if data.server.address else None
        if relay is not None:
            task = asyncio.get_running_loop().create_task(relay.run(data.server.sockname))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def server_connect_error(self, data):
        self._drop_relay(data.server)

    def server_disconnected(self, data):
        self._drop_relay(data.server)

    def _drop_relay(self, server) -> None:
        relay = self.relays.pop(tuple(server.address[:2]), None) if server.address else None
        if relay is not None:
            relay.close()

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
        for address in self.relayed_of.pop(client.id, ()):
            self.relayed.pop(address, None)
        address = self.counted.pop(client.id, None)
        if address is not None:
            self.open[address] -= 1
            if not self.open[address]:
                del self.open[address]


addons = [EgressPolicy()]
