"""What a new user of the unchanged E2B SDK runs into, with real VMs through the whole stack:
signed file URLs behind ``E2B_SANDBOX_URL`` and with host routing, a kill while a
background command is waited on, ``pause(strict=True)`` on a guest whose envd does not
answer, and the sandbox logs the E2B CLI reads."""
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from e2b import GuestUnresponsiveException, Sandbox, ServiceBusyException
from e2b.exceptions import SandboxNotRunningException, TimeoutException

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sandbox(stack):
    """One sandbox shared by the module's read-mostly tests (every sandbox is secured: its
    file URLs are signed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", stack.api_url)
        mp.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
        mp.setenv("E2B_API_KEY", stack.api_key)
        mp.delenv("E2B_DEBUG", raising=False)
        sbx = Sandbox.create(timeout=600)
        yield sbx
        sbx.kill()


# --------------------------------------------------------------------------- signed file URLs


def test_signed_urls_behind_e2b_sandbox_url(sandbox, stack):
    """``download_url`` / ``upload_url`` are ``{E2B_SANDBOX_URL}/files?…&signature=…``: no
    sandbox id anywhere, fetched by a plain HTTP client (a browser, curl) as they are."""
    sandbox.files.write("/home/user/signed.txt", "signed content")
    url = sandbox.download_url("/home/user/signed.txt")
    assert url.startswith(stack.sandbox_url + "/files?") and sandbox.sandbox_id not in url
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "signed content"

    up = sandbox.upload_url("/home/user/uploaded.txt", user="root", use_signature_expiration=60)
    r = httpx.post(up, files={"file": ("uploaded.txt", b"via a signed URL")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == "/home/user/uploaded.txt"
    assert sandbox.files.read("/home/user/uploaded.txt") == "via a signed URL"
    assert sandbox.commands.run("stat -c %U /home/user/uploaded.txt").stdout.strip() == "root"

    expired = httpx.get(sandbox.download_url("/home/user/signed.txt", use_signature_expiration=-10))
    assert expired.status_code == 401 and expired.json() == {"code": 401, "message": "signature is already expired"}
    forged = url.replace("signature=v1_", "signature=v1_X")
    bad = httpx.get(forged)
    assert bad.status_code == 401 and bad.json() == {"code": 401, "message": "invalid signature"}
    # a read signature opens no write door
    wrong_op = httpx.post(url, files={"file": ("signed.txt", b"overwritten")})
    assert wrong_op.status_code == 401 and wrong_op.json()["message"] == "invalid signature"
    assert sandbox.files.read("/home/user/signed.txt") == "signed content"


def test_signed_urls_with_host_routing(sandbox, stack):
    """Without ``E2B_SANDBOX_URL`` the SDK makes ``https://49983-{id}.{domain}/files?…``;
    sent to the data plane with that Host (as an ingress terminating TLS would)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("E2B_SANDBOX_URL")
        direct = Sandbox.connect(sandbox.sandbox_id)
    url = direct.download_url("/home/user/host.txt", use_signature_expiration=60)
    parts = urlsplit(url)
    assert parts.netloc == f"49983-{sandbox.sandbox_id}.{direct.sandbox_domain}", url
    plane = urlsplit(stack.sandbox_url)
    via_plane = urlunsplit((plane.scheme, plane.netloc, parts.path, parts.query, ""))
    sandbox.files.write("/home/user/host.txt", "by host")
    r = httpx.get(via_plane, headers={"Host": parts.netloc})
    assert r.status_code == 200 and r.text == "by host"
    up = urlsplit(direct.upload_url("/home/user/host-up.txt"))
    r = httpx.post(urlunsplit((plane.scheme, plane.netloc, up.path, up.query, "")),
                   headers={"Host": up.netloc}, files={"file": ("x", b"host upload")})
    assert r.status_code == 200 and sandbox.files.read("/home/user/host-up.txt") == "host upload"
    expired = urlsplit(direct.download_url("/home/user/host.txt", use_signature_expiration=-10))
    r = httpx.get(urlunsplit((plane.scheme, plane.netloc, expired.path, expired.query, "")),
                  headers={"Host": expired.netloc})
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
    r = httpx.get(via_plane.replace("signature=v1_", "signature=v1_X"), headers={"Host": parts.netloc})
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "invalid signature"}


# --------------------------------------------------------------------------- kill while waiting


def test_kill_while_waiting_on_a_background_command(stack, sdk_env):
    """``commands.run(..., background=True).wait()`` streams the command's events; a kill
    meanwhile ends that stream at once (not at a body-read timeout), the SDK probes
    ``/health`` and reports the sandbox gone."""
    sbx = Sandbox.create(timeout=300)
    handle = sbx.commands.run("echo started; sleep 300", background=True)
    outcome: dict = {}

    def wait():
        try:
            outcome["result"] = handle.wait()
        except Exception as exc:  # noqa: BLE001 - what the SDK raised is the point
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive()
    killed_at = time.monotonic()
    assert sbx.kill() is True
    waiter.join(30)
    assert not waiter.is_alive(), "wait() still hangs 30 s after the kill"
    error = outcome.get("error")
    assert isinstance(error, SandboxNotRunningException) and isinstance(error, TimeoutException), repr(outcome)
    assert "sandbox was killed or reached its end of life" in str(error), str(error)
    print(f"wait() raised {outcome['at'] - killed_at:.2f} s after the kill: {error}")
    assert outcome["at"] - killed_at < 10


# --------------------------------------------------------------------------- pause(strict=True)


