"""User ports through the data plane with real VMs (issue 10 item 4): an HTTP server in the
guest reached with the SDK's host form and with the routing headers, a WebSocket echo server
round-tripping text and binary frames, a server bound to 127.0.0.1 in the guest (envd
re-exposes it), four fork children each serving their own port, a closed port's 502, and a
private sandbox's traffic token."""

import httpx
import pytest
from e2b import Sandbox

from harness.polling import until

pytestmark = pytest.mark.vm

# A WebSocket echo server for the guest with only the standard library (the template has
# no websockets package): the RFC 6455 handshake and unfragmented frames.
WS_ECHO = r'''
import base64, hashlib, socket, struct, sys, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def recv_exact(c, n):
    b = b""
    while len(b) < n:
        part = c.recv(n - len(b))
        if not part:
            raise EOFError
        b += part
    return b
def serve(c):
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    headers = {l.split(b":", 1)[0].strip().lower(): l.split(b":", 1)[1].strip()
               for l in req.split(b"\r\n")[1:] if b":" in l}
    accept = base64.b64encode(hashlib.sha1(headers[b"sec-websocket-key"] + GUID.encode()).digest())
    proto = headers.get(b"sec-websocket-protocol", b"").split(b",")[0].strip()
    extra = b"Sec-WebSocket-Protocol: " + proto + b"\r\n" if proto else b""
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n" + extra + b"\r\n")
    try:
        while True:
            b1, b2 = recv_exact(c, 2)
            op, n = b1 & 0x0F, b2 & 0x7F
            if n == 126: n = struct.unpack(">H", recv_exact(c, 2))[0]
            elif n == 127: n = struct.unpack(">Q", recv_exact(c, 8))[0]
            mask = recv_exact(c, 4)
            data = bytes(x ^ mask[i % 4] for i, x in enumerate(recv_exact(c, n)))
            if op == 8:
                c.sendall(bytes([0x88, len(data)]) + data)
                return
            head = bytes([0x80 | op])
            head += bytes([len(data)]) if len(data) < 126 else bytes([126]) + struct.pack(">H", len(data))
            c.sendall(head + data)
    except EOFError:
        pass
    finally:
        c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    conn, _ = s.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''



def _headers(sbx, port: int, **extra) -> dict:
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port), **extra}


def test_http_websocket_and_loopback_services_through_the_data_plane(stack, sdk_env):
    from websockets.sync.client import connect

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/tmp/www/hello.txt", "hello from the guest")
        sbx.files.write("/tmp/ws_echo.py", WS_ECHO)
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        sbx.commands.run("python3 /tmp/ws_echo.py 8765 >/dev/null 2>&1", background=True)
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8081 --bind 127.0.0.1 >/dev/null 2>&1",
                         background=True)
        # the SDK's host form: <port>-<id>.<domain>
        host = sbx.get_host(8080)
        assert host.startswith(f"8080-{sbx.sandbox_id}.")
        r = until(lambda: (x := httpx.get(f"{stack.sandbox_url}/hello.txt", headers={"Host": host}, timeout=10))
                   .status_code == 200 and x, "the guest's HTTP server (host form)")
        assert r.text == "hello from the guest"
        # the routing headers
        r = httpx.get(f"{stack.sandbox_url}/hello.txt", headers=_headers(sbx, 8080), timeout=10)
        assert r.status_code == 200 and r.text == "hello from the guest"
        # a service bound to 127.0.0.1 in the guest, re-exposed by envd
        r = until(lambda: (x := httpx.get(f"{stack.sandbox_url}/hello.txt", headers=_headers(sbx, 8081),
                                           timeout=10)).status_code == 200 and x, "the loopback-bound server")
        assert r.text == "hello from the guest"
        # a closed port: E2B's 502 body
        r = httpx.get(f"{stack.sandbox_url}/", headers=_headers(sbx, 9), timeout=30)
        assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"
        # WebSocket both ways: text, binary, a subprotocol, the close
        ws_url = stack.sandbox_url.replace("http://", "ws://") + "/echo"

        def open_ws():
            return connect(ws_url, additional_headers=_headers(sbx, 8765), subprotocols=["chat"], open_timeout=10)

        ws = until(open_ws, "the guest's WebSocket server")
        with ws:
            assert ws.subprotocol == "chat"
            ws.send("ping through the proxy")
            assert ws.recv(timeout=10) == "ping through the proxy"
            blob = bytes(range(256)) * 4
            ws.send(blob)
            assert ws.recv(timeout=10) == blob
    finally:
        sbx.kill()


def test_four_fork_children_each_serve_their_own_port(stack, sdk_env):
    parent = Sandbox.create(timeout=600)
    children = []
    try:
        parent.commands.run("mkdir -p /tmp/www && cd /tmp/www && "
                            "(python3 -m http.server 8080 >/dev/null 2>&1 &) ; sleep 1", timeout=60)
        children = [c for c in parent.fork(count=4, timeout=300) if not isinstance(c, Exception)]
        assert len(children) == 4
        for child in children:  # each writes its own id where its server (forked, already running) serves
            child.files.write("/tmp/www/who.txt", child.sandbox_id)
        for child in children:
            r = until(lambda: (x := httpx.get(f"{stack.sandbox_url}/who.txt", headers=_headers(child, 8080),
                                               timeout=10)).status_code == 200 and x, f"{child.sandbox_id}:8080")
            assert r.text == child.sandbox_id
    finally:
        for s in [*children, parent]:
            try:
                s.kill()
            except Exception:  # noqa: BLE001
                pass


def test_private_sandbox_needs_its_traffic_token_on_user_ports(stack, sdk_env):
    sbx = Sandbox.create(timeout=600, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token
        sbx.commands.run("mkdir -p /tmp/www && echo private > /tmp/www/p.txt && cd /tmp/www && "
                         "python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        r = httpx.get(f"{stack.sandbox_url}/p.txt", headers=_headers(sbx, 8080), timeout=10)
        assert r.status_code == 403 and "e2b-traffic-access-token" in r.json()["message"]
        wrong = httpx.get(f"{stack.sandbox_url}/p.txt", timeout=10,
                          headers=_headers(sbx, 8080, **{"e2b-traffic-access-token": "nope"}))
        assert wrong.status_code == 403
        ok = until(lambda: (x := httpx.get(f"{stack.sandbox_url}/p.txt", timeout=10, headers=_headers(
            sbx, 8080, **{"e2b-traffic-access-token": token}))).status_code == 200 and x, "the private port")
        assert ok.text == "private\n"
        # envd's own port keeps its own token: the SDK works as ever
        assert sbx.commands.run("echo envd-ok").stdout == "envd-ok\n"
    finally:
        sbx.kill()


HEADERS_ECHO = r'''
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": self.headers.get("Host"), "xfh": self.headers.get("X-Forwarded-Host"),
                           "token": self.headers.get("e2b-traffic-access-token")}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
'''


def test_the_guest_sees_the_host_it_was_asked_for_or_the_masked_one(stack, sdk_env):
    plain = Sandbox.create(timeout=600)
    masked = Sandbox.create(timeout=600, network={"mask_request_host": "custom-host.example.com:${PORT}"})
    try:
        for sbx in (plain, masked):
            sbx.files.write("/tmp/echo_headers.py", HEADERS_ECHO)
            sbx.commands.run("python3 /tmp/echo_headers.py 8080 >/dev/null 2>&1", background=True)
        host = plain.get_host(8080)
        seen = until(lambda: (x := httpx.get(stack.sandbox_url, headers={"Host": host}, timeout=10))
                      .status_code == 200 and x.json(), "the plain sandbox's header echo")
        assert seen["host"] == host and seen["xfh"] is None
        host = masked.get_host(8080)
        seen = until(lambda: (x := httpx.get(stack.sandbox_url, headers={"Host": host}, timeout=10))
                      .status_code == 200 and x.json(), "the masked sandbox's header echo")
        assert seen["host"] == "custom-host.example.com:8080" and seen["xfh"] == host
    finally:
        plain.kill()
        masked.kill()
