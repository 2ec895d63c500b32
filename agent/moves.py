"""Paused sandboxes that can move: with a shared snapshot store (S3), a sandbox paused to
disk with its memory is also exported to the store (``VMDriver.export_saved``) as
``pause-<sandbox id>``: in the background once it has stayed paused a while, and at once
when its node stops (``agent.shutdown``). If its node is gone,
drained or full when it is resumed, the control plane restores that image on another node
under the same id (``lifecycle.sandboxes.pause``), and the sandbox continues there.

The image is the sandbox's latest pause: a new pause replaces it, a kill deletes it, a
resume leaves it (stale, never used: only a paused row whose ``pause_image_at`` is newer
than its last resume points at it)."""
from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections
from django.utils import timezone

from nodes import protocol

log = logging.getLogger(__name__)


image_id = protocol.pause_image_of


def shared_store() -> bool:
    from agent.stores import backend_name  # noqa: PLC0415

    return backend_name() == "s3"


def export_now(driver, store, sandbox_id: str) -> bool:
    """Exports the saved VM to the store and records it on the row (only while it is still
    paused); False if it is not paused with a movable memory any more."""
    from sandboxes.models import Sandbox
    from sandboxes.states import SandboxState as S
    from vmm.driver import VMError

    sid = image_id(sandbox_id)
    store.delete(sid)  # the previous pause's
    dest = store.prepare(sid)
    try:
        driver.export_saved(sandbox_id, dest)
        store.commit(sid)
    except VMError as exc:
        store.delete(sid)
        log.info("sandbox %s stays on this node while paused: %s", sandbox_id, exc)
        return False
    except BaseException:
        store.delete(sid)
        raise
    store.drop_local(sid)  # the node keeps the VM itself; the store's copy is for the others
    if not Sandbox.objects.filter(pk=sandbox_id, state=S.PAUSED).update(pause_image_at=timezone.now()):
        store.delete(sid)  # resumed or killed meanwhile
        return False
    return True


def export_later(driver, store, sandbox_id: str, delay: float | None = None) -> threading.Thread:
    """After ``delay`` (``AENV_PAUSE_EXPORT_DELAY``) and only if it is still paused then: a
    sandbox paused and resumed again soon (an agent's quick pause / resume cycles) is never
    exported, and no resume waits for an export holding its VM."""
    from django.conf import settings  # noqa: PLC0415

    from sandboxes.models import Sandbox  # noqa: PLC0415
    from sandboxes.states import SandboxState as S  # noqa: PLC0415

    delay = settings.AENV_PAUSE_EXPORT_DELAY if delay is None else delay

    def run() -> None:
        try:
            time.sleep(delay)
            if not Sandbox.objects.filter(pk=sandbox_id, state=S.PAUSED).exists():
                return
            driver.settle(600)  # its memory on disk first, so the export reads it from there
            if export_now(driver, store, sandbox_id):
                log.info("sandbox %s: pause exported to the store (movable)", sandbox_id)
        except Exception:  # noqa: BLE001 - it stays resumable on this node
            log.exception("sandbox %s: exporting its pause to the store failed", sandbox_id)
        finally:
            close_old_connections()

    thread = threading.Thread(target=run, name=f"export-{sandbox_id}", daemon=True)
    thread.start()
    return thread


def forget(store, sandbox_id: str) -> None:
    """A killed sandbox's image goes too."""
    try:
        store.delete(image_id(sandbox_id))
    except Exception:  # noqa: BLE001 - leaked chunks, never lost data
        log.exception("sandbox %s: deleting its pause image failed", sandbox_id)
