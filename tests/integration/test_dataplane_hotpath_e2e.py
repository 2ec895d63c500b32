"""The data plane's hot path with a real VM (issue 26): a keep-alive client of a guest's HTTP
server is served by HAProxy after its first answer; the same connection, once the sandbox is
paused, still auto-resumes it (HAProxy hands the request back to the data plane) and is then
served by HAProxy again at the resumed VM's new address; once the sandbox is killed, its
route is gone."""

import httpx
import pytest
from e2b import Sandbox

from harness.polling import until
from tests.unit.test_dataplane_hotpath import map_has, served

pytestmark = pytest.mark.vm


def test_hot_path_keeps_auto_resume_and_follows_the_sandbox(stack, sdk_env):
    home = str(stack.home)
    sbx = Sandbox.create(timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
    # one connection, kept alive, as a browser or an app's client keeps it
    client = httpx.Client(base_url=stack.sandbox_url, headers=headers, timeout=60,
                          limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
    try:
        sbx.files.write("/tmp/www/hello.txt", "hello from the guest")
        # HTTP/1.1 kept alive (python -m http.server answers in HTTP/1.0: not handed off)
        sbx.commands.run("cd /tmp/www && python3 -c 'import http.server as h; "
                         "h.SimpleHTTPRequestHandler.protocol_version = \"HTTP/1.1\"; "
                         "h.ThreadingHTTPServer((\"0.0.0.0\", 8080), h.SimpleHTTPRequestHandler).serve_forever()' "
                         ">/dev/null 2>&1", background=True)
        until(lambda: client.get("/hello.txt").status_code == 200, "the guest's HTTP server", 60)
        port_key = f"{sbx.sandbox_id}_8080"
        until(lambda: map_has(home, "ports.map", port_key), "the sandbox's port in HAProxy", 10)
        before = served(home, "guest")
        for _ in range(4):
            r = client.get("/hello.txt")
            assert r.status_code == 200 and r.text == "hello from the guest"
        assert served(home, "guest") - before >= 3  # the first may still be the data plane's

        assert sbx.pause() is True
        # out once the state write nudges the data plane (or at its next poll): not always
        # before the pause is answered, so waited for
        until(lambda: map_has(home, "ports.map", port_key) is None, "the paused sandbox's port gone", 5)
        back = served(home, "dataplane")
        r = client.get("/hello.txt")  # the same connection: HAProxy hands it to the data plane, which resumes
        assert r.status_code == 200 and r.text == "hello from the guest"
        assert served(home, "dataplane") > back
        assert sbx.get_info().state.value == "running"

        # the resumed VM (a new slot) is served by HAProxy again, on that same connection, never
        # over a guest connection HAProxy opened to the VM before the pause (its requests hung)
        until(lambda: map_has(home, "ports.map", port_key), "the resumed sandbox's port", 10)
        hot = served(home, "guest")
        for _ in range(3):
            assert client.get("/hello.txt").status_code == 200
        assert served(home, "guest") - hot >= 2

        sbx.kill()
        until(lambda: map_has(home, "ports.map", port_key) is None, "the killed sandbox's port gone", 5)
        r = client.get("/hello.txt")
        assert r.status_code == 502 and "was not found" in r.json()["message"]
    finally:
        client.close()
        try:
            sbx.kill()
        except Exception:  # noqa: BLE001 - already killed
            pass
