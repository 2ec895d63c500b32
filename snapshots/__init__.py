"""Snapshots: the Snapshot model, their lifecycle (snapshot, fork, delete, list in
``lifecycle``), what a ``templateID`` naming a snapshot means (``sources``) and their API.
Their files live on nodes, kept by the node agent's stores (``agent.stores``)."""
