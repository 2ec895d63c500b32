"""The control plane's events worker's one task (registered by ``run_events_worker``)."""
from nodes.celery_app import app

from events import delivery
from events.dispatch import DELIVER_WEBHOOK


@app.task(name=DELIVER_WEBHOOK, ignore_result=True)
def deliver_webhook(delivery_id: str, number: int) -> None:
    delivery.attempt(delivery_id, number)
