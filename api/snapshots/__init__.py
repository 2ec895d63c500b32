"""``/sandboxes/{id}/snapshots``, ``/snapshots`` and fork: the snapshot endpoints."""
