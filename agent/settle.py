"""How reconcile settles a sandbox row to what its VM really is: one conditional write
through the state machine (``reconcile`` edges only, and only if the row is exactly as
it was read), and continuing a VM an interrupted pause, snapshot or fork left stopped.
Shared by ``agent.reconcile`` and ``agent.reconcile_snapshots``."""
from __future__ import annotations

from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.transitions import transition_sync

from agent.guest import init_envd


def move(row: Sandbox, to_state: str, actor: str, message: str, details: dict | None = None, **fields) -> bool:
    """Conditional on the row being exactly as we read it (state and updated_at)."""
    event = SandboxEvent(sandbox_id=row.pk, operation="reconcile", outcome="ok", from_state=row.state,
                         started_at=timezone.now(), message=message, details=details or {}, actor=actor)
    return transition_sync(row.pk, [row.state], to_state, event, where={"updated_at": row.updated_at}, **fields)


def continue_vm(driver, row: Sandbox) -> dict:
    """Continues a VM whose pause was interrupted (vCPUs may be stopped) and re-syncs
    its envd (clock, env, token) with the same /init a resume sends."""
    info = driver.resume(row.pk)
    init_envd(info.envd_host, info.envd_port, row.env_vars, row.envd_access_token or None)
    return {"envd_host": info.envd_host, "envd_port": info.envd_port, "guest_host": info.guest_host}
