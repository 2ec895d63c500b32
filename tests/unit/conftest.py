"""Fixtures for unit tests: teams, keys, the base template, an ASGI client on the
real Django app, and a mocked node side (``nodes.client`` / ``nodes.placement``)."""
from types import SimpleNamespace
from unittest import mock

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from harness.polling import until
from sandboxes.models import ApiKey, Team, Template


@pytest.fixture
def team(db):
    return Team.objects.create(name="Team A", slug="team-a")


@pytest.fixture
def other_team(db):
    return Team.objects.create(name="Team B", slug="team-b")


@pytest.fixture
def raw_key(team):
    return ApiKey.generate(team)[1]


@pytest.fixture
def other_key(other_team):
    return ApiKey.generate(other_team)[1]


@pytest.fixture
def base_template(db):
    return Template.objects.create(id="base", alias="base", image="base", cpu_count=2, memory_mb=512,
                                   disk_size_mb=2048)


@pytest.fixture
def node(db):
    from nodes.models import Node  # noqa: PLC0415

    return Node.objects.create(id="n1", address="127.0.0.1", vcpu_capacity=64, memory_mb_capacity=65536,
                               last_heartbeat_at=timezone.now())


def _node_modules():
    """The real exception classes when the node side is importable, so the tests
    check the contract; stand-ins otherwise."""
    try:
        from nodes import client  # noqa: PLC0415
        from nodes import placement  # noqa: PLC0415

        return client, placement
    except Exception:  # noqa: BLE001
        class NodeError(Exception):
            pass

        class NodeTaskFailed(NodeError):
            def __init__(self, message, kind="Exception"):
                super().__init__(message)
                self.kind = kind

        client = SimpleNamespace(NodeError=NodeError, NodeUnavailable=type("NodeUnavailable", (NodeError,), {}),
                                 NodeTimeout=type("NodeTimeout", (NodeError,), {}), NodeTaskFailed=NodeTaskFailed)
        placement = SimpleNamespace(NoNodeAvailable=type("NoNodeAvailable", (Exception,), {}))
        return client, placement


BOOT_RESULT = {"envd_host": "127.0.0.1", "envd_port": 40001, "pid": 4242, "accel": "tcg",
               "timings": {"disk_ms": 10.0, "spawn_ms": 20.0, "envd_ms": 300.0, "total_ms": 330.0, "init": 15.0}}
PAUSE_RESULT = {"to_disk": True, "timings": {"stop_ms": 1.0, "save_ms": 200.0, "total_ms": 250.0}}
RESUME_RESULT = {"envd_host": "127.0.0.1", "envd_port": 40002, "pid": 4343, "accel": "tcg",
                 "timings": {"total_ms": 400.0, "resume_ms": 400.0, "init": 12.0}}


@pytest.fixture
def nodes_mock(node):
    """Fake node side: ``place`` returns ``node``; ``boot_sandbox`` / ``kill_sandbox`` /
    ``pause_sandbox`` / ``resume_sandbox`` are AsyncMocks (set ``side_effect`` to make
    them fail or sleep)."""
    real_client, real_placement = _node_modules()
    client = SimpleNamespace(
        NodeError=real_client.NodeError, NodeUnavailable=real_client.NodeUnavailable,
        NodeTimeout=real_client.NodeTimeout, NodeTaskFailed=real_client.NodeTaskFailed,
        boot_sandbox=mock.AsyncMock(return_value=dict(BOOT_RESULT)),
        kill_sandbox=mock.AsyncMock(return_value={"killed": True}),
        pause_sandbox=mock.AsyncMock(return_value=dict(PAUSE_RESULT)),
        resume_sandbox=mock.AsyncMock(return_value=dict(RESUME_RESULT)),
    )
    async def place(cpu_count, memory_mb, *, on=None, prefer=None, claim=None):
        """Like the real one for its caller: the claim is made on ``node`` (its reservation)."""
        if claim is not None:
            await sync_to_async(claim)(node)
        return node

    placement = SimpleNamespace(NoNodeAvailable=real_placement.NoNodeAvailable,
                                place=mock.AsyncMock(side_effect=place))
    with mock.patch("lifecycle.sandboxes.core.node_api", return_value=(client, placement)):
        yield SimpleNamespace(client=client, placement=placement, node=node)


@pytest.fixture
def asgi_app():
    from config.asgi import http_app  # noqa: PLC0415

    return http_app


