"""network.rules with a real guest (issue 25): one sandbox created through the E2B SDK with a
header rule for ``good.test`` that carries a secret marker, checked from inside the guest
against HTTP and HTTPS servers of the test's own (names served by the node's resolver, in a
namespace made here, their certificate from a test CA that the node's egress proxy trusts
upstream through AENV_EGRESS_UPSTREAM_CA).

- curl, Python and Node over HTTPS to the ruled host are intercepted with the node's CA (which the
  guest trusts) and the server sees the rule's headers, the secret's real value among them;
- the guest never sees that value (its environment, its files, every answer it got): the
  servers record what they get and do not echo it back; the test reads their record;
- a host without rules is passed through: the guest sees that server's own certificate;
- dodges (an SNI that differs from the Host, a Host that differs from the SNI, dialling the
  other host's address, an address without a name) never bring the value to another server;
- pause / resume keeps the rules; ``PUT /sandboxes/{id}/network`` replaces them live.

One sandbox, every check in a few guest commands (CI's time is short)."""
import json
import re
import secrets as pysecrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2b import ALL_TRAFFIC, Sandbox, Secret

from harness.named_hosts import make_cert
from harness import guest_probe
from harness.networld import EXT_A, EXT_B, ExternalHost
from vmm.net import slots
from vmm.net.egress import EgressProxy

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", "/tmp").available(),
                                 reason="mitmproxy is not installed in .venv-egress (scripts/setup.sh)")]

# Answers with its name and the Host it was asked for, never the headers it got: those go to
# the record (one JSON line per request), which only the test reads.
SERVER = r'''
import json, ssl, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

address, name, cert, key, record = sys.argv[1:6]
lock = threading.Lock()

class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_GET(self):
        with lock, open(record, "a") as f:
            f.write(json.dumps({"server": name, "port": self.server.server_address[1],
                                "headers": [[k.lower(), v] for k, v in self.headers.items()]}) + "\n")
        body = f"{name} host={self.headers.get('Host')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
tls = ThreadingHTTPServer((address, 443), Answer)
tls.socket = context.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=tls.serve_forever, daemon=True).start()
ThreadingHTTPServer((address, 80), Answer).serve_forever()
'''

