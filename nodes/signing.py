"""Signed node tasks: a stolen broker password must not make a node run anything.

The control plane signs every task message with its private key (aenv's own kombu
serializer ``aenv-signed``, registered on both sides by ``configure``: an Ed25519 signature
over the JSON body, ~0.1 ms a message; an RSA key still signs, RSA-PSS, ~1 ms); a node
accepts only that content and trusts only the certificate(s) in its certificate file, so
an unsigned message (plain JSON pushed into ``node.<id>``), one signed by any other key,
one whose body was changed after signing, or one claiming another key type is refused,
logged (``SignedOnlyConsumer``) and dropped before a task body runs. Results stay JSON: the
node has no signing key, and results carry no secrets (``nodes.sealed`` keeps those out of
task arguments too).

The signature covers the body, not the headers (task name, id, expiry), so the body also
carries *claims* (``claims``/``check_claims``): which task, for which queue, with which
id, until when. A node runs a message only when they match the headers it came with and
it has not run that id before, so a signed message read off the broker cannot be
replayed, re-aimed at another task or another node's queue, or run after its expiry.

Keys: ``write_keys`` makes an Ed25519 key and a self-signed certificate for it. The key
type is read from the key file, so a pair made before (RSA-3072, when Celery's ``auth``
serializer signed) keeps working as it is, signed RSA-PSS by the same serializer, at
RSA's cost; ``manage.py task_signing_keys --rotate`` replaces it with an Ed25519 pair. A
certificate file may hold several certificates (a node trusts each), so a rotation can go
without a refused task: nodes first trust the old and the new certificate, then the
control plane signs with the new key, then the old certificate goes. A node whose control
plane still signs with Celery's ``auth`` serializer (an upgrade in progress) accepts that
content too only when ``accept_celery_auth`` is set (``AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH``,
RSA certificates only): off by default.

Nothing here needs Django: ``nodes.celery_app`` wires it to the settings, and tests use
it with a plain Celery app."""
from __future__ import annotations

import base64
import datetime
import fcntl
import hashlib
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
from kombu.serialization import registry
from kombu.utils.json import dumps as json_dumps, loads as json_loads

log = logging.getLogger(__name__)

SERIALIZER = "aenv-signed"  # aenv's serializer (the name in accept_content / task_serializer)
CONTENT_TYPE = "application/x-aenv-signed"
CELERY_AUTH, CELERY_AUTH_CONTENT_TYPE = "auth", "application/data"  # Celery's RSA serializer (before)
CLAIMS = "_aenv"  # the kwarg holding the claims (never a task parameter)
KEY_FILE, CERT_FILE = "key.pem", "cert.pem"  # what ``write_keys`` makes in its directory
CERT_DAYS = 3650  # a self-signed cert that expires silently stops every node: long, rotate by hand
VERSION = "v1"
ED25519, RSA_PSS = "ed25519", "rsa-pss-sha256"  # the algorithms, named in each message
# What is signed: a context string, the algorithm and the key id, then the body, so a
# signature made for anything else (or with another algorithm) never verifies here.
_CONTEXT = b"aenv task signature v1\x00"


class TaskRefused(Exception):
    """A signed message whose claims do not match how it was delivered (replayed, re-aimed, late)."""


class SignatureRefused(DecodeError):
    """A message of the ``aenv-signed`` content that does not verify against a trusted certificate."""


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


# --- the serializer -------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def algorithm_of(public_key) -> str:
    """The signature algorithm a key (private or public) signs with: Ed25519, or RSA-PSS for
    an RSA key (a pair made before Ed25519 was the default); anything else is refused."""
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa  # noqa: PLC0415

    if isinstance(public_key, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey)):
        return ED25519
    if isinstance(public_key, (rsa.RSAPublicKey, rsa.RSAPrivateKey)):
        return RSA_PSS
    raise ImproperlyConfigured(f"task signing: {type(public_key).__name__} keys are not supported "
                               "(Ed25519, or RSA for a pair made before)")


