"""``/templates`` and ``/v2|v3/templates``: E2B's template build API as the SDK sends it."""