# Run in the guest: ``probe.py GOOD_IP EVIL_IP HOSTS_CA check...``; prints one JSON object
# (check -> what the guest got). Every request names its check in X-Aenv-Probe, so the
# servers' record says which check brought what. ``leaks`` looks for the secret's shape (not
# its value: the guest is never told it) in the environment of every process and in files.
PROBE = guest_probe.LIB + r"""
import os, re, stat, subprocess, urllib.request
GOOD_IP, EVIL_IP, HOSTS_CA = sys.argv[1:4]
NODE_CA = "/etc/aenv/egress-ca.pem"
SHAPE = re.compile(rb"aenvsecret-[0-9a-f]{32}")

def tls(ip, sni, host, probe, cafile=None):
    return https(ip, sni, host, timeout=20, cafile=cafile, headers=f"X-Aenv-Probe: {probe}\r\n")

def http_probe(ip, host, probe):
    return http(ip, host, timeout=20, headers=f"X-Aenv-Probe: {probe}\r\n")

def keepalive(ip, *hosts):
    # one connection, a request per Host (each judged on its own): each answer's status and body
    answers = []
    try:
        s = socket.create_connection((ip, 80), timeout=20)
        stream = s.makefile("rb")
        for i, host in enumerate(hosts):
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nX-Aenv-Probe: keepalive_{i}\r\n\r\n".encode())
            status, length = stream.readline().decode().strip(), 0
            while (line := stream.readline().decode().strip()):
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":")[1])
            answers.append(f"{status} {stream.read(length).decode().strip()}")
    except Exception as exc:
        answers.append(f"failed: {exc!r}")
    return answers

def signer(name):
    # which CA the certificate the guest gets for ``name`` chains to: the node's (intercepted)
    # or the test hosts' (the server's own)
    found = []
    for label, cafile in (("node", NODE_CA), ("hosts", HOSTS_CA)):
        try:
            ctx = ssl.create_default_context(cafile=cafile)
            with ctx.wrap_socket(socket.create_connection((name, 443), timeout=20), server_hostname=name):
                found.append(label)
        except Exception:
            pass
    return ",".join(found) or "none"

def curl(url, probe, *extra):
    p = subprocess.run(["curl", "-sS", "--max-time", "30", "-H", f"X-Aenv-Probe: {probe}",
                        "-H", "Authorization: guest-own", *extra, url], capture_output=True, text=True)
    return f"rc={p.returncode} {p.stdout}{p.stderr}"

def node_fetch(url, probe):
    # Node trusts its own list plus NODE_EXTRA_CA_CERTS, which envd gives the processes it starts
    js = (f"fetch({url!r}, {{headers: {{'X-Aenv-Probe': {probe!r}}}}})"
          ".then(r => r.text()).then(t => process.stdout.write(t), e => process.stdout.write('failed: ' + e.cause))")
    p = subprocess.run(["node", "-e", js], capture_output=True, text=True, timeout=90)
    return p.stdout

def urllib_get(url, probe):
    try:
        req = urllib.request.Request(url, headers={"X-Aenv-Probe": probe})
        with urllib.request.urlopen(req, timeout=30) as r:  # the default context: the system bundle
            return r.read().decode()
    except Exception as exc:
        return f"failed: {exc!r}"

def leaks():
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.update(SHAPE.findall(open(f"/proc/{pid}/environ", "rb").read()))
            except OSError:
                pass
    for top in ("/etc", "/root", "/home", "/tmp", "/run", "/var/tmp", "/var/log", "/opt", "/usr/local", "/code"):
        for folder, _, files in os.walk(top):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        continue  # a FIFO would block, a socket cannot be read
                    with open(path, "rb") as f:
                        found.update(SHAPE.findall(f.read(1 << 20)))
                except OSError:
                    pass
    return sorted(m.decode() for m in found)

checks = {
    "curl_good": lambda: curl("https://good.test/", "curl_good"),
    "urllib_good": lambda: urllib_get("https://good.test/", "urllib_good"),
    "http_good": lambda: urllib_get("http://good.test/", "http_good"),
    "node_good": lambda: node_fetch("https://good.test/", "node_good"),
    "signer_good": lambda: signer("good.test"),
    "signer_evil": lambda: signer("evil.test"),
    "curl_evil": lambda: curl("https://evil.test/", "curl_evil"),
    "curl_evil_hosts_ca": lambda: curl("https://evil.test/", "curl_evil_hosts_ca", "--cacert", HOSTS_CA),
    "curl_good_hosts_ca": lambda: curl("https://good.test/", "curl_good_hosts_ca", "--cacert", HOSTS_CA),
    # the Host names the ruled host, the SNI the other: judged by the SNI, passed through
    "sni_evil_host_good": lambda: tls(EVIL_IP, "evil.test", "good.test", "sni_evil_host_good"),
    "sni_evil_host_good_at_good_ip": lambda: tls(GOOD_IP, "evil.test", "good.test", "sni_evil_host_good_at_good_ip"),
    # the SNI names the ruled host, dialled at the other's address with its Host: pinned to good.test
    "sni_good_host_evil_at_evil_ip": lambda: tls(EVIL_IP, "good.test", "evil.test", "sni_good_host_evil_at_evil_ip"),
    "http_host_evil_at_good_ip": lambda: http_probe(GOOD_IP, "evil.test", "http_host_evil_at_good_ip"),
    # an address, no name: no SNI to judge, no Host that is allowed
    "tls_by_ip_no_sni": lambda: tls(GOOD_IP, None, GOOD_IP, "tls_by_ip_no_sni"),
    "http_by_ip": lambda: http_probe(GOOD_IP, GOOD_IP, "http_by_ip"),
    # one plain connection: the ruled host, then the other (each request judged by its own Host)
    "keepalive": lambda: keepalive(GOOD_IP, "good.test", "evil.test"),
}
wanted = sys.argv[4:]
results = run_checks(checks, [n for n in wanted if n != "leaks"])
if "leaks" in wanted:
    results["leaks"] = leaks()  # after every answer arrived
print(json.dumps(results))
"""


class RecordingHosts:
    """good.test on EXT_A and evil.test on EXT_B, HTTP on 80 and HTTPS on 443, inside the
    external host's namespace; each request's headers appended to ``record``."""

    def __init__(self, netns: str, directory: Path):
        self.netns, self.directory = netns, directory
        self.record = directory / "record.jsonl"
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "RecordingHosts":
        cert, key = make_cert(self.directory, ["good.test", "evil.test"])
        self.ca = self.directory / "hosts-ca.pem"
        script = self.directory / "recording_server.py"
        script.write_text(SERVER)
        for address, name in ((EXT_A, "good.test"), (EXT_B, "evil.test")):
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, str(script), address, name, str(cert), str(key),
                 str(self.record)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        for address in (EXT_A, EXT_B):
            for port in (80, 443):
                while subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c",
                                      f"import socket; socket.create_connection(('{address}', {port}), 1)"],
                                     capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline, f"the test host {address}:{port} did not start"
                    time.sleep(0.1)
        return self

    def requests(self) -> list[dict]:
        """What the servers got so far: ``{"server", "port", "probe", "headers": {name: [values]}}``."""
        out = []
        lines = self.record.read_text().splitlines() if self.record.exists() else []
        for line in lines:
            entry = json.loads(line)
            headers: dict[str, list[str]] = {}
            for name, value in entry["headers"]:
                headers.setdefault(name, []).append(value)
            out.append({**entry, "headers": headers, "probe": (headers.get("x-aenv-probe") or [""])[0]})
        return out

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        self.procs = []


