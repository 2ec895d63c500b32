"""The node's egress proxy: what enforces domain names in a sandbox's ``allowOut``.

Why a proxy: a domain is not an address, so the slot's nftables table cannot judge it. A
sandbox whose policy names domains has its new TCP connections (any port) that no CIDR
allows sent by its slot (vmm.net.slots) to this proxy, which judges each by its TLS SNI
or HTTP Host and connects only to an address the node's resolver gives for that name
(vmm/net/egress_proxy/addon.py). Sandboxes without domain rules never reach it: their slots send it
nothing.

The proxy is mitmproxy (PyPI)'s proxy core in transparent mode with aenv's addon
(vmm/net/egress_proxy/run.py starts it with nothing else of mitmdump's): a well-kept base that
parses TLS and HTTP, and ends TLS where a sandbox's ``network.rules`` must rewrite requests
(with the node's CA; TLS to hosts without rules passes through). It lives in a Python
environment of its own (``.venv-egress``, made by ``scripts/setup.sh``: its pins differ from
aenv's), runs as ``nobody``, listens on the node resolver's address (the slot pool's base +
1, so every aenv instance has its own) at ``slots.PROXY_PORT``, where ``SO_ORIGINAL_DST``
(transparent mode) gives it the guest's port, and outlives the worker like the resolver does. Where it is not installed, a node refuses
domain rules (400) instead of accepting them unenforced; where it runs without the node's CA
(``ca_pem``), rules likewise.

A sandbox with ``network.egressProxy`` has all its TCP sent here (vmm.net.host_table's
``chained``): what its policy lets out by address to a plain relay in the same process
(``slots.CHAIN_PORT``), what is judged by name as above; both leave through the upstream the
slot's file names (vmm/net/egress_proxy/upstream_chain.py: python-socks, SOCKS5 or HTTP
CONNECT), its password asked of the API (never in a file here).

What it reads lives under ``RUNTIME/<prefix>`` (world-readable, as ``nobody`` must read it):
``node.json`` (the resolver, what no guest may reach, the per-sandbox connection limit) and
``slots/<slot address>.json`` (one sandbox's allowed domains and its ``network.rules``, with
secret markers only, never values), written before the slot's rules send anything and
removed after they stop. Its ``conf`` folder (mitmproxy's confdir) is the proxy user's alone
(0700, files 0600): the node's CA with its key as ``mitmproxy-ca.pem`` (``ca_pem``: TLS to a
host with rules is intercepted only when it is there), ``secrets.json`` (``secrets``: the
API's URL and the node's credential, to fill secret markers) and ``upstream-ca.pem``, its copy
of the ``upstream_ca`` bundle (``AENV_EGRESS_UPSTREAM_CA``), so the proxy's user reads it
whatever the permissions of the operator's folder.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import pwd
import signal
import socket
import subprocess
import time
from pathlib import Path

from .slots import ALWAYS_DENIED, CHAIN_PORT, PROXY_PORT

RUNTIME = Path("/run/aenv-egress")
USER = "nobody"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MITMDUMP = ROOT / ".venv-egress" / "bin" / "mitmdump"  # there: mitmproxy is installed, its python beside it
RUN = Path(__file__).with_name("egress_proxy") / "run.py"
UPSTREAM_CA = "upstream-ca.pem"  # in the proxy's confdir: its copy of AENV_EGRESS_UPSTREAM_CA
START_TIMEOUT = 20.0
# Connections one sandbox may hold through the proxy at once: the proxy is the node's, shared
# by every sandbox with domain rules (its slot's own limits bound new connections per second).
MAX_CONNECTIONS = 256


class EgressProxyError(Exception):
    """The egress proxy could not be started."""


def _cmdline(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None


class EgressProxy:
    """The egress proxy of one aenv instance (``prefix``), listening on ``ip``."""

    def __init__(self, prefix: str, ip: str, log_dir: Path, node: tuple[str, ...] = (),
                 reopened: tuple[str, ...] = (), binary: Path | None = None, max_connections: int = MAX_CONNECTIONS,
                 ca_pem: bytes | None = None, secrets: dict | None = None, upstream_ca: str | None = None,
                 allow_private_upstream: bool = False):
        self.prefix, self.ip = prefix, ip
        self.dir = RUNTIME / prefix
        self.slots_dir = self.dir / "slots"
        self.pidfile = self.dir / "proxy.pid"
        self.log_file = Path(log_dir) / "egress-proxy.log"
        self.node, self.reopened = tuple(node), tuple(reopened)
        self.binary = Path(binary) if binary else DEFAULT_MITMDUMP
        self.max_connections = max_connections
        self.ca_pem = ca_pem  # vmm.egress_ca.NodeCA.mitmproxy_pem(): key and certificate
        self.secrets = secrets  # agent.egress_secrets.proxy_config()
        self.upstream_ca = upstream_ca  # a CA bundle replacing mitmproxy's for upstream servers
        self.allow_private_upstream = allow_private_upstream  # AENV_EGRESS_PROXY_ALLOW_PRIVATE
        self.conf = self.dir / "conf"

    # -- the process ----------------------------------------------------------------------

    def available(self) -> bool:
        return self.binary.exists()

    def chains(self) -> bool:
        """Whether the proxy can chain to upstream proxies (python-socks in its environment)."""
        return any(self.binary.parent.parent.glob("lib/python3*/site-packages/python_socks/__init__.py"))

    def argv(self) -> list[str]:
        python = self.binary.with_name("python3")  # mitmproxy's own environment
        return [str(python), str(RUN), "--listen", f"{self.ip}:{PROXY_PORT}", f"--dir={self.dir}",
                f"--confdir={self.conf}",
                *([f"--upstream-ca={self.conf / UPSTREAM_CA}"] if self.upstream_ca else [])]

    @property
    def intercepts(self) -> bool:
        """Whether HTTPS to a host with rules can be intercepted (the node's CA was given)."""
        return self.ca_pem is not None

    def _conf_files(self) -> dict[str, bytes]:
        files = {}
        if self.ca_pem is not None:
            files["mitmproxy-ca.pem"] = self.ca_pem
        if self.secrets is not None:
            files["secrets.json"] = json.dumps(self.secrets, sort_keys=True).encode()
        if self.upstream_ca:
            # a copy the proxy's user can read wherever the operator's file is (a folder of
            # root's alone made every intercepted request a 502); a new content restarts it
            files[UPSTREAM_CA] = Path(self.upstream_ca).read_bytes()
        return files

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        argv = _cmdline(pid)
        return pid if argv and f"--dir={self.dir}" in argv else None

    def _node_config(self) -> dict:
        # the node's addresses inside an always-denied range are denied with it (no operator may
        # reopen them): listing only the others keeps the file, and so a running proxy, the same
        # while slots (whose veth addresses are the node's) come and go
        denied = [ipaddress.ip_network(c) for c in ALWAYS_DENIED]
        node = sorted({c for c in (*self.node, f"{self.ip}/32")
                       if not any(ipaddress.ip_network(c, strict=False).subnet_of(d) for d in denied)})
        conf = hashlib.sha256(json.dumps({k: v.hex() for k, v in self._conf_files().items()},
                                         sort_keys=True).encode()).hexdigest()  # a change restarts the proxy
        return {"resolver": self.ip, "node": node, "denied": list(ALWAYS_DENIED),
                "reopened": list(self.reopened), "max_connections": self.max_connections,
                "intercept": self.intercepts, "conf": conf, "allow_private_upstream": self.allow_private_upstream,
                "chain_port": CHAIN_PORT, "code": _code_hash()}

    def ensure(self) -> None:
        """A proxy answering with this configuration (a running one with another is replaced)."""
        if not self.available():
            raise EgressProxyError(f"mitmdump not found at {self.binary} (scripts/setup.sh installs it)")
        if self.upstream_ca and not Path(self.upstream_ca).is_file():
            raise EgressProxyError(f"the upstream CA bundle {self.upstream_ca} (AENV_EGRESS_UPSTREAM_CA) is not a file")
        user = pwd.getpwnam(USER)
        self.slots_dir.mkdir(parents=True, exist_ok=True)
        for d in (RUNTIME, self.dir, self.slots_dir):
            d.chmod(0o755)
        self.conf.mkdir(exist_ok=True)
        os.chown(self.conf, user.pw_uid, user.pw_gid)
        self.conf.chmod(0o700)
        config = json.dumps(self._node_config(), sort_keys=True)
        node_file = self.dir / "node.json"
        pid = self.pid()
        if pid is not None:
            if _cmdline(pid) == self.argv() and node_file.exists() and node_file.read_text() == config:
                return
            self.stop(keep_policies=True)
        for name in ("mitmproxy-ca.pem", "secrets.json", UPSTREAM_CA):
            data = self._conf_files().get(name)
            if data is None:
                (self.conf / name).unlink(missing_ok=True)
            else:
                _write_private(self.conf / name, data, user.pw_uid, user.pw_gid)
        _write(node_file, config)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            env = {"PATH": "/usr/bin:/bin", "HOME": str(self.dir / "conf"), "PYTHONUNBUFFERED": "1"}  # a log now
            proc = subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                                     "--", *self.argv()], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, env=env)
        self.pidfile.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT
        while not self.listening() or proc.poll() is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop(keep_policies=True)
                raise EgressProxyError(f"the egress proxy did not start (see {self.log_file})")
            time.sleep(0.1)
        time.sleep(0.3)  # it listens before it loads the addon, and exits if that fails
        if proc.poll() is not None:
            self.stop(keep_policies=True)
            raise EgressProxyError(f"the egress proxy stopped at start (see {self.log_file})")

    def listening(self) -> bool:
        """Whether the proxy answers (and its relay for upstream proxies, where it can chain)."""
        try:
            for port in (PROXY_PORT, CHAIN_PORT) if self.chains() else (PROXY_PORT,):
                socket.create_connection((self.ip, port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self, keep_policies: bool = False) -> None:
        """Stops the proxy; without ``keep_policies`` (an instance going away for good) its
        files go too."""
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if _cmdline(pid) is None:
                        break
                    time.sleep(0.05)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pidfile.unlink(missing_ok=True)
        if not keep_policies:
            subprocess.run(["rm", "-rf", str(self.dir)], check=False)

    # -- one sandbox ----------------------------------------------------------------------

    def allow(self, address: str, sandbox_id: str, domains: tuple[str, ...], rules: dict | None = None,
              upstream: dict | None = None, allow: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> None:
        """The domains the sandbox at slot ``address`` may reach and its rules (``{pattern:
        [{header: value}]}``, markers unfilled) (replaces what it had). ``upstream``: its
        ``network.egressProxy`` as NetworkSpec.upstream() gives it (no password), with the
        policy's CIDRs (``allow`` / ``deny``) the proxy judges connections by address with."""
        self.slots_dir.mkdir(parents=True, exist_ok=True)
        data = {"sandbox": sandbox_id, "domains": list(domains), "rules": rules or {}}
        if upstream:
            data.update(upstream=upstream, allow=list(allow), deny=list(deny))
        _write(self.slots_dir / f"{address}.json", json.dumps(data))

    def forget(self, address: str) -> None:
        (self.slots_dir / f"{address}.json").unlink(missing_ok=True)

    def upstream_of(self, address: str) -> bool:
        """Whether the slot at ``address`` has an upstream proxy now (its file names one)."""
        try:
            return bool(json.loads((self.slots_dir / f"{address}.json").read_text()).get("upstream"))
        except (OSError, ValueError, AttributeError):
            return False

    def chained(self) -> set[str]:
        """The slot addresses whose file names an upstream proxy."""
        addresses = (path.name[:-len(".json")] for path in self.slots_dir.glob("*.json"))
        return {address for address in addresses if self.upstream_of(address)}

    def allowed(self, address: str) -> list[str] | None:
        try:
            return json.loads((self.slots_dir / f"{address}.json").read_text())["domains"]
        except (OSError, ValueError, KeyError):
            return None


def _write_private(path: Path, data: bytes, uid: int, gid: int) -> None:
    """Atomically, readable by the proxy's user alone (0600): the CA's key, the node's credential."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chown(tmp, uid, gid)
    os.replace(tmp, path)


def _code_hash() -> str:
    """The proxy's own code (its folder, and what it loads of aenv's): a node upgraded while a
    proxy runs restarts it, so a slot setting that older code does not know (egressProxy.tls)
    is never left to it."""
    files = [*sorted(RUN.parent.glob("*.py")), Path(__file__).with_name("domains.py"),
             Path(__file__).resolve().parents[1] / "egress_secrets.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def _write(path: Path, text: str) -> None:
    """Atomically, world-readable (the proxy runs as ``nobody``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)
