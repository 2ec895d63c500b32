"""Per-node PostgreSQL roles (issue 23, item 1; ``nodes.db_roles``): a node that joins gets
a role of its own, which can write the node worker's tables and cannot read API keys, teams
or join tokens; revoking the node ends its sessions and its logins. On a real PostgreSQL
database (the PostgreSQL pass of scripts/test.sh); the node's side of the URL
(``config.node_database``) is checked everywhere."""
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
from django.core.wsgi import get_wsgi_application
from django.db import connection, connections
from django.utils import timezone

from agent import join as node_side
from config.node_database import database_url
from nodes import db_roles, join
from nodes.models import Node
from sandboxes.models import Sandbox

OWN = "postgresql://aenv:deployment@10.210.1.1:5432/cluster?sslmode=prefer"
ROLE = "postgresql://aenv_node_n1:s%40cret@127.0.0.1:5432/aenv"


def test_a_node_of_a_cluster_takes_the_roles_credentials_over_its_own_address(tmp_path):
    role_file = tmp_path / "node_database_url"
    role_file.write_text(ROLE + "\n")
    assert database_url(OWN, "http://api:3000", role_file) == \
        "postgresql://aenv_node_n1:s%40cret@10.210.1.1:5432/cluster?sslmode=prefer"
    # No URL of its own for PostgreSQL: the role's URL whole.
    assert database_url("sqlite:////x/db.sqlite3", "http://api:3000", role_file) == ROLE


def test_the_control_plane_and_a_node_without_a_role_keep_their_database_url(tmp_path):
    role_file = tmp_path / "node_database_url"
    assert database_url(OWN, "http://api:3000", role_file) == OWN  # never joined with a role
    role_file.write_text(ROLE)
    assert database_url(OWN, "", role_file) == OWN  # no control plane URL: not a node of a cluster
    role_file.write_text("garbage")
    assert database_url(OWN, "http://api:3000", role_file) == OWN


def test_role_names_are_valid_and_distinct():
    assert db_roles.role_name("n1") == "aenv_node_n1"
    dotted, dashed = db_roles.role_name("node.a"), db_roles.role_name("node-a")
    assert dotted != dashed and dotted.startswith("aenv_node_node_a_")
    assert len(db_roles.role_name("a" * 64)) <= 63


# --- on PostgreSQL ------------------------------------------------------------------------

@pytest.fixture
def postgres(db):
    if connection.vendor != "postgresql":
        pytest.skip("per-node database roles need PostgreSQL (the PostgreSQL pass of scripts/test.sh)")


@pytest.fixture
def node_id(db):
    """A node id of this test only (roles are the server's, not the test database's);
    its role dropped afterwards."""
    node = f"roles{os.getpid()}-{os.environ.get('PYTEST_XDIST_WORKER', 'gw')}"
    yield node
    if connection.vendor != "postgresql":
        return
    _drop_role(db_roles.role_name(node))


def _drop_role(role: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s", [role])
        for (pid,) in cursor.fetchall():
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        if cursor.fetchone():
            cursor.execute(f'DROP OWNED BY "{role}"')
            cursor.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def joined(postgres, node_id, settings, tmp_path):
    """The node joined over the real app (``agent.join`` posting to ``POST /nodes/join``)
    with roles on: its database URL, from the file it kept."""
    settings.AENV_NODE_DATABASE_ROLES = True
    settings.AENV_CONTROL_PLANE_URL = "http://control.test"
    settings.AENV_NODE_JOIN_REQUIRED = True
    settings.AENV_HOME = tmp_path
    settings.AENV_NODE_DATABASE_URL_FILE = tmp_path / "node_database_url"
    _, settings.AENV_NODE_JOIN_TOKEN = join.create_token(node_id=node_id)
    restarts = []
    with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()),
                      base_url="http://control.test") as http:
        assert node_side.ensure_joined(node_id, wait=1, http=http, restart=lambda: restarts.append(1))
    assert restarts == [1]  # the process would run again, now as its role
    path = settings.AENV_NODE_DATABASE_URL_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    url = path.read_text().strip()
    assert urlsplit(url).username == db_roles.role_name(node_id) and urlsplit(url).password
    return url


pytestmark = pytest.mark.django_db(transaction=True)


