"""The dashboard in a real browser against a real stack: sign in, create a sandbox
from the dashboard (a real VM boots), type ``echo hello-$RANDOM`` in the xterm.js
terminal and see the shell's output, pause (the terminal closes saying why and the
state changes without a reload), resume (the terminal re-attaches to the same
shell), visit every page, kill. A screenshot of every page is saved."""
import re

import pytest

from .conftest import PASSWORD

pytestmark = pytest.mark.vm

SANDBOX_URL = re.compile(r".*/dashboard/sandboxes/(i[a-z0-9]+)/$")


def shot(page, shots_dir, name: str) -> None:
    path = shots_dir / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def terminal_text(page) -> str:
    return page.eval_on_selector("[data-terminal-screen] .xterm-rows", "el => el.innerText")


def wait_badge(page, state: str, timeout: float = 120_000) -> None:
    page.wait_for_selector(f'[data-live-region="badge"] .badge-{state}', timeout=timeout)


def test_sign_in_terminal_pause_resume_kill(page, web_stack, shots_dir):
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmations of pause and kill
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # Sign in.
    page.goto("/dashboard/")
    assert "/dashboard/login/" in page.url
    shot(page, shots_dir, "01-login")
    page.fill("input[name=username]", "ada")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/")
    shot(page, shots_dir, "02-overview")

    # Create a sandbox from the dashboard: the page goes to it once the VM runs.
    page.click("nav a:has-text('Sandboxes')")
    page.wait_for_url("**/dashboard/sandboxes/")
    shot(page, shots_dir, "03-sandboxes-empty")
    page.select_option("[data-create-form] select[name=template]", "base")
    page.fill("[data-create-form] input[name=metadata]", "owner=ada")
    page.click("[data-create-form] button[data-action=create]")
    page.wait_for_url(SANDBOX_URL, timeout=300_000)
    sandbox_id = SANDBOX_URL.match(page.url).group(1)
    wait_badge(page, "running")

    # The terminal: a real shell in the VM.
    status = page.locator("[data-terminal-status]")
    page.wait_for_selector('[data-terminal-status][data-status="open"]', timeout=60_000)
    assert re.match(r"connected to shell pid \d+", status.inner_text())
    pid = status.inner_text().rsplit(" ", 1)[1]
    page.click("[data-terminal-screen]")
    page.keyboard.type("echo hello-$RANDOM")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => /^hello-\\d+\\s*$/m.test(document.querySelector('[data-terminal-screen] .xterm-rows').innerText)",
        timeout=60_000)
    assert re.search(r"^hello-\d+\s*$", terminal_text(page), re.M)  # output, not just the typed line
    shot(page, shots_dir, "04-sandbox-terminal")

    # Pause: confirmation, inline result, state changes live, terminal closes with a reason.
    page.click("button[data-action=pause]")
    page.wait_for_selector("[data-action-result][data-level=success]", timeout=300_000)
    assert f"Sandbox {sandbox_id} paused." in page.inner_text("[data-action-result]")
    wait_badge(page, "paused", timeout=30_000)
    page.wait_for_selector('[data-terminal-status][data-close-code="4409"]', timeout=30_000)
    assert "sandbox is paused: resume it to use the terminal" in status.inner_text()
    assert page.locator("button[data-action=resume]").is_visible()
    shot(page, shots_dir, "05-sandbox-paused")

    # Resume: the terminal re-attaches to the same shell (its memory was paused too).
    page.click("button[data-action=resume]")
    wait_badge(page, "running", timeout=300_000)
    page.wait_for_function(
        "() => /reattached to shell pid/.test(document.querySelector('[data-terminal-status]').innerText)",
        timeout=60_000)
    assert status.inner_text() == f"reattached to shell pid {pid}"

    # Every other page, with the sandbox in it.
    page.goto("/dashboard/sandboxes/")
    page.wait_for_selector(f"text={sandbox_id}")
    assert "owner=ada" in page.inner_text("[data-sandbox-table]")
    shot(page, shots_dir, "06-sandboxes")
    for path, name in (("/dashboard/", "07-overview-busy"), ("/dashboard/snapshots/", "08-snapshots"),
                       ("/dashboard/templates/", "09-templates"), ("/dashboard/nodes/", "10-nodes"),
                       ("/dashboard/api-keys/", "11-api-keys")):
        page.goto(path)
        shot(page, shots_dir, name)
    page.goto("/admin/")
    shot(page, shots_dir, "12-admin-login")

    # Kill: the terminal closes saying so; the list shows it killed without a reload.
    page.goto(f"/dashboard/sandboxes/{sandbox_id}/")
    page.wait_for_selector('[data-terminal-status][data-status="open"]', timeout=60_000)
    page.click("button[data-action=kill]")
    wait_badge(page, "killed", timeout=120_000)
    page.wait_for_selector('[data-terminal-status][data-status="closed"]', timeout=30_000)
    assert "sandbox was killed" in status.inner_text()
    shot(page, shots_dir, "13-sandbox-killed")
    assert errors == []
    assert web_stack.vm_leftovers()["processes"] == []
