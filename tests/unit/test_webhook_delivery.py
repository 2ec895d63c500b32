"""Webhook deliveries against real HTTP receivers on 127.0.0.1 (AENV_WEBHOOK_ALLOW_PRIVATE on,
as an operator with receivers on its own network would set it): the signature checked the
way a receiver checks it (HMAC-SHA256 of the exact body, and E2B's header), retries with
exponential backoff from a receiver that fails and then answers, the attempt bound, the
timeout, the bounded read, redirects not followed, the SSRF fence at delivery time (a
setting turned off, a name resolving to a private address, the connection pinned to the
address checked), one POST per attempt however often its task arrives, the Celery task on
the control plane's queue, and the delivery history the API serves."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from events import catalog, delivery, dispatch, ingest, tasks, webhooks
from events.models import DeliveryStatus, WebhookAttempt, WebhookDelivery
from sandboxes.models import Sandbox, SandboxEvent

SECRET = "receiver-shared-secret-0123456789"


class Receiver:
    """An HTTP server on 127.0.0.1 that answers each POST with the next scripted answer
    (status, body, delay s, extra headers) and records what it got."""

    def __init__(self, answers=None):
        self.answers = list(answers or [])
        self.got: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.got.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                  "body": body})
                status, text, delay, extra = (outer.answers.pop(0) if outer.answers else (200, b"ok", 0, {}))
                time.sleep(delay)
                try:
                    self.send_response(status)
                    for name, value in extra.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook?x=1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def _receiver(answers=None) -> Receiver:
        made.append(Receiver(answers))
        return made[-1]
    yield _receiver
    for r in made:
        r.close()


@pytest.fixture
def private_ok(settings):
    settings.AENV_WEBHOOK_ALLOW_PRIVATE = True
    settings.AENV_WEBHOOK_BACKOFF = 2.0
    settings.AENV_WEBHOOK_BACKOFF_MAX = 600
    settings.AENV_WEBHOOK_MAX_ATTEMPTS = 6
    settings.AENV_WEBHOOK_TIMEOUT = 5.0
    return settings


@pytest.fixture
def sandbox(db, team, base_template):
    return Sandbox.objects.create(team=team, template=base_template, state="running", metadata={"k": "v"},
                                  end_at=timezone.now() + timedelta(minutes=5))


def _created(sandbox) -> SandboxEvent:
    return SandboxEvent.objects.create(sandbox=sandbox, operation="create", outcome="ok", from_state="creating",
                                       to_state="running", actor="api-key test", duration_ms=12.5)


class Worker:
    """The sweeper's pass and the events worker, in this process: tasks sent by the pass are
    run right away through the Celery task (``apply``)."""

    def __init__(self):
        self.sent: list[tuple[str, int]] = []

    def send(self, delivery_id, number):
        self.sent.append((delivery_id, number))

    def pass_(self, now=None) -> list:
        self.sent.clear()
        dispatch.run(now, send=self.send)
        return [tasks.deliver_webhook.apply(args=list(sent)) for sent in list(self.sent)]


def _expected_hmac(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


def _hook(team, url, **extra):
    return webhooks.create(team, {"url": url, "events": list(catalog.TYPES), "signatureSecret": SECRET, **extra})[0]


def test_a_delivery_is_signed_over_its_exact_body(private_ok, receiver, team, sandbox):
    rx = receiver()
    hook = _hook(team, rx.url)
    _created(sandbox)
    Worker().pass_()
    assert len(rx.got) == 1
    got = rx.got[0]
    body, headers = got["body"], got["headers"]
    assert got["path"] == "/hook?x=1"
    assert headers["aenv-signature"] == _expected_hmac(body)
    e2b = base64.urlsafe_b64encode(hashlib.sha256(SECRET.encode() + body).digest()).decode().rstrip("=")
    assert headers["e2b-signature"] == e2b and headers["e2b-signature-version"] == "v1"
    assert headers["e2b-webhook-id"] == str(hook.id) and headers["content-type"] == "application/json"
    event = json.loads(body)
    assert event["type"] == catalog.CREATED and event["sandboxId"] == sandbox.id
    assert event["eventData"]["sandbox_metadata"] == {"k": "v"}
    attempt = WebhookAttempt.objects.get()
    assert headers["e2b-delivery-id"] == str(attempt.id)
    assert (attempt.ok, attempt.status_code, attempt.number, attempt.response_body) == (True, 200, 1, "ok")
    assert attempt.duration_ms > 0
    assert WebhookDelivery.objects.get().status == DeliveryStatus.SUCCESS
    # a changed byte no longer verifies
    assert headers["aenv-signature"] != _expected_hmac(body.replace(b"created", b"killed!"))


def test_a_failing_receiver_is_retried_with_exponential_backoff(private_ok, receiver, team, sandbox):
    rx = receiver([(500, b"boom", 0, {}), (503, b"busy", 0, {}), (200, b"fine", 0, {})])
    _hook(team, rx.url)
    _created(sandbox)
    worker = Worker()
    worker.pass_()
    d = WebhookDelivery.objects.get()
    first = WebhookAttempt.objects.get(number=1)
    assert (d.status, d.attempts, first.status_code, first.error_class) == ("pending", 1, 500, "http_error")
    assert abs((d.next_attempt_at - first.started_at).total_seconds() - 2.0) < 1.0  # backoff 2 s
    assert worker.pass_() == [] and len(rx.got) == 1  # not due yet
    worker.pass_(d.next_attempt_at + timedelta(milliseconds=1))
    d.refresh_from_db()
    second = WebhookAttempt.objects.get(number=2)
    assert (d.attempts, second.status_code) == (2, 503)
    assert abs((d.next_attempt_at - second.started_at).total_seconds() - 4.0) < 1.0  # then 4 s
    worker.pass_(d.next_attempt_at + timedelta(milliseconds=1))
    d.refresh_from_db()
    assert (d.status, d.attempts, d.finished_at is not None) == ("success", 3, True)
    assert [g["headers"]["aenv-signature"] == _expected_hmac(g["body"]) for g in rx.got] == [True] * 3
    assert len({g["headers"]["e2b-delivery-id"] for g in rx.got}) == 3 and len({g["body"] for g in rx.got}) == 1
    worker.pass_(timezone.now() + timedelta(days=1))
    assert len(rx.got) == 3  # done: never again


def test_attempts_are_bounded(private_ok, receiver, team, sandbox):
    private_ok.AENV_WEBHOOK_MAX_ATTEMPTS = 3
    rx = receiver([(500, b"", 0, {})] * 10)
    _hook(team, rx.url)
    _created(sandbox)
    worker = Worker()
    for _ in range(6):
        worker.pass_(timezone.now() + timedelta(hours=1))
    d = WebhookDelivery.objects.get()
    assert (d.status, d.attempts, len(rx.got)) == ("failed", 3, 3)
    assert delivery.backoff(1) == 2 and delivery.backoff(3) == 8
    private_ok.AENV_WEBHOOK_BACKOFF_MAX = 5
    assert delivery.backoff(10) == 5


def test_a_slow_receiver_times_out(private_ok, receiver, team, sandbox):
    private_ok.AENV_WEBHOOK_TIMEOUT = 0.5
    rx = receiver([(200, b"late", 3, {})])
    _hook(team, rx.url)
    _created(sandbox)
    t0 = time.monotonic()
    Worker().pass_()
    attempt = WebhookAttempt.objects.get()
    assert time.monotonic() - t0 < 2.5
    assert (attempt.ok, attempt.error_class) == (False, "timeout") and attempt.duration_ms < 2000


def test_a_receiver_that_trickles_is_cut_off_at_the_deadline(private_ok, team, sandbox):
    """One byte every 0.2 s never trips a per-read timeout; the attempt's deadline still holds."""
    private_ok.AENV_WEBHOOK_TIMEOUT = 1.0
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
            if stop.is_set():
                break
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    try:
        _hook(team, f"http://127.0.0.1:{listener.getsockname()[1]}/")
        _created(sandbox)
        t0 = time.monotonic()
        Worker().pass_()
        attempt = WebhookAttempt.objects.get()
        assert time.monotonic() - t0 < 3
        assert (attempt.ok, attempt.error_class) == (False, "timeout")
    finally:
        stop.set()
        listener.close()


