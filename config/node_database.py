"""A node's own database role (``nodes.db_roles``), as the node's settings load it.

The join's answer gave the node its role's URL; ``agent.join`` keeps it in
``AENV_NODE_DATABASE_URL_FILE``. Only a node of a cluster (``AENV_CONTROL_PLANE_URL`` set)
reads it: the control plane on the same machine, which has no control plane URL of its
own, keeps the deployment's user. The node keeps how it reaches the database (its own
``DATABASE_URL``'s host, port, database and options: the control plane may reach it at
another address) and takes the role's user and password from the file."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgres", "postgresql", "pgsql")


def database_url(own_url: str, control_plane_url: str, role_file: Path) -> str:
    """The URL this process's DATABASES come from: ``own_url`` unless it is a node of a
    cluster with a role file, then the role's credentials there."""
    if not control_plane_url:
        return own_url
    try:
        role_url = role_file.read_text().strip()
    except OSError:
        return own_url
    role = urlsplit(role_url)
    if role.scheme not in POSTGRES_SCHEMES or not role.username:
        return own_url
    own = urlsplit(own_url)
    if own.scheme not in POSTGRES_SCHEMES:
        return role_url
    host = own.netloc.rpartition("@")[2]
    credentials = role.netloc.rpartition("@")[0]  # still quoted as the control plane wrote it
    return urlunsplit((own.scheme, f"{credentials}@{host}", own.path, own.query, own.fragment))
