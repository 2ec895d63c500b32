"""Shared pytest setup.

The database follows ``DATABASE_URL`` exactly like the server (settings read it):
unset → SQLite (pytest-django uses an in-memory test database);
``DATABASE_URL=postgres://postgres@127.0.0.1:5432/aenv`` → pytest-django creates and
drops ``test_aenv`` on that PostgreSQL server."""


def pytest_report_header(config):
    try:
        from django.conf import settings  # noqa: PLC0415

        db = settings.DATABASES["default"]
        return f"aenv database: {db['ENGINE'].rsplit('.', 1)[-1]} {db.get('NAME')}"
    except Exception:  # noqa: BLE001 - header only
        return None