def test_the_answer_is_read_only_up_to_the_bound(private_ok, receiver, team, sandbox):
    private_ok.AENV_WEBHOOK_MAX_RESPONSE_BYTES = 1000
    rx = receiver([(200, b"x" * 1_000_000, 0, {})])
    _hook(team, rx.url)
    _created(sandbox)
    Worker().pass_()
    attempt = WebhookAttempt.objects.get()
    assert attempt.ok and len(attempt.response_body) == 1000


def test_redirects_are_not_followed(private_ok, receiver, team, sandbox):
    inner = receiver()
    rx = receiver([(302, b"", 0, {"Location": inner.url})])
    _hook(team, rx.url)
    _created(sandbox)
    Worker().pass_()
    attempt = WebhookAttempt.objects.get()
    assert (attempt.ok, attempt.status_code, attempt.error_class) == (False, 302, "http_error")
    assert "redirects are not followed" in attempt.error_message and inner.got == []


def test_private_destinations_are_refused_at_delivery_time(private_ok, receiver, team, sandbox):
    rx = receiver()
    _hook(team, rx.url)
    private_ok.AENV_WEBHOOK_ALLOW_PRIVATE = False  # the operator turned it off since
    _created(sandbox)
    Worker().pass_()
    attempt = WebhookAttempt.objects.get()
    assert (attempt.ok, attempt.error_class) == (False, "request_error")
    assert "loopback or private" in attempt.error_message and rx.got == []


