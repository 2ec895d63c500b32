"""`manage.py run_events_worker`: the control plane's Celery worker for webhook deliveries,
consuming AENV_WEBHOOK_QUEUE (``control.events``) with a thread pool (each delivery is one
HTTP request, mostly waiting). Started by scripts/up.sh next to the sweeper; never on a node
(it needs the webhooks' secrets, hence the installation's SECRET_KEY)."""
from django.conf import settings
from django.core.management.base import BaseCommand

from events import tasks  # noqa: F401 - registers the task with the app this worker runs
from nodes.celery_app import app as celery_app


def worker_argv(queue: str, concurrency: int, loglevel: str = "INFO") -> list[str]:
    return ["worker", "--queues", queue, "--pool", "threads", "--concurrency", str(concurrency),
            "--hostname", "events@%h", "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


class Command(BaseCommand):
    help = "Deliver webhook events (the control plane's Celery queue AENV_WEBHOOK_QUEUE)."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=settings.AENV_WEBHOOK_CONCURRENCY)
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, concurrency: int, loglevel: str, **options):
        celery_app.worker_main(worker_argv(settings.AENV_WEBHOOK_QUEUE, concurrency, loglevel))
