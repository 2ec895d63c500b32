"""A real guest trusts the node's TLS-interception CA after envd's /aenv/trust (issue 25):
`openssl verify` and Python's ssl (the system bundle, certifi where the image has it) accept a
leaf the node's CA issued, served by a TLS server inside the guest; processes get
NODE_EXTRA_CA_CERTS; before the install the same leaf is refused. One VM, booted from `base`."""
import base64

import pytest

from envd_client import EnvdClient
from tests.vmm.test_lifecycle_vm import real_driver
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec
from vmm.egress_ca import NodeCA

pytestmark = pytest.mark.vm

HOST = "api.example.test"
# In the guest: a TLS server on loopback with the leaf; a client per trust list; prints one
# line per list: "<name> ok" or "<name> refused <reason>".
PROBE = r"""
import os, socket, ssl, sys, threading
srv = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
srv.load_cert_chain("/tmp/leaf-chain.pem", "/tmp/leaf-key.pem")
lst = socket.create_server(("127.0.0.1", 0)); port = lst.getsockname()[1]
def serve():
    while True:
        c, _ = lst.accept()
        try:
            with srv.wrap_socket(c, server_side=True) as t: t.sendall(b"ok")
        except Exception: pass
threading.Thread(target=serve, daemon=True).start()
lists = [("system", None)]
try:
    import certifi; lists.append(("certifi", certifi.where()))
except ImportError:
    pass
for name, cafile in lists:
    ctx = ssl.create_default_context(cafile=cafile)
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw, server_hostname=sys.argv[1]) as t:
            print(name, "ok" if t.recv(2) == b"ok" else "no-answer")
    except ssl.SSLCertVerificationError as e:
        print(name, "refused", e.verify_message)
print("env", os.environ.get("NODE_EXTRA_CA_CERTS", "-"))
"""


def test_the_guest_trusts_a_leaf_of_the_node_ca_after_the_install(tmp_path_factory):
    ca = NodeCA.ensure(tmp_path_factory.mktemp("node-ca"), "vm-test")
    leaf = ca.leaf(HOST)
    with real_driver(tmp_path_factory.mktemp("egress-trust") / "home") as driver:
        info = driver.boot(BootSpec("egress-trust", image="base", cpu_count=1, memory_mb=512))
        host, port = endpoint(info)
        with EnvdClient.at(host, port, timeout=120, stream_idle_timeout=300) as envd:
            def run(command: str, user: str = "user") -> str:
                result = envd.run(command, user=user, stdin=None)
                assert result.exit_code == 0, (command, result.stdout, result.stderr)
                return result.stdout.decode()

            files = {"/tmp/leaf-chain.pem": leaf.chain_pem, "/tmp/leaf-key.pem": leaf.key_pem,
                     "/tmp/leaf.pem": leaf.cert_pem, "/tmp/probe.py": PROBE.encode()}
            for path, data in files.items():
                run(f"echo {base64.b64encode(data).decode()} | base64 -d > {path}")
            probe = f"python3 /tmp/probe.py {HOST}"
            before = run(probe)
            assert "system refused" in before, before
            assert "openssl-refused" in run("openssl verify /tmp/leaf.pem >/dev/null 2>&1 && echo openssl-ok "
                                            "|| echo openssl-refused")

            done = envd.trust(ca.cert_pem.decode())
            assert done["fingerprint"] == ca.fingerprint and "/etc/ssl/certs/ca-certificates.crt" in done["bundles"]

            after = run(probe)
            assert "system ok" in after and "refused" not in after, after
            assert "env /etc/aenv/egress-ca.pem" in after, after  # a process started after the install
            assert "openssl-ok" in run("openssl verify /tmp/leaf.pem >/dev/null 2>&1 && echo openssl-ok "
                                       "|| echo openssl-refused")
            assert envd.trust(ca.cert_pem.decode())["bundles"] == []  # again: nothing changes
            assert run("grep -c 'aenv egress CA' /etc/ssl/certs/ca-certificates.crt").strip() == "1"
            assert "PRIVATE KEY" not in run("cat /etc/aenv/egress-ca.pem")
