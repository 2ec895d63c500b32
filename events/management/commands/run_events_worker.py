"""`manage.py run_events_worker`: the control plane's Celery worker for webhook deliveries,
consuming AENV_WEBHOOK_QUEUE (``control.events``) with a thread pool (each delivery is one
HTTP request, mostly waiting). Started by scripts/up.sh next to the sweeper; never on a node
(it needs the webhooks' secrets, hence the installation's SECRET_KEY).

--heartbeat FILE: the file's mtime is set every HEARTBEAT_PERIOD seconds while the broker
answers, so a container's liveness probe (deploy/docker/entrypoint.sh health events) can
restart a worker that lost it for good."""
import logging
import threading
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from events import tasks  # noqa: F401 - registers the task with the app this worker runs
from nodes.celery_app import app as celery_app

log = logging.getLogger(__name__)

HEARTBEAT_PERIOD = 15.0


def worker_argv(queue: str, concurrency: int, loglevel: str = "INFO") -> list[str]:
    return ["worker", "--queues", queue, "--pool", "threads", "--concurrency", str(concurrency),
            "--hostname", "events@%h", "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


def broker_answers() -> None:
    """Raises unless a fresh connection to the broker can be made."""
    with celery_app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, timeout=5)


def beat(path: Path, stop: threading.Event, check=broker_answers, period: float = HEARTBEAT_PERIOD) -> None:
    """Touches ``path`` after every ``check`` that went through, until ``stop``."""
    while not stop.is_set():
        try:
            check()
        except Exception:  # noqa: BLE001 - no beat; the probe decides when it has been too long
            log.warning("events worker: the broker does not answer", exc_info=True)
        else:
            path.touch()
        stop.wait(period)


class Command(BaseCommand):
    help = "Deliver webhook events (the control plane's Celery queue AENV_WEBHOOK_QUEUE)."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=settings.AENV_WEBHOOK_CONCURRENCY)
        parser.add_argument("--loglevel", default="INFO")
        parser.add_argument("--heartbeat", type=Path, default=None,
                            help="a file touched while the broker answers (liveness)")

    def handle(self, *args, concurrency: int, loglevel: str, heartbeat: Path | None = None, **options):
        if heartbeat is not None:
            threading.Thread(target=beat, args=(heartbeat, threading.Event()), daemon=True,
                             name="events-heartbeat").start()
        celery_app.worker_main(worker_argv(settings.AENV_WEBHOOK_QUEUE, concurrency, loglevel))