@pytest.fixture(scope="module")
def world(stack, tmp_path_factory):
    """The test hosts, named by the node's resolver, and the session's node restarted with
    AENV_EGRESS_UPSTREAM_CA (the test CA: what the proxy verifies intercepted upstreams
    against) and AENV_API_PUBLIC_URL (where its proxy asks for secret values: this stack's API)."""
    ext = ExternalHost().start()
    for proc in ext.procs:  # its plain servers make way for the recording ones
        proc.kill()
        proc.wait(timeout=10)
    ext.procs = []
    hosts = RecordingHosts(ext.name, tmp_path_factory.mktemp("ruled"))
    hosts_dir = stack.home / "net" / "hosts.d"
    before = dict(stack.extra_env)
    try:
        hosts.start()
        hosts_dir.mkdir(parents=True, exist_ok=True)
        (hosts_dir / "egress-rules").write_text(f"{EXT_A} good.test\n{EXT_B} evil.test\n")
        stack.extra_env.update(AENV_EGRESS_UPSTREAM_CA=str(hosts.ca), AENV_API_PUBLIC_URL=stack.api_url)
        stack.kill_node()
        stack.start_node()
        yield hosts
    finally:
        # the node keeps its proxy's configuration until its next start (the test CA stays on
        # disk until the session ends); a later start takes the stack's own settings again
        stack.extra_env.clear()
        stack.extra_env.update(before)
        (hosts_dir / "egress-rules").unlink(missing_ok=True)
        hosts.stop()
        ext.stop()


# What the guest's leak scan must find (so it is shown to look): tokens of the secret's shape,
# one in a file, one in the probe's environment.
DECOY_FILE, DECOY_ENV = "aenvsecret-" + "0" * 32, "aenvsecret-" + "1" * 32


def _probe(sandbox, *checks: str) -> dict:
    out = sandbox.commands.run(f"python3 /tmp/probe.py {EXT_A} {EXT_B} /tmp/hosts-ca.pem {' '.join(checks)}",
                               envs={"AENV_DECOY": DECOY_ENV}, timeout=240).stdout
    return json.loads(out.strip().splitlines()[-1])


def _got(hosts: RecordingHosts, probe: str) -> list[dict]:
    return [r for r in hosts.requests() if r["probe"] == probe]


def _one(hosts: RecordingHosts, probe: str, server: str) -> dict:
    found = _got(hosts, probe)
    assert [r["server"] for r in found] == [server], (probe, found)
    return found[0]["headers"]


def _rules(headers: dict) -> dict:
    return {"transform": {"headers": headers}}


