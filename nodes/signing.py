"""Signed node tasks: a stolen broker password must not make a node run anything.

The control plane signs every task message with its private key (Celery's ``auth``
serializer, ``celery.security``: RSA-PSS over the message body); a node accepts only
``auth`` content and trusts only the control plane's certificate, so an unsigned message
(plain JSON pushed into ``node.<id>``) or one signed by any other key is refused, logged
(``SignedOnlyConsumer``) and dropped before a task body runs. Results stay JSON: the node
has no signing key, and results carry no secrets (``nodes.sealed`` keeps those out of
task arguments too).

Celery signs only the body, not the headers (task name, id, expiry), so the body also
carries *claims* (``claims``/``check_claims``): which task, for which queue, with which
id, until when. A node runs a message only when they match the headers it came with and
it has not run that id before, so a signed message read off the broker cannot be
replayed, re-aimed at another task or another node's queue, or run after its expiry.

Nothing here needs Django: ``nodes.celery_app`` wires it to the settings, and tests use
it with a plain Celery app."""
from __future__ import annotations

import datetime
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from celery import Task
from celery.exceptions import ImproperlyConfigured
from celery.worker.consumer import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError

log = logging.getLogger(__name__)

SERIALIZER = "auth"
CLAIMS = "_aenv"  # the kwarg holding the claims (never a task parameter)
KEY_FILE, CERT_FILE = "key.pem", "cert.pem"  # what ``write_keys`` makes in its directory
KEY_BITS = 3072  # Celery's auth serializer verifies RSA only
CERT_DAYS = 3650  # a self-signed cert that expires silently stops every node: long, rotate by hand


class TaskRefused(Exception):
    """A signed message whose claims do not match how it was delivered (replayed, re-aimed, late)."""


def resolve(key: str, cert: str, default_dir: Path) -> tuple[str | None, str | None]:
    """Which key and certificate this process uses. A path given explicitly must exist (a
    typo must not turn signing off); without one, the files ``write_keys`` makes in
    ``default_dir`` are used when they exist (the single-machine default)."""
    found = []
    for given, name in ((key, KEY_FILE), (cert, CERT_FILE)):
        if given:
            if not Path(given).is_file():
                raise ImproperlyConfigured(f"task signing: {given} does not exist or is not a file")
            found.append(str(Path(given).resolve()))
        else:
            default = default_dir / name
            found.append(str(default) if default.is_file() else None)
    key_path, cert_path = found
    if key_path and not cert_path:
        raise ImproperlyConfigured("task signing: a signing key without its certificate "
                                   "(AENV_TASK_SIGNING_CERT) cannot sign")
    return key_path, cert_path


def configure(app, *, key: str | None, cert: str | None) -> str:
    """Sets ``app`` up for signed tasks and returns what it does: ``off`` (no certificate:
    plain JSON both ways), ``verify`` (a node: accepts only tasks signed by ``cert``'s key)
    or ``sign`` (the control plane: signs with ``key`` as well). Results stay JSON."""
    if not cert:
        return "off"
    from celery.security.serialization import register_auth  # noqa: PLC0415 - needs cryptography

    cert_pem = Path(cert).read_text()
    key_pem = Path(key).read_text() if key else None
    # The trust store is the one certificate: a node believes the control plane and nobody else.
    register_auth(key=key_pem, cert=cert_pem if key else None, store=cert)
    app.conf.update(
        accept_content=[SERIALIZER],
        result_serializer="json",
        result_accept_content=["json"],
        task_serializer=SERIALIZER if key else "json",
        worker_consumer=f"{__name__}:SignedOnlyConsumer",
    )
    return "sign" if key else "verify"


class SignedOnlyConsumer(Consumer):
    """The worker's consumer, saying in one clear line why a message was dropped when it is
    not signed by the control plane (Celery's own report follows, with the body)."""

    def on_invalid_task(self, body, message, exc):
        if isinstance(exc, ContentDisallowed):
            _refused(message, f"not signed ({message.content_type} content; only signed tasks are accepted)")
        super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message, exc):
        if message.content_type == "application/data":  # the auth serializer's: a bad or unknown signature
            _refused(message, f"signature not valid for the trusted certificate: {exc}")
        super().on_decode_error(message, exc)


def _refused(message, why: str) -> None:
    headers = message.headers or {}
    log.error("REFUSED task message %s (task %s) on queue %s: %s; dropped, not run",
              headers.get("id", "?"), headers.get("task", "?"),
              (message.delivery_info or {}).get("routing_key", "?"), why)


