"""Celery app: the control plane sends VM operations to node workers through it."""
import os

from celery import Celery

from nodes import broker, result_store, signing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("aenv")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Results in Redis (CELERY_RESULT_BACKEND), a success stored without a read before
# (nodes.result_store). Not ``Celery(backend=...)``: that would also stand in for the URL.
app.backend_cls = result_store.BACKEND


@app.on_after_configure.connect
def _broker_transport(sender, source, **_):
    broker.use_for(source)  # a Redis broker: one command client per channel (nodes.broker)


# The node agent registers its tasks itself (agent.worker imports agent.tasks): the
# control plane only sends them by name (nodes.protocol) and never imports the agent.


def setup_signing() -> str:
    """Signed tasks (nodes.signing) as the settings say. Called by the nodes app's ready(),
    so every Django process has it before it sends or consumes a task, and a key or
    certificate that is missing or not valid stops the process (a Celery signal handler's
    error would only be logged, leaving it unsigned)."""
    from django.conf import settings  # noqa: PLC0415

    key, cert = signing.resolve(settings.AENV_TASK_SIGNING_KEY, settings.AENV_TASK_SIGNING_CERT,
                                settings.AENV_TASK_SIGNING_DIR)
    return signing.configure(app, key=key, cert=cert,
                             accept_celery_auth=settings.AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH)