def test_a_joined_nodes_role_writes_the_node_tables_and_reads_no_secrets(joined, node_id, team, base_template):
    sandbox = Sandbox.objects.create(team=team, template=base_template, state="running", end_at=timezone.now())
    with psycopg.connect(joined, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone()[0] == db_roles.role_name(node_id)
        assert conn.execute("UPDATE nodes_node SET sandboxes_running = 3 WHERE id = %s", [node_id]).rowcount == 1
        conn.execute("INSERT INTO sandboxes_sandboxevent (sandbox_id, operation, outcome, from_state, to_state, "
                     "started_at, message, details, actor) VALUES (%s, 'pause', 'ok', 'running', 'paused', %s, '', "
                     "'{}', 'test')", [sandbox.pk, timezone.now()])
        assert conn.execute("UPDATE sandboxes_sandbox SET state = 'paused' WHERE id = %s", [sandbox.pk]).rowcount == 1
        for table in ("sandboxes_apikey", "nodes_nodejointoken", "sandboxes_team", "auth_user", "django_session"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM {table} LIMIT 1")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO nodes_nodejointoken (prefix) VALUES ('x')")
    assert Node.objects.get(pk=node_id).sandboxes_running == 3
    assert sandbox.events.get().actor == "test"


def test_revoking_the_node_ends_its_sessions_and_its_logins(joined, node_id):
    conn = psycopg.connect(joined, autocommit=True)
    try:
        assert conn.execute("SELECT count(*) FROM nodes_node").fetchone()[0] == 1
        join.revoke_node(node_id)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT count(*) FROM nodes_node")
    finally:
        conn.close()
    with pytest.raises(psycopg.OperationalError, match="not permitted to log in"):
        psycopg.connect(joined).close()


def test_rejoining_with_a_new_token_gives_the_login_back_with_a_new_password(joined, node_id, settings):
    join.revoke_node(node_id)
    _, raw = join.create_token(node_id=node_id)
    node, _ = join.join(raw, node_id)
    assert node.database_url and urlsplit(node.database_url).password != urlsplit(joined).password
    with psycopg.connect(node.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM nodes_node WHERE id = %s", [node_id]).fetchone()[0] == 1


def test_a_database_user_without_createrole_refuses_the_join_with_503(postgres, node_id, settings, monkeypatch):
    """The join's transaction runs as a role without CREATEROLE from the check on (SET LOCAL
    ROLE: undone with the transaction). The token stays unspent: once the operator grants
    CREATEROLE (here: the test's own user again) the node joins with the same token."""
    settings.AENV_NODE_DATABASE_ROLES = True
    token, raw = join.create_token(node_id=node_id)
    weak = f"aenv_weak_{os.getpid()}"
    check = db_roles._check_createrole

    def as_weak(cursor):
        cursor.execute(f'SET LOCAL ROLE "{weak}"')
        check(cursor)

    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{weak}" NOLOGIN')
    try:
        monkeypatch.setattr(db_roles, "_check_createrole", as_weak)
        with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()),
                          base_url="http://control.test") as http:
            answer = http.post("/nodes/join", headers={"Authorization": f"Bearer {raw}"}, json={"nodeId": node_id})
            assert answer.status_code == 503, answer.text
            assert answer.json()["error_code"] == "node_database_role_unavailable" and "CREATEROLE" in answer.json()["message"]
            token.refresh_from_db()
            assert token.used_at is None and not Node.objects.filter(pk=node_id).exists()
            monkeypatch.setattr(db_roles, "_check_createrole", check)
            answer = http.post("/nodes/join", headers={"Authorization": f"Bearer {raw}"}, json={"nodeId": node_id})
            assert answer.status_code == 200 and answer.json()["databaseUrl"]
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP ROLE "{weak}"')


@pytest.mark.parametrize("roles", [False, True])
def test_only_postgresql_with_roles_on_answers_a_database_url(node_id, settings, roles):
    """Off: no role anywhere. On with SQLite (no users to make): joining works as before."""
    settings.AENV_NODE_DATABASE_ROLES = roles
    _, raw = join.create_token(node_id=node_id)
    with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()),
                      base_url="http://control.test") as http:
        answer = http.post("/nodes/join", headers={"Authorization": f"Bearer {raw}"}, json={"nodeId": node_id})
    assert answer.status_code == 200
    assert ("databaseUrl" in answer.json()) == (roles and connection.vendor == "postgresql")


def test_nodes_joining_at_once_all_get_their_roles(postgres, node_id, settings):
    """Concurrent GRANTs on one table fail in PostgreSQL ("tuple concurrently updated"): a
    cluster's nodes start together, so their joins (and check-ins) take turns."""
    settings.AENV_NODE_DATABASE_ROLES = True
    ids = [f"{node_id}-{i}" for i in range(4)]
    raws = [join.create_token(node_id=i)[1] for i in ids]

    def join_one(args):
        try:
            node, _ = join.join(*args)
            db_roles.refresh(node.pk)
            return node.database_url
        finally:
            connections.close_all()

    try:
        with ThreadPoolExecutor(len(ids)) as pool:
            urls = list(pool.map(join_one, zip(raws, ids)))
        assert len(set(urls)) == len(ids) and all(urls)
    finally:
        for i in ids:
            _drop_role(db_roles.role_name(i))