# --- claims ------------------------------------------------------------------

def claims(task: str, queue: str, task_id: str, expires_in: float) -> dict:
    """What the control plane puts in a task's (signed) body about how it must arrive."""
    return {"task": task, "queue": queue, "id": task_id, "not_after": time.time() + float(expires_in)}


def outgoing(task: str, queue: str, task_id: str, kwargs: dict, expires_in: float, secret: str) -> dict:
    """A task's kwargs as the control plane sends them: secrets sealed (``nodes.sealed``)
    and the claims added."""
    from nodes.sealed import seal_fields  # noqa: PLC0415

    return {**seal_fields(kwargs, secret), CLAIMS: claims(task, queue, task_id, expires_in)}


class _Seen:
    """Task ids already run by this worker, kept until their claims expire (a node's queue
    is purged at start, so a restart forgets nothing that could still be delivered)."""

    def __init__(self):
        self._ids: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, task_id: str, not_after: float) -> bool:
        now = time.time()
        with self._lock:
            while self._ids and next(iter(self._ids.values())) < now:
                self._ids.popitem(last=False)
            if task_id in self._ids:
                return False
            self._ids[task_id] = not_after
            return True


_seen = _Seen()


def check_claims(found, *, task: str, task_id: str, queues, signed: bool) -> None:
    """Raises TaskRefused unless the claims name this task, this id and a queue this worker
    consumes, are not past their time, and the id is new. Without signing (``signed``
    false) a message without claims is let through: anyone could have written them."""
    if found is None and not signed:
        return
    if not isinstance(found, dict):
        raise TaskRefused(f"task {task_id} ({task}) carries no claims")
    if found.get("task") != task or found.get("id") != task_id:
        raise TaskRefused(f"task {task_id} ({task}) was signed as {found.get('id')} ({found.get('task')})")
    if found.get("queue") not in set(queues):
        raise TaskRefused(f"task {task_id} ({task}) was signed for queue {found.get('queue')}, not this node's")
    not_after = float(found.get("not_after") or 0)
    if time.time() > not_after:
        raise TaskRefused(f"task {task_id} ({task}) expired before it started")
    if not _seen.first_time(task_id, not_after):
        raise TaskRefused(f"task {task_id} ({task}) was already run here (a replayed message)")


class ClaimedTask(Task):
    """Base of the node's tasks: a task delivered by the broker runs only when its claims
    check (``check_claims``); called directly (tests, the node itself) it just runs. Its
    kwargs go through ``open_kwargs`` first (the agent opens sealed secrets there)."""

    abstract = True
    throws = (TaskRefused,)  # logged as an expected error, without a traceback

    def open_kwargs(self, kwargs: dict) -> dict:
        return kwargs

    def __call__(self, *args, **kwargs):
        found = kwargs.pop(CLAIMS, None)
        # Called as a function or applied eagerly (``apply()``), the task runs in this process:
        # nothing came through the broker, so there is no message whose claims could lie.
        if not self.request.called_directly and not self.request.is_eager:
            try:
                check_claims(found, task=self.name, task_id=self.request.id,
                             queues=self.app.amqp.queues.consume_from.keys(),
                             signed=SERIALIZER in (self.app.conf.accept_content or ()))
            except TaskRefused as exc:
                log.error("REFUSED %s; not run", exc)
                raise
        return super().__call__(*args, **self.open_kwargs(kwargs))


# --- keys --------------------------------------------------------------------

def write_keys(directory: Path, common_name: str = "aenv control plane") -> tuple[Path, Path, bool]:
    """Makes an RSA key (0600) and a self-signed certificate for it in ``directory`` unless
    both exist. Returns (key, cert, created)."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    directory = Path(directory)
    key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two first starts at once make one pair, not two halves
        if key_path.is_file() and cert_path.is_file():
            return key_path, cert_path, False
        if key_path.exists() or cert_path.exists():
            raise ImproperlyConfigured(f"task signing: {directory} holds only one of {KEY_FILE} and {CERT_FILE}; "
                                       "remove it or add the other")
        key = rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CERT_DAYS)).sign(key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        # The certificate goes in last: a process that sees it (resolve) also sees the key.
        write_atomically(key_path, key_pem, 0o600)
        write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    finally:
        os.close(lock)
    return key_path, cert_path, True


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """``data`` at ``path`` with ``mode`` from its first byte (a secret is never readable by
    others, not even for a moment), and whole or not at all (written aside, then renamed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
