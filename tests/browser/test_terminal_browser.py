"""The terminal's status line follows the real connection in a real browser: it says
connecting until the server says the shell is attached, connected while it is, reconnecting
(and re-attaches to the same shell) when the server drops the socket, and closed, with
the reason, when the shell exits. Screenshots of each state are saved."""
import contextlib
import re
import time

import httpx
import pytest

from harness.stack import PY

from .test_dashboard_browser import create_sandbox, shot, sign_in, terminal_text, type_and_expect

pytestmark = pytest.mark.vm

STATUS = "[data-terminal-status]"
PROMPT = "() => /\\$\\s*$/m.test(document.querySelector('[data-terminal-screen] .xterm-rows').innerText)"

# Records every change of the status line: (data-status, text), in order.
RECORD_STATUS = """
window.__terminalStatus = [];
document.addEventListener("DOMContentLoaded", function () {
  var el = document.querySelector("[data-terminal-status]");
  if (!el) return;
  function note() {
    var last = window.__terminalStatus[window.__terminalStatus.length - 1];
    var now = [el.getAttribute("data-status"), el.textContent];
    if (!last || last[0] !== now[0] || last[1] !== now[1]) window.__terminalStatus.push(now);
  }
  note();
  new MutationObserver(note).observe(el, {attributes: true, childList: true, characterData: true, subtree: true});
});
"""


def states(page) -> list[str]:
    """The status line's states so far, repeats folded."""
    out = []
    for state, _ in page.evaluate("window.__terminalStatus"):
        if not out or out[-1] != state:
            out.append(state)
    return out


def wait_status(page, state: str, timeout: float = 60_000) -> str:
    page.wait_for_selector(f'{STATUS}[data-status="{state}"]', timeout=timeout)
    return page.inner_text(STATUS)


@contextlib.contextmanager
def api_down(stack):
    """daphne stopped, as a deploy or a crash does (every socket drops), then started again
    on the same port with the same database (sessions survive)."""
    port = stack.api_url.rsplit(":", 1)[1]
    stack.stop("api")
    try:
        yield
    finally:
        stack._spawn("api", [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", port, "config.asgi:application"])
        stack._wait_http(f"{stack.api_url}/health", "api")


def test_terminal_status_connecting_connected_reconnecting_closed(page, web_stack, shots_dir):
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.add_init_script(RECORD_STATUS)
    sign_in(page)
    sandbox_id = create_sandbox(page, "case=terminal-status")
    try:
        # The prompt is on screen: the status says connected (and it said connecting before).
        page.wait_for_function(PROMPT, timeout=60_000)
        assert page.get_attribute(STATUS, "data-status") == "connected", page.evaluate("window.__terminalStatus")
        text = page.inner_text(STATUS)
        pid = page.get_attribute(STATUS, "data-pid")
        assert re.fullmatch(r"\d+", pid or ""), text
        assert text == f"connected · shell pid {pid}"
        assert states(page) == ["connecting", "connected"], page.evaluate("window.__terminalStatus")
        assert page.is_hidden("[data-terminal-reconnect]")
        type_and_expect(page, "export MARK=$((6*7)); echo set-$MARK", "set-42")
        shot(page, shots_dir, "20-terminal-connected")

        # The server drops the socket: reconnecting while it is away, then the same shell again.
        with api_down(web_stack):
            text = wait_status(page, "reconnecting", timeout=30_000)
            assert text.startswith("reconnecting…"), text
            assert page.is_visible("[data-terminal-reconnect]")  # "retry now"
            time.sleep(2)  # a failed try keeps it reconnecting, not closed
            assert page.get_attribute(STATUS, "data-status") == "reconnecting"
            shot(page, shots_dir, "21-terminal-reconnecting")
        text = wait_status(page, "connected", timeout=60_000)
        assert text == f"connected · reattached to shell pid {pid}"
        assert page.get_attribute(STATUS, "data-pid") == pid
        assert page.is_hidden("[data-terminal-reconnect]")
        seen = states(page)
        assert seen[:2] == ["connecting", "connected"] and seen[-1] == "connected", seen
        assert "closed" not in seen and "reconnecting" in seen, seen
        type_and_expect(page, "echo mark-$MARK", "mark-42")  # the same shell: its variable is there
        shot(page, shots_dir, "22-terminal-reattached")

        # The shell exits: closed with the reason, and no retries (a new shell is a click away).
        page.click("[data-terminal-screen]")
        page.keyboard.type("exit")
        page.keyboard.press("Enter")
        text = wait_status(page, "closed", timeout=30_000)
        assert text == "closed: shell exited (exit code 0)"
        assert page.get_attribute(STATUS, "data-close-code") == "4000"
        assert page.inner_text("[data-terminal-reconnect]") == "New shell"
        assert "[shell exited with code 0]" in terminal_text(page)
        time.sleep(3)
        assert page.get_attribute(STATUS, "data-status") == "closed"
        shot(page, shots_dir, "23-terminal-exited")
        page.click("[data-terminal-reconnect]")
        text = wait_status(page, "connected")
        assert re.fullmatch(r"connected · shell pid \d+", text) and page.get_attribute(STATUS, "data-pid") != pid
    finally:
        httpx.delete(f"{web_stack.api_url}/sandboxes/{sandbox_id}", headers=web_stack.headers(), timeout=120)
    # The sandbox is gone: closed with the server's reason.
    text = wait_status(page, "closed", timeout=30_000)
    assert text == "closed: sandbox was killed"
    assert page.get_attribute(STATUS, "data-close-code") == "4409"
    assert errors == []
