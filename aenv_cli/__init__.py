"""The ``aenv`` command line: sandboxes from a terminal, on the E2B REST API and the data
plane (``envd_client`` for commands). It imports no Django, so it starts fast and can be
installed on its own."""