def _resolving(answers: dict):
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        if host in answers:
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                    for a in answers[host]]
        return real(host, port, *args, **kwargs)
    return mock.patch("events.outbound.socket.getaddrinfo", side_effect=fake)


def test_a_name_that_also_resolves_to_a_private_address_is_refused(private_ok, receiver, team, sandbox):
    rx = receiver()
    private_ok.AENV_WEBHOOK_ALLOW_PRIVATE = False
    _hook(team, f"http://rebind.example.com:{rx.port}/")  # does not resolve here: accepted, checked later
    with _resolving({"rebind.example.com": ["93.184.216.34", "127.0.0.1"],
                     "meta.example.com": ["169.254.169.254"]}):
        _created(sandbox)
        Worker().pass_()
        attempt = WebhookAttempt.objects.get()
        assert attempt.error_class == "request_error" and "127.0.0.1" in attempt.error_message
        private_ok.AENV_WEBHOOK_ALLOW_PRIVATE = True  # metadata stays refused even then
        from sandboxes.errors import Invalid  # noqa: PLC0415
        with pytest.raises(Invalid, match="metadata"):
            _hook(team, "http://meta.example.com/")
    assert rx.got == []


def test_the_connection_goes_to_the_checked_address_with_the_urls_host(private_ok, receiver, team, sandbox):
    rx = receiver()
    with _resolving({"hooks.example.test": ["127.0.0.1"]}):
        _hook(team, f"http://hooks.example.test:{rx.port}/in")
        _created(sandbox)
        Worker().pass_()
    assert rx.got[0]["headers"]["host"] == f"hooks.example.test:{rx.port}"
    assert WebhookAttempt.objects.get().ok


def test_an_unresolvable_host_is_a_dns_error(private_ok, team, sandbox):
    _hook(team, "http://no-such-host.invalid/")
    _created(sandbox)
    Worker().pass_()
    assert WebhookAttempt.objects.get().error_class == "dns_error"


def test_one_post_per_attempt_however_often_its_task_arrives(private_ok, receiver, team, sandbox):
    rx = receiver()
    _hook(team, rx.url)
    _created(sandbox)
    worker = Worker()
    dispatch.run(send=worker.send)
    assert dispatch.enqueue_due(send=worker.send) == 0  # leased: not handed out twice
    (delivery_id, number), = worker.sent
    assert delivery.attempt(delivery_id, number) is not None
    assert delivery.attempt(delivery_id, number) is None  # the same task again
    assert len(rx.got) == 1


