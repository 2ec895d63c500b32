"""A team's secrets (E2B's ``/secrets``): write-only values a sandbox never sees.

A sandbox names a secret only as a marker (``${e2b.secrets.NAME}``) in the header transforms
of its ``network.rules``; the node's egress proxy asks the control plane for the value when a
request to a host with such a rule leaves the sandbox (``team_secrets.resolve``) and puts it
into the request's headers there. Values are stored encrypted with a key that is not in the
database (``team_secrets.crypto``). Named ``team_secrets``: ``secrets`` is the standard
library's module."""
