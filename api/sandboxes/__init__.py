"""``/sandboxes``, ``/v2/sandboxes`` and their logs and metrics: E2B's sandbox endpoints."""