def test_a_lost_task_is_handed_out_again_after_its_lease(private_ok, team, sandbox):
    _hook(team, "http://hooks.example.com/")
    _created(sandbox)
    worker = Worker()
    dispatch.run(send=worker.send)
    assert len(worker.sent) == 1  # ... and the worker died before running it
    later = timezone.now() + timedelta(seconds=delivery.lease_seconds() + 1)
    assert dispatch.enqueue_due(later, send=worker.send) == 1
    assert worker.sent[-1] == (worker.sent[0][0], 1)


def test_a_disabled_webhook_or_an_unreadable_secret_posts_nothing(private_ok, receiver, team, sandbox, settings):
    rx = receiver()
    hook = _hook(team, rx.url)
    _created(sandbox)
    ingest.catch_up()
    hook.enabled = False
    hook.save()
    Worker().pass_()
    assert WebhookAttempt.objects.get().error_class == "canceled"
    assert WebhookDelivery.objects.get().status == "failed"
    other = _hook(team, rx.url)
    settings.SECRET_KEY = "another-installation-key-" + "x" * 40
    SandboxEvent.objects.create(sandbox=sandbox, operation="refresh", outcome="ok", from_state="running",
                                to_state="running")
    Worker().pass_()
    assert WebhookAttempt.objects.get(delivery__webhook=other).error_class == "signature_error"
    assert rx.got == []


def test_tasks_go_to_the_control_planes_queue(settings):
    settings.AENV_WEBHOOK_QUEUE = "control.events"
    with mock.patch.object(dispatch.celery_app, "send_task") as send:
        dispatch.send_to_worker("abc", 2)
    send.assert_called_once_with(dispatch.DELIVER_WEBHOOK, args=["abc", 2], queue="control.events")
    assert tasks.deliver_webhook.name == dispatch.DELIVER_WEBHOOK


@pytest.mark.django_db(transaction=True)
async def test_the_delivery_history_is_served_paged(api, private_ok, receiver, create):
    rx = receiver([(500, b"nope", 0, {})] + [(200, b"ok", 0, {})] * 10)
    made = await api.post("/events/webhooks", json={"url": rx.url, "events": [catalog.CREATED],
                                                    "signatureSecret": SECRET, "name": "h"})
    wid = made.json()["id"]
    for _ in range(3):
        await create()
    worker = Worker()
    await sync_to_async(worker.pass_)()
    await sync_to_async(worker.pass_)(timezone.now() + timedelta(hours=1))
    page = (await api.get(f"/events/webhooks/{wid}/deliveries", params={"limit": 2, "orderAsc": "true"})).json()
    assert len(page["data"]) == 2 and page["nextCursor"]
    first = page["data"][0]
    assert first["eventType"] == catalog.CREATED and first["status"] == "success"
    assert [(a["status"], a["responseHttpStatusCode"], a["errorClass"]) for a in first["attempts"]] == \
        [("failed", 500, "http_error"), ("success", 200, None)]
    assert first["attempts"][0]["webhookId"] == wid and first["attempts"][0]["durationMs"] >= 0
    rest = (await api.get(f"/events/webhooks/{wid}/deliveries",
                          params={"limit": 2, "orderAsc": "true", "cursor": page["nextCursor"]})).json()
    assert len(rest["data"]) == 1 and rest["nextCursor"] is None
    seen = {g["eventId"] for g in page["data"] + rest["data"]}
    assert len(seen) == 3
    failed = (await api.get(f"/events/webhooks/{wid}/deliveries", params={"deliveryStatus": "failed"})).json()
    assert failed["data"] == []
    resp = await api.get(f"/events/webhooks/{wid}/deliveries", params={"cursor": "garbage!"})
    assert resp.status_code == 400 and resp.json()["code"] == 400
    resp = await api.get(f"/events/webhooks/{wid}/deliveries", params={"deliveryStatus": "lost"})
    assert resp.status_code == 400


