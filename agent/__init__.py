"""The node agent: the process on every node (``manage.py run_node``) that runs VM
operations for the control plane.

Why a package of its own: the control plane (``sandboxes``, ``snapshots``, ``nodes``,
``dashboard``) decides and records; the agent acts on this machine's VMs. They meet only
at ``nodes.protocol`` (task names, sent through Celery to the queue ``node.<id>``) and the
database. Here: the Celery tasks (``tasks``), registration and heartbeat (``heartbeat``),
the worker loop (``worker``), reconcile after a restart (``reconcile``,
``reconcile_snapshots``, ``settle``), the node's one VM driver (``driver``), what it tells
a guest's envd (``guest``) and the snapshot stores (``stores``). It imports ``vmm`` and the
models, never the API."""
