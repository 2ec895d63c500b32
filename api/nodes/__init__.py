"""``/nodes``: a team's view of the fleet, and the operators' view with ``X-Admin-Token``."""
