"""The Volumes pages in a real browser against a real stack: create a volume (a duplicate name
refused inline), upload a file into it, a sandbox (a real VM mounting the volume) reads it and
writes a file and a symlink, the page lists them (the symlink with its target, not followed)
and downloads the guest's file; deleting the volume while the sandbox runs shows the API's 409
inline and keeps it; once the sandbox is killed the delete goes through."""
import re
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox

from .test_dashboard_browser import shot, sign_in

pytestmark = pytest.mark.vm

VOLUME_URL = re.compile(r".*/dashboard/volumes/([0-9a-f-]{36})/$")


def test_create_upload_browse_download_and_delete(page, web_stack, shots_dir, monkeypatch):
    page.on("dialog", lambda dialog: dialog.accept())  # the delete's confirmation
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    for name, value in (("E2B_API_URL", web_stack.api_url), ("E2B_SANDBOX_URL", web_stack.sandbox_url),
                        ("E2B_API_KEY", web_stack.api_key)):
        monkeypatch.setenv(name, value)
    sign_in(page)

    page.click("nav a:has-text('Volumes')")
    page.wait_for_url("**/dashboard/volumes/")
    name = f"vol-{uuid.uuid4().hex[:8]}"
    page.fill("[data-volume-create] input[name=name]", name)
    page.click("button[data-action=create-volume]")
    page.wait_for_url(VOLUME_URL)
    volume_id = VOLUME_URL.match(page.url).group(1)
    assert name in page.inner_text("[data-volume-facts]") and "no live sandbox" in page.inner_text(
        "[data-volume-users]")

    page.goto("/dashboard/volumes/")
    page.fill("[data-volume-create] input[name=name]", name)
    page.click("button[data-action=create-volume]")
    page.wait_for_selector("[data-action-result][data-level=error]")
    assert f"Volume with name '{name}' already exists" in page.inner_text("[data-action-result]")

    page.click(f"tr[data-volume='{volume_id}'] a:has-text('{name}')")
    page.wait_for_url(VOLUME_URL)
    page.set_input_files("[data-volume-upload] input[name=file]",
                         files=[{"name": "hello.txt", "mimeType": "text/plain", "buffer": b"from the browser\n"}])
    page.click("button[data-action=upload]")
    page.wait_for_selector('[data-entry="hello.txt"][data-type="file"]')

    sbx = Sandbox.create(volume_mounts={"/home/user/data": name}, timeout=600)
    try:
        assert sbx.commands.run("cat /home/user/data/hello.txt").stdout == "from the browser\n"
        sbx.commands.run("mkdir -p /home/user/data/out && echo from-the-guest > /home/user/data/out/guest.txt"
                         " && ln -s /etc /home/user/data/etc-link")
        page.goto(f"/dashboard/volumes/{volume_id}/")
        assert sbx.sandbox_id in page.inner_text("[data-volume-users]")
        assert "/home/user/data" in page.inner_text("[data-volume-users]")
        link = page.locator('[data-entry="etc-link"]')
        assert link.get_attribute("data-type") == "symlink" and "→ /etc" in link.inner_text()
        assert link.locator("a").count() == 0  # listed, never entered
        page.click('[data-entry="out"] a')
        page.wait_for_selector('[data-entry="guest.txt"]')
        assert page.inner_text("[data-volume-path]").strip() == "/out"
        with page.expect_download() as download:
            page.click('[data-entry="guest.txt"] [data-action=download]')
        assert download.value.suggested_filename == "guest.txt"
        assert Path(download.value.path()).read_text() == "from-the-guest\n"
        shot(page, shots_dir, "16-volume-files")

        page.goto("/dashboard/volumes/")
        row = page.locator(f"tr[data-volume='{volume_id}']")
        assert sbx.sandbox_id in row.inner_text()
        row.locator("button[data-action=delete-volume]").click()
        page.wait_for_selector("[data-action-result][data-level=error]", timeout=60_000)
        assert f"is mounted by sandbox(es) {sbx.sandbox_id}; kill them first" in page.inner_text(
            "[data-action-result]")
        shot(page, shots_dir, "17-volumes-delete-refused")
    finally:
        sbx.kill()

    page.goto("/dashboard/volumes/")
    page.click(f"tr[data-volume='{volume_id}'] button[data-action=delete-volume]")
    page.wait_for_selector(f"tr[data-volume='{volume_id}']", state="detached", timeout=60_000)
    assert errors == []
    assert web_stack.vm_leftovers()["processes"] == []
