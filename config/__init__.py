"""The Django project: settings (every ``AENV_*`` knob), URLs, the two ASGI entry points
(``asgi``: API, dashboard, WebSockets under daphne; ``dataplane_asgi``: the sandbox proxy under
uvicorn), the Celery app that carries node tasks, and the request-body and secret-key
guards. Importing it loads the Celery app so ``shared_task`` binds to it."""
from nodes.celery_app import app as celery_app

__all__ = ["celery_app"]