def key_id(public_key) -> str:
    """A short name of a public key, in each message: which trusted certificate verifies it."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def _pss():
    from cryptography.hazmat.primitives import hashes  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import padding  # noqa: PLC0415

    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH), hashes.SHA256()


class _Trusted:
    """One trusted certificate's public key: verifies what its private key signed."""

    def __init__(self, cert):
        self.public = cert.public_key()
        self.algorithm = algorithm_of(self.public)
        self.id = key_id(self.public)
        self.not_after = cert.not_valid_after_utc.timestamp()
        self.subject = cert.subject.rfc4514_string()

    def verify(self, signature: bytes, data: bytes) -> None:
        if self.algorithm == ED25519:
            self.public.verify(signature, data)
        else:
            pad, digest = _pss()
            self.public.verify(signature, data, pad, digest)


class Signer:
    """The serializer's two halves: ``encode`` signs (the control plane: it has the key),
    ``decode`` verifies against the trusted certificates (both sides)."""

    def __init__(self, key_pem: bytes | None, certs_pem: bytes):
        from cryptography import x509  # noqa: PLC0415
        from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

        try:
            certs = x509.load_pem_x509_certificates(certs_pem)
        except ValueError as exc:
            raise ImproperlyConfigured(f"task signing: the certificate file holds no valid certificate: {exc}") from exc
        self.trusted = {t.id: t for t in map(_Trusted, certs)}
        self.key = self.algorithm = self.id = None
        if key_pem is not None:
            self.key = serialization.load_pem_private_key(key_pem, password=None)
            self.algorithm, self.id = algorithm_of(self.key), key_id(self.key.public_key())
            if self.id not in self.trusted:
                raise ImproperlyConfigured("task signing: the signing key does not belong to the certificate "
                                           "(AENV_TASK_SIGNING_KEY / AENV_TASK_SIGNING_CERT)")
            self._prefix = f"{VERSION}.{self.algorithm}.{self.id}.".encode()

    def _signed(self, algorithm: str, kid: str, body: bytes) -> bytes:
        return b"".join((_CONTEXT, algorithm.encode(), b"\x00", kid.encode(), b"\x00", body))

    def encode(self, obj) -> str:
        if self.key is None:
            raise ImproperlyConfigured("task signing: this process has no signing key (a node only verifies)")
        body = json_dumps(obj)
        data = body.encode()
        if self.algorithm == ED25519:
            signature = self.key.sign(self._signed(self.algorithm, self.id, data))
        else:
            pad, digest = _pss()
            signature = self.key.sign(self._signed(self.algorithm, self.id, data), pad, digest)
        return f"{VERSION}.{self.algorithm}.{self.id}.{_b64(signature)}.{body}"

    def decode(self, payload):
        text = payload.decode() if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        parts = text.split(".", 4)
        if len(parts) != 5 or parts[0] != VERSION:
            raise SignatureRefused("not an aenv-signed message (unknown format or version)")
        _, algorithm, kid, signature, body = parts
        trusted = self.trusted.get(kid)
        if trusted is None:
            raise SignatureRefused(f"signed by key {kid[:16]!r}, which is not a trusted certificate's")
        if algorithm != trusted.algorithm:
            raise SignatureRefused(f"signed as {algorithm[:20]!r}, but the trusted certificate's key is "
                                   f"{trusted.algorithm} (wrong key type)")
        if time.time() > trusted.not_after:
            raise SignatureRefused(f"the trusted certificate {trusted.subject} has expired")
        from cryptography.exceptions import InvalidSignature  # noqa: PLC0415

        data = body.encode()
        try:
            trusted.verify(_unb64(signature), self._signed(algorithm, kid, data))
        except (InvalidSignature, ValueError) as exc:
            raise SignatureRefused(f"bad signature for key {kid} (the body or the signature was changed, "
                                   "or another key signed)") from exc
        return json_loads(body)


def _refuse(content_type: str):
    def decode(payload):
        if content_type == CELERY_AUTH_CONTENT_TYPE:
            raise SignatureRefused("signed with Celery's auth serializer, which this node does not accept "
                                   "(AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH, RSA certificates only), or not signed")
        raise SignatureRefused(f"not signed ({content_type} content; only signed tasks are accepted)")
    return decode