def _stop_envd(sbx, seconds: int | None) -> None:
    """SIGSTOPs the sandbox's envd (the parent of the commands it runs) a second from now,
    and SIGCONTs it ``seconds`` later (never if None): a guest whose agent does not answer."""
    pid = sbx.commands.run("echo $PPID").stdout.strip()
    assert pid.isdigit()
    resume = f"; sleep {seconds}; kill -CONT {pid}" if seconds else ""
    sbx.commands.run(f"setsid sh -c 'sleep 1; kill -STOP {pid}{resume}' </dev/null >/dev/null 2>&1 &", user="root")
    time.sleep(2)


def _wait_answering(sbx, within: float) -> None:
    deadline = time.monotonic() + within
    while not sbx.is_running():
        assert time.monotonic() < deadline, "envd did not answer again"
        time.sleep(0.5)


def test_strict_pause_needs_an_answering_guest(stack, sdk_env):
    """E2B (SDK 2.63): ``pause(strict=True)`` of a sandbox whose guest agent does not answer
    is refused with 503 (ServiceBusyException) and it keeps running, as is a filesystem-only
    pause; a plain pause keeps the memory anyway and marks it (envdUnresponsiveAtPause), and
    such a sandbox resumes only with ``on_resume="reboot"`` (409, GuestUnresponsiveException)."""
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/kept.txt", "on disk")
        sbx.commands.run("sync")
        # the SDK retries a 503 a few times (each attempt: the node's 2 x 2 s probe): the agent
        # stays stopped long enough for both calls and all their retries
        _stop_envd(sbx, seconds=50)
        stopped_at = time.monotonic()
        with pytest.raises(ServiceBusyException, match="does not answer"):
            sbx.pause(strict=True)
        with pytest.raises(ServiceBusyException, match="does not answer"):
            sbx.pause(mode="filesystem")
        assert time.monotonic() - stopped_at < 45, "the refusals took too long to prove anything"
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        _wait_answering(sbx, within=90)
        assert sbx.pause(strict=True) is True  # answering: paused
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /home/user/kept.txt").stdout == "on disk"

        _stop_envd(again, seconds=None)
        assert again.pause() is True
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state.value == "paused" and info.envd_unresponsive_at_pause is True
        with pytest.raises(GuestUnresponsiveException, match='on_resume="reboot"'):
            Sandbox.connect(sbx.sandbox_id)
        rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
        assert rebooted.commands.run("cat /home/user/kept.txt").stdout == "on disk"
        assert Sandbox.get_info(sbx.sandbox_id).envd_unresponsive_at_pause is None
    finally:
        Sandbox.kill(sbx.sandbox_id)


# --------------------------------------------------------------------------- sandbox logs


def _api():
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig

    return get_api_client(ConnectionConfig())


def _v1_lines(sandbox_id: str, start: int | None = None) -> list:
    """E2B's v1 logs through the SDK's generated client, parsed by its models."""
    from e2b.api.client.api.sandboxes import get_sandboxes_sandbox_id_logs
    from e2b.api.client.types import UNSET

    res = get_sandboxes_sandbox_id_logs.sync_detailed(sandbox_id, client=_api(), start=UNSET if start is None else start)
    assert res.status_code == 200, res.content
    return res.parsed.log_entries


def _wait_for_line(sandbox_id: str, text: str, within: float = 20.0):
    deadline = time.monotonic() + within
    while True:
        found = [e for e in _v1_lines(sandbox_id) if text in e.message]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{text!r} never reached the logs"
        time.sleep(0.5)


def test_sandbox_logs_running_paused_resumed_and_killed(stack, sdk_env):
    """The guest console (kernel, guest init, envd, anything written to /dev/console) is
    collected by the node and served as E2B's v1 and v2 logs, for a running, a paused, a
    resumed and a killed sandbox; lines written just before a pause are not lost."""
    from e2b.api.client.api.sandboxes import get_v_2_sandboxes_sandbox_id_logs
    from e2b.api.client.models.log_level import LogLevel
    from e2b.api.client.models.logs_direction import LogsDirection

    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    sbx.commands.run("echo aenv-logs-running > /dev/console", user="root")
    line = _wait_for_line(sid, "aenv-logs-running")
    assert line.level.value == "info" and line.fields["source"] == "console"
    envd_lines = [e for e in _v1_lines(sid) if e.fields["source"] == "envd"]
    assert envd_lines, "no envd line (its /init logs the entropy it was given)"

    sbx.commands.run("echo aenv-logs-before-pause > /dev/console", user="root")
    assert sbx.pause() is True  # no wait for a collection round: the pause reads the console first
    assert any("aenv-logs-before-pause" in e.message for e in _v1_lines(sid))

    again = Sandbox.connect(sid)
    again.commands.run("echo aenv-logs-after-resume > /dev/console", user="root")
    resumed = _wait_for_line(sid, "aenv-logs-after-resume")
    messages = [e.message for e in _v1_lines(sid)]
    assert messages.index("aenv-logs-running") < messages.index("aenv-logs-before-pause") \
        < messages.index("aenv-logs-after-resume")
    later = _v1_lines(sid, start=int(resumed.timestamp.timestamp() * 1000))
    assert later[0].message == "aenv-logs-after-resume"

    again.kill()
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(sid, client=_api(), search="aenv-logs-",
                                                          direction=LogsDirection.BACKWARD, level=LogLevel.INFO)
    assert res.status_code == 200, res.content
    assert [e.message for e in res.parsed.logs] == ["aenv-logs-after-resume", "aenv-logs-before-pause",
                                                    "aenv-logs-running"]
