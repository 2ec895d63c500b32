"""The sandbox lifecycle: create, kill, pause / resume / connect / auto-resume, TTLs and
queries, one module each, all built on ``core`` (the only place that talks to nodes,
waits for them and records what happened). Snapshots and forks live in
``lifecycle.snapshots`` on the same core.

Rules every operation keeps: each state change goes through
``sandboxes.transitions`` (legal by the table in ``sandboxes.states``, conditional,
durable with its event before anyone is answered); node work runs shielded from client
disconnects and watches for a node restart; failures end in a consistent, recorded state
and surface as the domain errors of ``sandboxes.errors`` (``api.errors`` maps them to HTTP).

Everything is ``async``: a create waits for a VM to boot on a node, and doing that in a
worker thread would let a handful of creates block the whole server. This package
``__init__`` imports nothing, so ``lifecycle.snapshots`` can build on ``core`` without
pulling in ``create`` (which builds on ``lifecycle.sources``)."""