def configure(app, *, key: str | None, cert: str | None, accept_celery_auth: bool = False) -> str:
    """Sets ``app`` up for signed tasks and returns what it does: ``off`` (no certificate:
    plain JSON both ways), ``verify`` (a node: accepts only tasks signed by a key of ``cert``'s
    certificates) or ``sign`` (the control plane: signs with ``key`` as well). Results stay
    JSON. ``accept_celery_auth``: a node also accepts Celery's ``auth`` content signed by
    ``cert``'s RSA key (a control plane not yet upgraded); never on by default."""
    if not cert:
        if accept_celery_auth:
            raise ImproperlyConfigured("task signing: AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH without a certificate")
        return "off"
    cert_pem = Path(cert).read_bytes()
    signer = Signer(Path(key).read_bytes() if key else None, cert_pem)
    registry.register(SERIALIZER, signer.encode, signer.decode, content_type=CONTENT_TYPE, content_encoding="utf-8")
    accept = [SERIALIZER]
    # kombu lets two content types through whatever accept_content says (its "trusted" ones,
    # handed over as they are); a node refuses them like any unsigned message, logged.
    registry.register("aenv-refused-text", None, _refuse("application/text"), content_type="application/text")
    registry.register(CELERY_AUTH, None, _refuse(CELERY_AUTH_CONTENT_TYPE), content_type=CELERY_AUTH_CONTENT_TYPE)
    if accept_celery_auth:
        if key or any(t.algorithm != RSA_PSS for t in signer.trusted.values()):
            raise ImproperlyConfigured("task signing: AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH is for a node (no key) "
                                       "trusting an RSA certificate (Celery's auth serializer verifies RSA only)")
        from celery.security.serialization import register_auth  # noqa: PLC0415

        register_auth(store=cert)  # Celery's own checks: RSA-PSS over the body by the store's certificate
        accept.append(CELERY_AUTH)
        log.warning("task signing: this node also accepts Celery's auth content (RSA, "
                    "AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH): for an upgrade in progress only")
    if signer.algorithm == RSA_PSS:
        log.warning("task signing: the key is RSA (a pair made before Ed25519 was the default): ~1 ms of CPU "
                    "per node task; manage.py task_signing_keys --rotate makes an Ed25519 pair (docs: Security)")
    app.conf.update(
        accept_content=accept,
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
        if message.content_type == CONTENT_TYPE or (  # a bad or unknown signature
                message.content_type == CELERY_AUTH_CONTENT_TYPE and CELERY_AUTH in (self.app.conf.accept_content or ())):
            _refused(message, f"signature not valid for the trusted certificate: {exc}")
        elif message.content_type in (CELERY_AUTH_CONTENT_TYPE, "application/text"):  # _refuse's
            _refused(message, str(exc))
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

def write_keys(directory: Path, common_name: str = "aenv control plane",
               rotate: bool = False) -> tuple[Path, Path, bool]:
    """Makes an Ed25519 key (0600) and a self-signed certificate for it in ``directory`` unless
    both exist (whatever their key type: an RSA pair made before is kept). ``rotate``: a new
    pair even so, the old one kept beside it as ``key.pem.<time>.old`` / ``cert.pem.<time>.old``.
    Returns (key, cert, created)."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    directory = Path(directory)
    key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two first starts at once make one pair, not two halves
        if key_path.is_file() and cert_path.is_file():
            if not rotate:
                return key_path, cert_path, False
            # The old pair stays where it is until the new one replaces it (a process starting
            # meanwhile must not find none and run unsigned); a copy of it is kept beside.
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
            write_atomically(directory / f"{KEY_FILE}.{stamp}.old", key_path.read_bytes(), 0o600)
            write_atomically(directory / f"{CERT_FILE}.{stamp}.old", cert_path.read_bytes(), 0o644)
        elif key_path.exists() or cert_path.exists():
            raise ImproperlyConfigured(f"task signing: {directory} holds only one of {KEY_FILE} and {CERT_FILE}; "
                                       "remove it or add the other")
        key = ed25519.Ed25519PrivateKey.generate()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CERT_DAYS)).sign(key, None))  # Ed25519: no digest
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
