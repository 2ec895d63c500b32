"""``/volumes`` (a team's volumes, by API key) and ``/volumecontent`` (one volume's files,
by that volume's token): E2B's volume endpoints."""
