"""Shared pytest setup.

The database follows ``DATABASE_URL`` exactly like the server (settings read it):
unset → SQLite; ``DATABASE_URL=postgres://postgres@127.0.0.1:5432/aenv`` →
pytest-django creates and drops ``test_aenv_<pid>`` on that PostgreSQL server (one
name per run, so two runs on one server never drop each other's database)."""
import os

import pytest

# Tiers that must run on a test machine (--require-tiers, scripts/test.sh): tests/tiers.py.
pytest_plugins = ["tests.tiers"]


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix, tmp_path_factory):
    """SQLite tests use a file, like the server does, not Django's shared-cache
    in-memory database: Django gives every concurrent ASGI request its own thread
    (and connection), and shared-cache connections fail with "database table is
    locked" instead of waiting, so concurrency tests would test the test setup."""
    from django.conf import settings  # noqa: PLC0415

    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3":
        db.setdefault("TEST", {})["NAME"] = str(tmp_path_factory.mktemp("db") / "test.sqlite3")
    else:
        db.setdefault("TEST", {})["NAME"] = f"test_{db['NAME']}_{os.getpid()}"


def pytest_report_header(config):
    try:
        from django.conf import settings  # noqa: PLC0415

        db = settings.DATABASES["default"]
        return f"aenv database: {db['ENGINE'].rsplit('.', 1)[-1]} {db.get('NAME')}"
    except Exception:  # noqa: BLE001 - header only
        return None


# Each test session is an aenv network instance of its own: drivers made by tests (tests/vmm,
# the contract suite) share its slots, never a running node's nor another session's (two
# sessions may run at once). Each test stack of the session is yet another instance inside the
# session's /16 (harness/stack.py). Names stay within Linux's 15-character limit.
# Each process (an xdist worker too) claims a number no other running process holds
# (harness/net_sessions.py); AENV_TEST_NET_SESSION stays the controller's, the run's number
# (harness/networld.py's outside world is one per run).
if "AENV_NET_PREFIX" not in os.environ or os.environ.get("AENV_TEST_NET_SESSION"):
    from harness.net_sessions import claim as _claim_net_session  # noqa: E402

    _SESSION = _claim_net_session()
    os.environ.setdefault("AENV_TEST_NET_SESSION", str(_SESSION))
    os.environ["AENV_NET_PREFIX"] = f"at{_SESSION}"
    os.environ["AENV_NET_POOL"] = f"10.{100 + _SESSION}.0.0/20"


@pytest.fixture(scope="session", autouse=True)
def _remove_test_network(tmp_path_factory):
    """After the session: whatever slots, table and resolver its drivers left."""
    yield
    from vmm.net import slots  # noqa: PLC0415

    if slots.netns_supported():
        from vmm.net.netns import remove_instance  # noqa: PLC0415

        remove_instance(os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"],
                        tmp_path_factory.getbasetemp())


DB_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback", "live_server"}


def pytest_addoption(parser):
    parser.addoption("--database-tests-only", action="store_true",
                     help="run only the tests that use the database (the second, PostgreSQL pass of scripts/test.sh)")


def pytest_collection_modifyitems(config, items):
    """``--database-tests-only``: keep the tests that touch the database (a ``django_db`` mark,
    or a database fixture anywhere in their fixture closure); the rest ran on the first pass
    and do not depend on which database is configured."""
    if not config.getoption("--database-tests-only"):
        return
    keep, drop = [], []
    for item in items:
        uses_db = item.get_closest_marker("django_db") is not None or DB_FIXTURES & set(item.fixturenames)
        (keep if uses_db else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
