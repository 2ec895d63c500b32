"""Celery app: the control plane sends VM operations to node workers through it."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("aenv")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The node agent registers its tasks itself (agent.worker imports agent.tasks): the
# control plane only sends them by name (nodes.protocol) and never imports the agent.
