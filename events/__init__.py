"""Sandbox lifecycle events as E2B serves them (``GET /events/sandboxes``) and the team
webhooks they are pushed to (``/events/webhooks``).

Why a package of its own: the sandbox's own event log (``sandboxes.SandboxEvent``) is the
internal, durable record every operation writes (nodes included); this package turns the
public part of it into E2B's lifecycle events (``catalog``, ``ingest``), keeps them for the
retention period (``retention``), and delivers them, signed, to team webhooks from the
control plane only (``dispatch``, ``delivery``, ``outbound``, ``tasks``)."""
