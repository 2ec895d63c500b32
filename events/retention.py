"""AENV_EVENT_RETENTION_DAYS: lifecycle events older than that are deleted, with their
webhook deliveries and attempts (the sweeper, ``events.dispatch.run(purge=True)``). The
internal record (``SandboxEvent``) is kept: it is what metrics and reconcile read."""
from __future__ import annotations

from events.ingest import retention_cutoff
from events.models import LifecycleEvent

CHUNK = 1000


def purge(now=None) -> int:
    """Deletes expired events in chunks (short transactions); returns how many."""
    cutoff = retention_cutoff(now)
    if cutoff is None:
        return 0
    total = 0
    while True:
        ids = list(LifecycleEvent.objects.filter(timestamp__lt=cutoff).values_list("pk", flat=True)[:CHUNK])
        if not ids:
            return total
        LifecycleEvent.objects.filter(pk__in=ids).delete()
        total += len(ids)
