"""The Django project: settings (every ``AENV_*`` knob), URLs, the two ASGI entry points
(``asgi``: API, dashboard, WebSockets under daphne; ``dataplane_asgi``: the sandbox proxy under
uvicorn), the Celery app that carries node tasks, and the request-body and secret-key
guards. Importing it loads the Celery app so ``shared_task`` binds to it, and gives every
process a SQLite keeper (``sqlite_wal``)."""
from config import sqlite_wal
from nodes.celery_app import app as celery_app

sqlite_wal.install()

__all__ = ["celery_app"]
