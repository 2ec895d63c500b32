"""Per-node PostgreSQL roles (``AENV_NODE_DATABASE_ROLES``): a node that joins gets a login
role of its own, ``aenv_node_<id>``, allowed only the tables the node worker uses (its node
row, sandboxes and their events, metrics and logs, snapshots, template builds); never API
keys, teams, users, sessions, join tokens or the admin's tables. Revoking the node takes
the login away and ends its open sessions, so a revoked node (or whoever copied its
database URL) can no longer write the database.

Why roles and not the deployment's own user: the node worker uses the ORM for its rows, so
it needs the database; it need not be able to mint API keys. PostgreSQL only (SQLite has no
users): elsewhere ``enabled()`` is False and nodes keep the deployment's ``DATABASE_URL``.
The control plane's database user needs CREATEROLE (and, to end a revoked node's sessions,
pg_signal_backend or superuser); without CREATEROLE a join is refused with 503."""
from __future__ import annotations

import hashlib
import logging
import re
import secrets
from urllib.parse import quote

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from psycopg import sql

from sandboxes.errors import Unavailable

log = logging.getLogger(__name__)

ROLE_MARK = "aenv_node_"
# Concurrent GRANTs on one table fail in PostgreSQL ("tuple concurrently updated"): nodes
# joining or checking in at once take turns on this transaction-level advisory lock.
_LOCK = 0x61656E76  # "aenv"
# What the node worker (agent/) reads and writes, table by table. Everything not listed
# (sandboxes_apikey, sandboxes_team*, auth_*, django_session, django_admin_log,
# nodes_nodejointoken, ...) it cannot even read. Foreign keys are checked by PostgreSQL as
# the tables' owner, so rows naming a team need no right on the teams table.
GRANTS: dict[str, tuple[str, ...]] = {
    "nodes_node": ("SELECT", "INSERT", "UPDATE"),
    "sandboxes_template": ("SELECT",),
    "sandboxes_sandbox": ("SELECT", "UPDATE"),
    "sandboxes_sandboxevent": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "sandboxes_sandboxmetric": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "sandboxes_sandboxlog": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "snapshots_snapshot": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "snapshots_snapshotevent": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "template_builds_templatebuild": ("SELECT", "UPDATE"),
    "template_builds_buildlogentry": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "template_builds_templatetag": ("SELECT",),
    "template_builds_templatefile": ("SELECT",),
    "django_content_type": ("SELECT",),
}


def enabled() -> bool:
    return bool(settings.AENV_NODE_DATABASE_ROLES) and connection.vendor == "postgresql"


def role_name(node_id: str) -> str:
    """``aenv_node_<id>``: ids are [a-z0-9._-]; '.' and '-' become '_', and then (or when the
    id is too long for PostgreSQL's 63 bytes) a hash of the id keeps two ids apart."""
    safe = re.sub(r"[^a-z0-9_]", "_", node_id)
    if safe != node_id or len(ROLE_MARK + safe) > 63:
        safe = f"{safe[:40]}_{hashlib.sha256(node_id.encode()).hexdigest()[:8]}"
    return ROLE_MARK + safe


def _run(cursor, statement: sql.Composable) -> None:
    """A composed statement (quoted identifiers and literals) as plain text for Django's cursor."""
    cursor.execute(statement.as_string(connection.connection))


def _check_createrole(cursor) -> None:
    cursor.execute("SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user")
    row = cursor.fetchone()
    if not (row and row[0]):
        log.error("AENV_NODE_DATABASE_ROLES is on but the database user has no CREATEROLE: "
                  "ALTER ROLE <user> CREATEROLE, or turn the setting off")
        raise Unavailable("the control plane cannot create the node's database role: its database user lacks "
                          "CREATEROLE (ALTER ROLE ... CREATEROLE, or set AENV_NODE_DATABASE_ROLES=0)",
                          code="node_database_role_unavailable")


def _exists(cursor, role: str) -> bool:
    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
    return cursor.fetchone() is not None


def grant(cursor, role: str) -> None:
    """The role's rights, exactly GRANTS (re-run at each join and check-in: tables a
    migration added since are granted at the node's next start). Inside a transaction."""
    cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])
    ident = sql.Identifier(role)
    cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
    present = {name for (name,) in cursor.fetchall()}
    _run(cursor, sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(_schema(cursor)), ident))
    for table, rights in GRANTS.items():
        if table not in present:
            continue
        _run(cursor, sql.SQL("GRANT {} ON TABLE {} TO {}").format(
            sql.SQL(", ").join(sql.SQL(r) for r in rights), sql.Identifier(table), ident))
        if "INSERT" in rights:  # the id columns' sequences
            cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
            sequence = cursor.fetchone()[0]
            if sequence:
                _run(cursor, sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(sql.SQL(sequence), ident))


def _schema(cursor) -> str:
    cursor.execute("SELECT current_schema()")
    return cursor.fetchone()[0]


def issue(node_id: str) -> str:
    """Create node ``node_id``'s role (or give it a new password and its login back) with
    its rights; its database URL (the control plane's host, port and database). Runs inside
    the join's transaction: a failure leaves no half-made role."""
    role = role_name(node_id)
    password = secrets.token_urlsafe(32)
    with transaction.atomic(), connection.cursor() as cursor:
        _check_createrole(cursor)
        verb = "ALTER" if _exists(cursor, role) else "CREATE"
        _run(cursor, sql.SQL(verb + " ROLE {} LOGIN NOINHERIT NOCREATEDB NOCREATEROLE PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
        grant(cursor, role)
    db = connection.settings_dict
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"postgresql://{quote(role, safe='')}:{quote(password, safe='')}@{db.get('HOST') or ''}{port}/{db['NAME']}"


def refresh(node_id: str) -> None:
    """At a check-in: the node's role (if it has one) gets the rights of this version."""
    if not enabled():
        return
    role = role_name(node_id)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            if _exists(cursor, role):
                grant(cursor, role)
    except DatabaseError:  # the node keeps the rights it had: its check-in still goes through
        log.exception("node %s: granting its database role %s this version's tables failed", node_id, role)


def cut(node_id: str) -> None:
    """At a revocation: no more logins as the node's role, and its open sessions ended."""
    if connection.vendor != "postgresql":
        return
    role = role_name(node_id)
    with connection.cursor() as cursor:
        if not _exists(cursor, role):
            return
        try:
            _run(cursor, sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
        except DatabaseError:  # the revocation itself is recorded: the control plane gives it no work
            log.exception("node %s revoked, but its database role %s could not be cut off (the control plane's "
                          "database user needs CREATEROLE): ALTER ROLE %s NOLOGIN by hand", node_id, role, role)
            return
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s", [role])
        for (pid,) in cursor.fetchall():
            try:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            except DatabaseError:
                log.error("node %s revoked: could not end its database session %s (the control plane's database "
                          "user needs pg_signal_backend); it ends at its next reconnect", node_id, pid)
    log.info("node %s revoked: database role %s may no longer log in, its sessions ended", node_id, role)