@pytest.mark.django_db(transaction=True)
def test_the_events_worker_delivers_through_the_broker(private_ok, receiver, team, base_template):
    """The sweeper's pass sends the attempt through the real broker to a Celery worker thread
    of the real app consuming the control plane's queue (a name of this test's own), signed
    like node tasks when signing is on; the receiver gets the POST."""
    import uuid  # noqa: PLC0415

    import redis  # noqa: PLC0415
    from celery.contrib.testing.worker import start_worker  # noqa: PLC0415

    private_ok.AENV_WEBHOOK_QUEUE = f"control.events-{uuid.uuid4().hex[:8]}"
    rx = receiver()
    _hook(team, rx.url)
    sb = Sandbox.objects.create(team=team, template=base_template, state="running",
                                end_at=timezone.now() + timedelta(minutes=5))
    _created(sb)
    try:
        with start_worker(dispatch.celery_app, pool="threads", concurrency=2, perform_ping_check=False,
                          queues=[private_ok.AENV_WEBHOOK_QUEUE], loglevel="WARNING", shutdown_timeout=15):
            assert dispatch.run()["sent"] == 1
            deadline = time.monotonic() + 30
            while not rx.got and time.monotonic() < deadline:
                time.sleep(0.1)
            while WebhookDelivery.objects.get().status == "pending" and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        redis.Redis.from_url(private_ok.CELERY_BROKER_URL).delete(private_ok.AENV_WEBHOOK_QUEUE)
    assert len(rx.got) == 1 and rx.got[0]["headers"]["aenv-signature"] == _expected_hmac(rx.got[0]["body"])
    assert WebhookDelivery.objects.get().status == "success"


@pytest.mark.django_db(transaction=True)
async def test_delivery_stats_count_attempts_failures_and_durations(api, private_ok, receiver, create,
                                                                     assert_error):
    rx = receiver([(500, b"", 0, {}), (200, b"", 0, {}), (200, b"", 0, {})])
    wid = (await api.post("/events/webhooks", json={"url": rx.url, "events": [catalog.CREATED],
                                                    "signatureSecret": SECRET})).json()["id"]
    for _ in range(2):
        await create()
    worker = Worker()
    await sync_to_async(worker.pass_)()
    await sync_to_async(worker.pass_)(timezone.now() + timedelta(hours=1))
    body = (await api.get(f"/events/webhooks/{wid}/stats")).json()
    assert (body["total"], body["failed"]) == (3, 1)
    assert 0 < body["durationMs"]["minimum"] <= body["durationMs"]["average"] <= body["durationMs"]["maximum"]
    assert len(body["buckets"]) == 24 and sum(b["total"] for b in body["buckets"]) == 3
    assert body["buckets"][-1]["total"] == 3 and body["buckets"][0]["durationMs"]["maximum"] == 0
    week = (await api.get(f"/events/webhooks/{wid}/stats",
                          params={"start": (timezone.now() - timedelta(days=7)).isoformat()})).json()
    assert len(week["buckets"]) in (7, 8) and week["total"] == 3
    assert_error(await api.get(f"/events/webhooks/{wid}/stats", params={"start": "2020-01-01T00:00:00Z"}), 400)
    assert_error(await api.get(f"/events/webhooks/{wid}/stats", params={"end": "yesterday"}), 400, "end")


def test_the_workers_heartbeat_follows_the_broker(tmp_path):
    """run_events_worker --heartbeat: touched after each broker check that went through, never
    after one that failed (entrypoint.sh health events then restarts the container)."""
    from events.management.commands.run_events_worker import beat  # noqa: PLC0415

    alive, stop, answers = tmp_path / "alive", threading.Event(), [True, False]

    def check():
        if not answers.pop(0):
            stop.set()
            raise ConnectionError("broker gone")
    beat(alive, stop, check, period=0)
    assert alive.exists()
    alive.unlink()
    stop.clear()
    answers[:] = [False]
    beat(alive, stop, check, period=0)
    assert not alive.exists()
