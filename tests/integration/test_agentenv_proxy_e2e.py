"""AgentENV's proxy contract with a real VM (issue 20 item 3): an HTTP server in the guest
reached with ``x-agentenv-sandbox-id`` / ``x-agentenv-target-port`` on the data plane's
port and at ``/proxy`` on the API's (daphne); envd called as AgentENV's ``aenv`` calls it
(the API's URL, the headers, no prefix), its stream read through daphne; and once the
sandbox is paused without autoResume, AgentENV's 410 on both while E2B's headers still get
E2B's 502."""
import base64
import time

import httpx
import pytest
from e2b import Sandbox

from envd.wire import FLAG_END_STREAM, EnvelopeReader, decode_json, encode_json, envelope

pytestmark = pytest.mark.vm


def _agentenv(sbx, port: int) -> dict:
    return {"x-agentenv-sandbox-id": sbx.sandbox_id, "x-agentenv-target-port": str(port)}


def _until_ok(get, what: str, deadline: float = 30) -> httpx.Response:
    end = time.monotonic() + deadline
    while True:
        try:
            r = get()
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.3)


def _run_through_api(stack, sbx, cmd: str, *args: str) -> tuple[str, list[dict]]:
    """envd's Process.Start at the API's URL with AgentENV's headers and no ``/proxy``
    (as AgentENV's ``aenv exec`` calls it, with the secured sandbox's token): the stdout
    and the events read from the stream."""
    body = envelope(encode_json({"process": {"cmd": cmd, "args": list(args)}}))
    headers = {**_agentenv(sbx, 49983), "content-type": "application/connect+json", "connect-protocol-version": "1",
               "x-access-token": sbx._envd_access_token}
    reader, events, stdout = EnvelopeReader(), [], b""
    with httpx.stream("POST", f"{stack.api_url}/process.Process/Start", content=body, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            for flags, payload in reader.feed(chunk):
                if flags & FLAG_END_STREAM:
                    continue
                event = decode_json(payload).get("event", {})
                events.append(event)
                stdout += base64.b64decode(event.get("data", {}).get("stdout", ""))
    return stdout.decode(), events


def test_agentenv_headers_and_api_proxy_reach_a_guest_server(stack, sdk_env):
    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/tmp/www/hello.txt", "hello from the guest")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        # the data plane's port, AgentENV's headers
        r = _until_ok(lambda: httpx.get(f"{stack.sandbox_url}/hello.txt", headers=_agentenv(sbx, 8080), timeout=10),
                      "the guest's HTTP server (x-agentenv headers)")
        assert r.text == "hello from the guest"
        # the API's port (daphne), /proxy: the prefix is not forwarded
        r = httpx.get(f"{stack.api_url}/proxy/hello.txt", headers=_agentenv(sbx, 8080), timeout=10)
        assert r.status_code == 200 and r.text == "hello from the guest"
        r = httpx.get(f"{stack.api_url}/proxy/health", headers=_agentenv(sbx, 49983), timeout=10)
        assert r.status_code == 204  # envd's /health (the API's own /health has no prefix)
        r = httpx.get(f"{stack.api_url}/proxy/hello.txt", timeout=10)
        assert r.status_code == 400 and r.json() == {"code": 400, "message": "missing sandbox routing header"}
        # envd as AgentENV's aenv calls it: the API's URL, the headers, no prefix; streamed back
        assert sbx._envd_access_token  # the SDK's sandboxes are secured: no token, 401
        r = httpx.post(f"{stack.api_url}/process.Process/List", content=b"{}", timeout=10,
                       headers={**_agentenv(sbx, 49983), "content-type": "application/json"})
        assert r.status_code == 401, r.text
        stdout, events = _run_through_api(stack, sbx, "/bin/sh", "-c", "echo one; sleep 1; echo two")
        assert stdout == "one\ntwo\n" and "end" in events[-1], events

        assert sbx.pause() is True
        for url in (f"{stack.api_url}/proxy/hello.txt", f"{stack.sandbox_url}/hello.txt"):
            r = httpx.get(url, headers=_agentenv(sbx, 8080), timeout=30)
            assert r.status_code == 410, (url, r.text)
            assert r.json()["message"] == "sandbox is not proxyable in its current state (paused)"
        r = httpx.get(f"{stack.sandbox_url}/hello.txt", timeout=30,
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"})
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
    finally:
        sbx.kill()
