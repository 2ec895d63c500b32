"""The ``aenv`` command line: sandboxes and templates from a terminal, on the E2B REST API
and the data plane (``envd_client`` for commands, shells and files). It imports no
Django, so it starts fast and installs on its own (``cli/pyproject.toml``)."""

__version__ = "0.2.0"