def test_rules_inject_headers_and_secrets_only_into_the_ruled_host(sdk_env, world):
    hosts = world
    value = f"aenvsecret-{pysecrets.token_hex(16)}"
    name = f"tok_{pysecrets.token_hex(4)}"
    Secret.create(name, value)
    bearer = "Bearer ${e2b.secrets." + name + "}"
    network = {"allow_out": ["good.test", "evil.test"], "deny_out": [ALL_TRAFFIC],
               "rules": {"good.test": [_rules({"Authorization": bearer}), _rules({"X-Aenv-Static": "one"})]}}
    sandbox = Sandbox.create(timeout=600, network=network)
    seen_by_guest: list[str] = []
    try:
        sandbox.files.write("/tmp/probe.py", PROBE)
        sandbox.files.write("/tmp/hosts-ca.pem", hosts.ca.read_text())
        sandbox.files.write("/tmp/decoy.txt", f"not a secret: {DECOY_FILE}\n")
        r = _probe(sandbox, "curl_good", "urllib_good", "http_good", "node_good", "signer_good", "signer_evil",
                   "curl_evil", "curl_evil_hosts_ca", "sni_evil_host_good", "sni_evil_host_good_at_good_ip",
                   "sni_good_host_evil_at_evil_ip", "http_host_evil_at_good_ip", "tls_by_ip_no_sni", "http_by_ip",
                   "keepalive", "leaks")
        seen_by_guest.append(json.dumps(r))
        filled = [f"Bearer {value}"]
        # (a)+(b): intercepted with the node's CA, which curl and Python trust; the rule's headers
        # arrive (the guest's own Authorization replaced), the marker filled with the value
        assert r["curl_good"] == "rc=0 good.test host=good.test\n", r
        assert r["urllib_good"] == "good.test host=good.test\n" and r["http_good"] == "good.test host=good.test\n", r
        assert r["node_good"] == "good.test host=good.test\n" and r["signer_good"] == "node", r
        for probe in ("curl_good", "urllib_good", "http_good", "node_good"):
            got = _one(hosts, probe, "good.test")
            assert got["authorization"] == filled and got["x-aenv-static"] == ["one"], (probe, got)
        # (c) no rules, no interception: evil.test's own certificate, which the guest does not trust
        assert r["signer_evil"] == "hosts", r
        assert r["curl_evil"].startswith("rc=60 ") and not _got(hosts, "curl_evil"), r
        assert r["curl_evil_hosts_ca"] == "rc=0 evil.test host=evil.test\n", r
        assert _one(hosts, "curl_evil_hosts_ca", "evil.test")["authorization"] == ["guest-own"]
        # (d) dodges: judged by the SNI and pinned to its name's address, never the Host or the address dialled
        for probe in ("sni_evil_host_good", "sni_evil_host_good_at_good_ip"):
            assert "evil.test host=good.test" in r[probe], r
            got = _one(hosts, probe, "evil.test")
            assert "authorization" not in got and "x-aenv-static" not in got, (probe, got)
        assert "good.test host=evil.test" in r["sni_good_host_evil_at_evil_ip"], r  # good.test proved its name
        assert _one(hosts, "sni_good_host_evil_at_evil_ip", "good.test")["authorization"] == filled
        assert "evil.test host=evil.test" in r["http_host_evil_at_good_ip"], r
        assert "authorization" not in _one(hosts, "http_host_evil_at_good_ip", "evil.test")
        assert "HTTP/" not in r["tls_by_ip_no_sni"] and not _got(hosts, "tls_by_ip_no_sni"), r
        assert r["http_by_ip"].startswith("HTTP/1.1 403") and not _got(hosts, "http_by_ip"), r
        assert r["keepalive"] == ["HTTP/1.1 200 OK good.test host=good.test",
                                  "HTTP/1.1 200 OK evil.test host=evil.test"], r
        assert _one(hosts, "keepalive_0", "good.test")["authorization"] == filled
        assert "authorization" not in _one(hosts, "keepalive_1", "evil.test")
        # (b) the value went to good.test alone, and never into the guest
        assert not [q for q in hosts.requests() if q["server"] != "good.test" and value in json.dumps(q)]
        assert r["leaks"] == [DECOY_FILE, DECOY_ENV], r  # the decoys only

        sandbox.pause()  # to disk: a new slot and a restored VM on resume, the stored rules with it
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        r = _probe(sandbox, "curl_good", "signer_evil")
        seen_by_guest.append(json.dumps(r))
        assert r["curl_good"] == "rc=0 good.test host=good.test\n" and r["signer_evil"] == "hosts", r
        got = [q["headers"] for q in _got(hosts, "curl_good")]
        assert len(got) == 2 and got[1]["authorization"] == filled and got[1]["x-aenv-static"] == ["one"], got

        # live: the rules move to evil.test (no secret now); good.test is passed through again
        sandbox.update_network({"allow_out": ["good.test", "evil.test"], "deny_out": [ALL_TRAFFIC],
                                "rules": {"evil.test": [_rules({"X-Aenv-Static": "two"})]}})
        r = _probe(sandbox, "signer_good", "signer_evil", "curl_evil", "curl_good_hosts_ca", "leaks")
        seen_by_guest.append(json.dumps(r))
        assert r["signer_good"] == "hosts" and r["signer_evil"] == "node", r
        assert r["curl_evil"] == "rc=0 evil.test host=evil.test\n", r
        got = _one(hosts, "curl_evil", "evil.test")
        assert got["x-aenv-static"] == ["two"] and got["authorization"] == ["guest-own"], got
        assert r["curl_good_hosts_ca"] == "rc=0 good.test host=good.test\n", r
        got = _one(hosts, "curl_good_hosts_ca", "good.test")
        assert got["authorization"] == ["guest-own"] and "x-aenv-static" not in got, got
        assert r["leaks"] == [DECOY_FILE, DECOY_ENV], r  # the decoys only
    finally:
        sandbox.kill()
        Secret.destroy(name)
    assert all(value not in text for text in seen_by_guest)
    assert re.fullmatch(r"aenvsecret-[0-9a-f]{32}", value)  # the shape the guest looked for
