"""Kill: ``→ killing`` (durable), the node kills the VM, ``→ killed``.

If the node cannot confirm within AENV_KILL_DEADLINE (dead node, broker down) the
sandbox is still recorded ``killed`` — the user asked for it, and it must stop being
served — with the failure in ``error_reason`` and the event, so the node reconciles the
orphan VM when it comes back."""
from __future__ import annotations

import logging
import time

from django.conf import settings
from django.utils import timezone

from nodes.models import Node
from sandboxes.models import Sandbox, Team
from sandboxes.states import KILLABLE
from lifecycle.sandboxes import core
from lifecycle.sandboxes.core import S
from sandboxes.errors import Conflict, NotFound

log = logging.getLogger(__name__)


async def kill_sandbox(team: Team, sandbox_id: str, actor: str = "", *, from_states=None,
                       where: dict | None = None, reason: str = "") -> Sandbox:
    """Kills a sandbox. Unknown, already killed or another team's sandbox: NotFound;
    of two concurrent kills exactly one wins, the other gets NotFound.

    The lifecycle sweeper narrows the start condition (``from_states`` / ``where``,
    e.g. "running and still expired") and names its ``reason``; if the condition no
    longer holds the kill does not happen (Conflict)."""
    sandbox = await core.visible(team, sandbox_id)
    t0, started = time.monotonic(), timezone.now()
    if sandbox.state == S.KILLING:
        raise NotFound(f'sandbox "{sandbox_id}" not found (already being killed)')
    details = {"reason": reason} if reason else {}
    begun = core.event(sandbox_id, "kill", outcome="started", from_state=sandbox.state, actor=actor, details=details)
    if not await core.transition(sandbox_id, from_states or KILLABLE, S.KILLING, begun, where=where):
        if from_states or where:
            raise Conflict(f'sandbox "{sandbox_id}" changed meanwhile; not killed')
        raise NotFound(f'sandbox "{sandbox_id}" not found (already being killed)')

    node_id = sandbox.node_id
    if node_id is None:
        outcome = {"ok": True, "killed": False, "note": "no node: nothing was running"}
    else:
        # read with the sandbox (visible()), as fresh as a read here would be
        node = sandbox.node if Sandbox.node.is_cached(sandbox) else await Node.objects.filter(pk=node_id).afirst()
        outcome = (await core.kill_on_node(node, sandbox_id, settings.AENV_KILL_DEADLINE) if node is not None
                   else {"ok": False, "error": f"node {node_id} no longer exists"})
    failure = "" if outcome["ok"] else f"VM kill not confirmed by node {node_id}: {outcome['error']}"
    if failure:
        log.warning("sandbox %s: %s", sandbox_id, failure)
    done = core.event(sandbox_id, "kill", outcome="ok" if outcome["ok"] else "unconfirmed",
                      from_state=S.KILLING, started_at=started, duration_ms=core.ms(t0), actor=actor,
                      message=failure, details={"node": node_id, **details, **outcome})
    fields = {"killed_at": timezone.now()}
    if failure:
        fields["error_reason"] = failure
    killed = await core.transition_row(sandbox_id, [S.KILLING], S.KILLED, done, **fields)
    return killed if killed is not None else await Sandbox.objects.aget(pk=sandbox_id)
