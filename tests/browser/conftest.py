"""Browser tests: Playwright drives Debian's Chromium (headless) against a real aenv
stack (daphne + uvicorn + node worker + QEMU VMs, harness/stack.py).

Needs ``/usr/bin/chromium`` and the xterm.js packages (both installed by
``scripts/setup_frontend.sh``, which ``scripts/setup.sh`` runs). Without chromium the
tests are skipped with that reason; without xterm.js they fail (it is part of the app).
Screenshots of every page go to ``var/artifacts/screenshots/dashboard/`` (git-ignored,
replaced by each run; ``AENV_SCREENSHOTS_DIR`` moves them)."""
import contextlib
import os
import shutil
import uuid
from pathlib import Path

import pytest

from harness.stack import ROOT, Stack, remove_test_home

CHROMIUM = Path(os.environ.get("AENV_CHROMIUM", "/usr/bin/chromium"))
XTERM = ROOT / "vendor" / "node_modules" / "@xterm" / "xterm" / "lib" / "xterm.js"
PASSWORD = "pw-browser-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (scripts/setup_frontend.sh installs Debian's chromium)")
    assert XTERM.exists(), f"{XTERM} is missing: run scripts/setup_frontend.sh (installs xterm.js from npm)"
    return CHROMIUM


@pytest.fixture(scope="session")
def shots_dir() -> Path:
    """The last run's screenshots (replaced by every run, so they never pile up)."""
    path = Path(os.environ.get("AENV_SCREENSHOTS_DIR") or ROOT / "var" / "artifacts" / "screenshots" / "dashboard")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots: {path}")
    return path


@contextlib.contextmanager
def dashboard_stack(prefix: str, username: str, password: str, **kwargs):
    """A real stack whose daphne serves collected static files (like a deployment), with a
    dashboard sign-in ``username`` / ``password`` of the default team; ``kwargs`` go to Stack."""
    home = ROOT / "var" / "test-runs" / f"{prefix}-{uuid.uuid4().hex[:8]}"
    stack = Stack(home=home, **kwargs)
    try:
        stack.home.mkdir(parents=True, exist_ok=True)
        stack.manage("collectstatic", "--noinput", "-v", "0")
        stack.start()
        stack.manage("create_dashboard_user", "--username", username, "--team", "default", "--password", password)
        yield stack
    finally:
        stack.shutdown()
        remove_test_home(home)


@pytest.fixture(scope="session")
def web_stack(chromium_path):
    with dashboard_stack("browser", "ada", PASSWORD) as stack:
        yield stack


@pytest.fixture(scope="module")
def browser(chromium_path):
    """Module-scoped on purpose: while Playwright's sync API is active it owns a running
    event loop in the main thread, and pytest-asyncio tests collected after this package
    (tests/envd, ...) could not start theirs."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(chromium_path), headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def csp_violations(pg) -> list[str]:
    """The page's Content-Security-Policy violations as they happen (Chromium logs each as a
    console error): the dashboard must work under its policy (config.security_headers),
    so a test's page fixture fails the test on any."""
    seen: list[str] = []
    pg.on("console", lambda m: seen.append(m.text) if m.type == "error" and "Content Security Policy" in m.text
          else None)
    return seen


@contextlib.contextmanager
def dashboard_page(browser, stack):
    """A page of a fresh browser context on ``stack``'s API URL; the block fails on any CSP
    violation the page saw."""
    context = browser.new_context(viewport={"width": 1360, "height": 1000}, base_url=stack.api_url)
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    violations = csp_violations(pg)
    try:
        yield pg
    finally:
        context.close()
    assert violations == [], violations


@pytest.fixture
def page(browser, web_stack):
    with dashboard_page(browser, web_stack) as pg:
        yield pg