@pytest.fixture
async def api(asgi_app, raw_key, base_template):
    """httpx client on the real ASGI app, authenticated as team A."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": raw_key}, timeout=30) as client:
        yield client


@pytest.fixture
async def anon(asgi_app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 timeout=30) as client:
        yield client


def _assert_error(resp: httpx.Response, status: int, text: str | None = None) -> dict:
    """Every error is JSON {code: int, message: str} with the right status."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("code"), int) and body["code"] == status, body
    assert isinstance(body.get("message"), str) and body["message"], body
    if text:
        assert text.lower() in body["message"].lower(), body
    return body


@pytest.fixture
def assert_error():
    return _assert_error


@pytest.fixture
def create(api, nodes_mock):
    """``await create(**body)`` → the 201 body of ``POST /v2/sandboxes``."""

    async def _create(**body) -> dict:
        body.setdefault("templateID", "base")
        resp = await api.post("/v2/sandboxes", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()

    return _create


def _pool_handed_out():
    """(PostgreSQL's connection pool, how many of its connections threads other than this one
    hold), or None without a pool (SQLite)."""
    from django.db import connections  # noqa: PLC0415

    main = connections["default"]
    pool = type(main)._connection_pools.get("default") if hasattr(type(main), "_connection_pools") else None
    if pool is None or pool.closed:
        return None
    stats = pool.get_stats()
    return pool, stats["pool_size"] - stats["pool_available"] - (main.connection is not None)


@pytest.fixture(autouse=True)
def _close_async_db_connections():
    """Async ORM calls made outside a request run on asgiref's shared sync thread,
    whose DB connection would stay open and stop pytest-django from dropping the
    PostgreSQL test database at the end.

    With PostgreSQL, also: a test must not leave more pooled connections held by other
    threads than it found. A thread that ran ORM calls and never closed its connection (an
    executor's, a server's) keeps it for its life, and its pool slot beyond that: the product's
    calls off the request thread close theirs (channels' ``database_sync_to_async``), a test's
    own threads must too. Such leftovers made the end of the run fail to drop the test
    database ("being accessed by other users"), a warning far from its cause; this names the test."""
    before = _pool_handed_out()
    yield
    from asgiref.sync import SyncToAsync  # noqa: PLC0415
    from django.db import connections  # noqa: PLC0415

    SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=10)

    def held_since() -> int:  # a pool made during the test (the first one, or after close_pool) starts at 0
        now = _pool_handed_out()
        return 0 if now is None else now[1] - (before[1] if before and now[0] is before[0] else 0)

    try:  # a request's thread gives its connection back as the request ends: a moment
        until(lambda: held_since() <= 0, "the pooled connections given back", deadline=5, interval=0.05)
    except AssertionError:
        pytest.fail(f"{held_since()} pooled database connection(s) opened during the test "
                    "are still held by a thread other than the test's: close them on the thread that opened "
                    "them (connections.close_all() there, or channels' database_sync_to_async)", pytrace=False)


@pytest.fixture
def user(team):
    """A dashboard user in ``team`` (password ``pw-alice-123``)."""
    from django.contrib.auth import get_user_model  # noqa: PLC0415

    u = get_user_model().objects.create_user("alice", password="pw-alice-123")
    team.members.add(u)
    return u


@pytest.fixture
def dash(client, user):
    """Django test client signed in as ``user``."""
    client.force_login(user)
    return client


@pytest.fixture
def slot_prefix():
    """A network-slot prefix of this test's own (nothing else's namespaces are touched);
    its slots, stray veths and node table are removed afterwards."""
    import uuid  # noqa: PLC0415

    from vmm.net import host_table, slots  # noqa: PLC0415

    prefix = "t" + uuid.uuid4().hex[:5]
    yield prefix
    for slot in slots.list_slots(prefix):
        slots.destroy(slot)
    for name in slots.stray_veths(prefix):
        slots.remove_link(name)
    host_table.remove(prefix)


@pytest.fixture(autouse=True)
def _volumes_without_limits():
    """Unit tests' volumes are plain directories in their tmp_path (a volume with a limit is a
    loop mount, volumes.image, which a tmp_path's removal would leave behind); the tests of
    limits set AENV_VOLUME_MAX_MB themselves."""
    from django.conf import settings  # noqa: PLC0415

    old = getattr(settings, "AENV_VOLUME_MAX_MB", 0)
    settings.AENV_VOLUME_MAX_MB = 0
    yield
    settings.AENV_VOLUME_MAX_MB = old
