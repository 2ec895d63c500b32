"""Which recorded sandbox events are public lifecycle events, of which E2B type, and the
body E2B's ``SandboxEvent`` schema gives them.

Why rules over the recorded fields (and not a hook in each operation): every writer of a
``SandboxEvent`` (the lifecycle operations, the sweeper, a node's reconcile or shutdown)
already records the operation, its outcome and the state move; one table read both as SQL
(``public_q``) and in Python (``type_of``) classifies all of them the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Q

PREFIX = "sandbox.lifecycle."
CREATED, KILLED, PAUSED, RESUMED = (PREFIX + t for t in ("created", "killed", "paused", "resumed"))
UPDATED, CHECKPOINTED, FORKED = (PREFIX + t for t in ("updated", "checkpointed", "forked"))
# E2B's types first (a snapshot is E2B's "checkpointed"); "forked" is aenv's own.
TYPES = (CREATED, KILLED, UPDATED, PAUSED, RESUMED, CHECKPOINTED, FORKED)
VERSION = "v1"


@dataclass(frozen=True)
class Rule:
    """A recorded event is of ``type`` when each field named in ``match`` has one of the
    values given, and no field named in ``unless`` has one of those."""

    type: str
    match: dict = field(default_factory=dict)
    unless: dict = field(default_factory=dict)

    def q(self) -> Q:
        q = Q(**{f"{name}__in": sorted(values) for name, values in self.match.items()})
        for name, values in self.unless.items():
            q &= ~Q(**{f"{name}__in": sorted(values)})
        return q

    def holds(self, event) -> bool:
        return (all(getattr(event, name) in values for name, values in self.match.items())
                and not any(getattr(event, name) in values for name, values in self.unless.items()))


OK = {"ok"}
RULES = (
    # A create (also a restore from a snapshot, and each fork child) that ran.
    Rule(CREATED, {"operation": {"create"}, "outcome": OK, "to_state": {"running"}}),
    # A kill (the node may not have confirmed it; the sandbox is gone for its team either
    # way), also the sweeper's, a reconcile's or a lost node's.
    Rule(KILLED, {"outcome": {"ok", "unconfirmed"}, "to_state": {"killed"}}, {"from_state": {"killed"}}),
    Rule(PAUSED, {"outcome": OK, "to_state": {"paused"}, "from_state": {"pausing", "running"}}),
    Rule(RESUMED, {"outcome": OK, "from_state": {"resuming"}, "to_state": {"running"}}),
    Rule(CHECKPOINTED, {"operation": {"snapshot"}, "outcome": OK, "to_state": {"running"}}),
    Rule(FORKED, {"operation": {"fork"}, "outcome": OK, "to_state": {"running"}}),
    # The sandbox stays as it was but its settings changed: timeout, keep-alive, network.
    Rule(UPDATED, {"operation": {"set_timeout", "refresh", "connect", "network"}, "outcome": OK,
                   "from_state": {"running", "paused"}, "to_state": {"running", "paused"}}),
)


def public_q() -> Q:
    """The recorded events that are lifecycle events (a filter on ``SandboxEvent``)."""
    q = Q(pk__in=[])
    for rule in RULES:
        q |= rule.q()
    return q


def type_of(event) -> str | None:
    """The lifecycle type of a recorded ``SandboxEvent``, or None (not public)."""
    for rule in RULES:
        if rule.holds(event):
            return rule.type
    return None


# What of an event's details a team may see (the rest names nodes, timings, internals).
_DETAILS = {"reason": "reason", "timeout": "timeout", "duration": "duration", "end_at": "endAt",
            "snapshot_id": "snapshotId", "count": "count"}


def when(event):
    """When the event happened: the end of the operation it records."""
    return event.started_at + timedelta(milliseconds=event.duration_ms or 0)


def iso(moment) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def payload(event, sandbox, type_: str, event_id) -> dict:
    """E2B's ``SandboxEvent`` for a recorded event of ``sandbox`` (the body served by
    ``GET /events/sandboxes`` and POSTed to webhooks). ``eventData`` carries E2B's
    ``sandbox_metadata`` and aenv's who and why: ``actor``, ``operation``, ``outcome``,
    the state move, ``reason`` / ``message`` and the settings that changed."""
    at = when(event)
    details = event.details if isinstance(event.details, dict) else {}
    data = {"sandbox_metadata": sandbox.metadata or {}, "actor": event.actor, "operation": event.operation,
            "outcome": event.outcome, "fromState": event.from_state, "toState": event.to_state}
    for key, name in _DETAILS.items():
        if details.get(key) is not None:
            data[name] = details[key]
    if event.message:
        data["message"] = event.message
    if event.duration_ms is not None:
        data["durationMs"] = event.duration_ms
    return {
        "id": str(event_id),
        "version": VERSION,
        "type": type_,
        "eventCategory": "lifecycle",
        "eventLabel": type_.removeprefix(PREFIX),
        "eventData": data,
        "timestamp": iso(at),
        "sandboxId": sandbox.id,
        # aenv has no execution id of its own: a sandbox is one execution under its id.
        "sandboxExecutionId": sandbox.id,
        "sandboxTemplateId": sandbox.template_id,
        "sandboxBuildId": sandbox.source_snapshot_id or "",
        "sandboxTeamId": str(sandbox.team_id),
        "sandboxUptimeSecs": max(0, int((at - sandbox.created_at).total_seconds())),
    }
