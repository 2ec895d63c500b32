"""Celery app: the control plane sends VM operations to node workers through it."""
import os

from celery import Celery

from nodes import signing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("aenv")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The node agent registers its tasks itself (agent.worker imports agent.tasks): the
# control plane only sends them by name (nodes.protocol) and never imports the agent.


@app.on_after_configure.connect
def _signed_tasks(sender, **kwargs):
    """Signed tasks (nodes.signing) as the settings say, before anything is sent or consumed."""
    from django.conf import settings  # noqa: PLC0415 - loaded by now: the configuration came from it

    key, cert = signing.resolve(settings.AENV_TASK_SIGNING_KEY, settings.AENV_TASK_SIGNING_CERT,
                                settings.AENV_TASK_SIGNING_DIR)
    signing.configure(sender, key=key, cert=cert)
