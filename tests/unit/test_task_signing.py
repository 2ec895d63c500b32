"""Signed node tasks (``nodes.signing``) and sealed secrets (``nodes.sealed``) against a real
``redis-server`` of our own (free loopback port, tmp dir; never the machine's :6379) and a
real Celery worker process set up as a node (``signing.configure`` with the certificate
only, tasks on ``signing.ClaimedTask``): what an attacker with the broker password pushes
straight into ``node.x`` (plain JSON, or signed by a key of their own) is refused, logged
and never run; a message of the control plane read off the broker cannot be replayed or
re-aimed at another node; a properly signed task runs and gets its sealed token back in
clear; the raw bytes in Redis (message and result) never hold a secret."""
from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from harness.legacy_keys import rsa_pair
from harness.stack import free_port
from nodes import sealed, signing
# The real node tasks on a worker thread with a stub VM driver (the last test here).
from tests.unit.test_nodes_client import BOOT, EnvdStub, alive_node, envd_stub, node_worker  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SECRET = "test-django-secret-key-" + "x" * 40
TOKEN = "envd-token-" + uuid.uuid4().hex
PASSWORD = "registry-password-" + uuid.uuid4().hex

# A node as the agent is one (agent.tasks.NodeTask), without Django: accepts signed tasks only.
WORKER_APP = '''
import os
from celery import Celery
from nodes import signing
from nodes.sealed import open_fields

app = Celery("signtest", broker=os.environ["BROKER"], backend=os.environ["BACKEND"])
app.conf.update(task_acks_late=False, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True)
MODE = signing.configure(app, key=None, cert=os.environ["CERT"])
assert MODE == "verify", MODE


class NodeTask(signing.ClaimedTask):
    abstract = True

    def open_kwargs(self, kwargs):
        return open_fields(kwargs, os.environ["SECRET"])


@app.task(name="nodes.echo", base=NodeTask)
def echo(value, access_token=None, spec=None):
    with open(os.environ["RAN"], "a") as f:
        f.write(value + "\\n")
    password = ((spec or {}).get("from_image_registry") or {}).get("password", "")
    return {"echo": value, "token_ok": access_token == os.environ["TOKEN"],
            "password_ok": password == os.environ["PASSWORD"]}
'''

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (scripts/setup.sh)")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    trusted = tmp_path_factory.mktemp("trusted")
    other = tmp_path_factory.mktemp("other")
    signing.write_keys(trusted)
    signing.write_keys(other)  # the same common name: only the key tells them apart
    return {"trusted": trusted, "other": other}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    home = tmp_path_factory.mktemp("sign-redis")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(home)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def node(broker, keys, tmp_path_factory):
    """A worker process consuming ``node.x`` that trusts only the trusted certificate."""
    home = tmp_path_factory.mktemp("sign-node")
    (home / "sign_worker_app.py").write_text(WORKER_APP)
    ran, log = home / "ran", home / "worker.log"
    ran.touch()
    env = {**os.environ, "BROKER": f"redis://127.0.0.1:{broker}/0", "BACKEND": f"redis://127.0.0.1:{broker}/1",
           "CERT": str(keys["trusted"] / signing.CERT_FILE), "SECRET": SECRET, "RAN": str(ran),
           "TOKEN": TOKEN, "PASSWORD": PASSWORD, "PYTHONPATH": f"{home}:{ROOT}"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sign_worker_app", "worker", "-Q", "node.x",
                                   "-P", "threads", "-c", "2", "--without-gossip", "--without-mingle",
                                   "-n", "x@%h", "-l", "INFO"], cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "ready." not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield type("Node", (), {"ran": ran, "log": log, "port": broker, "worker": worker})
    finally:
        worker.terminate()
        worker.wait(timeout=30)


@pytest.fixture(scope="module")
def control(broker, keys):
    """The control plane's app: signs with the trusted key."""
    app = Celery("signtest-control", broker=f"redis://127.0.0.1:{broker}/0", backend=f"redis://127.0.0.1:{broker}/1")
    app.conf.broker_connection_retry_on_startup = True
    assert signing.configure(app, key=str(keys["trusted"] / signing.KEY_FILE),
                             cert=str(keys["trusted"] / signing.CERT_FILE)) == "sign"
    yield app
    app.close()


def send(app, queue: str, value: str, expires: float = 60, signed_for: str | None = None):
    """The control plane's send (as nodes.client._publish); ``signed_for``: the queue the
    claims name when it is not ``queue`` (a message parked where nobody consumes it)."""
    task_id = str(uuid.uuid4())
    kwargs = signing.outgoing("nodes.echo", signed_for or queue, task_id,
                              {"value": value, "access_token": TOKEN,
                               "spec": {"from_image_registry": {"type": "registry", "username": "u",
                                                                "password": PASSWORD}}},
                              expires, SECRET)
    return app.send_task("nodes.echo", kwargs=kwargs, queue=queue, task_id=task_id, expires=expires)


def parked(node, queue: str, task_id: str) -> bytes:
    """Takes the message of ``task_id`` out of ``queue`` (where nobody consumes it), leaving
    other tests' parked messages where they are."""
    r = redis.Redis(host="127.0.0.1", port=node.port)
    for raw in r.lrange(queue, 0, -1):
        if json.loads(raw)["headers"]["id"] == task_id:
            r.lrem(queue, 1, raw)
            return raw
    raise AssertionError(f"task {task_id} is not parked in {queue}")


def wait_log(node, text: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = node.log.read_text()
        if text in log:
            return log
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log[-3000:]}"
        time.sleep(0.1)


def raw_message(task_id: str, body: bytes | str, content_type: str, queue: str = "node.x") -> bytes:
    """A task message (Celery protocol 2) as kombu's Redis transport stores it."""
    return json.dumps({
        "body": base64.b64encode(body if isinstance(body, bytes) else body.encode()).decode(), "content-encoding": "utf-8", "content-type": content_type,
        "headers": {"lang": "py", "task": "nodes.echo", "id": task_id, "root_id": task_id, "parent_id": None,
                    "group": None, "retries": 0, "eta": None, "expires": None, "origin": "attacker"},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    }).encode()


def task_body(value: str, task_id: str, queue: str = "node.x") -> list:
    return [[], {"value": value, signing.CLAIMS: signing.claims("nodes.echo", queue, task_id, 60)},
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]


def results(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, db=1)


# ------------------------------------------------------------------ refused

def test_an_unsigned_task_pushed_into_redis_is_refused_logged_and_not_run(node):
    task_id = str(uuid.uuid4())
    value = f"unsigned-{task_id}"
    redis.Redis(host="127.0.0.1", port=node.port).lpush(
        "node.x", raw_message(task_id, json.dumps(task_body(value, task_id)).encode(), "application/json"))
    log = wait_log(node, f"REFUSED task message {task_id} (task nodes.echo) on queue node.x: not signed")
    time.sleep(1)
    assert value not in node.ran.read_text()
    assert results(node.port).get(f"celery-task-meta-{task_id}") is None
    assert node.worker.poll() is None, log  # the worker goes on


def signed_by(key_dir: Path, body, *, kid: str | None = None, algorithm: str | None = None) -> str:
    """``body`` in aenv's signed format, signed with the private key in ``key_dir``; ``kid`` /
    ``algorithm``: what the message says it is instead (a forgery naming the trusted key)."""
    signer = signing.Signer((key_dir / signing.KEY_FILE).read_bytes(), (key_dir / signing.CERT_FILE).read_bytes())
    kid, algorithm = kid or signer.id, algorithm or signer.algorithm
    text = json.dumps(body)
    signature = signer.key.sign(signer._signed(algorithm, kid, text.encode()))
    return f"{signing.VERSION}.{algorithm}.{kid}.{signing._b64(signature)}.{text}"


def push(node, task_id: str, payload, content_type: str = signing.CONTENT_TYPE) -> None:
    redis.Redis(host="127.0.0.1", port=node.port).lpush("node.x", raw_message(task_id, payload, content_type))


def trusted_id(keys) -> str:
    return signing.Signer(None, (keys["trusted"] / signing.CERT_FILE).read_bytes()).trusted.popitem()[0]


def test_a_task_signed_by_an_untrusted_key_is_refused(node, keys):
    task_id = str(uuid.uuid4())
    value = f"untrusted-{task_id}"
    push(node, task_id, signed_by(keys["other"], task_body(value, task_id)))
    wait_log(node, f"REFUSED task message {task_id} (task nodes.echo) on queue node.x: signature not valid")
    wait_log(node, "which is not a trusted certificate's")

    # A message naming the trusted key (its id, its algorithm), signed by the attacker's own:
    # the trusted key is found, but it did not sign.
    forged_id = str(uuid.uuid4())
    push(node, forged_id, signed_by(keys["other"], task_body(f"forged-{forged_id}", forged_id), kid=trusted_id(keys)))
    log = wait_log(node, f"REFUSED task message {forged_id} (task nodes.echo) on queue node.x: signature not valid")
    assert f"bad signature for key {trusted_id(keys)}" in log
    time.sleep(1)
    assert value not in node.ran.read_text() and "forged-" not in node.ran.read_text()
    assert results(node.port).get(f"celery-task-meta-{task_id}") is None


def test_a_tampered_body_or_a_wrong_key_type_is_refused(node, keys):
    """A message of the control plane whose body was changed after signing (another value,
    the claims kept), and one saying it is RSA-PSS for the trusted Ed25519 key."""
    task_id = str(uuid.uuid4())
    good = signed_by(keys["trusted"], task_body(f"original-{task_id}", task_id))
    head, body = good.rsplit(".", 1)[0], good.split(".", 4)[4]
    push(node, task_id, head + "." + body.replace(f"original-{task_id}", f"tampered-{task_id}"))
    log = wait_log(node, f"REFUSED task message {task_id} (task nodes.echo) on queue node.x: signature not valid")
    assert f"bad signature for key {trusted_id(keys)}" in log

    typed_id = str(uuid.uuid4())
    push(node, typed_id, signed_by(keys["trusted"], task_body(f"typed-{typed_id}", typed_id),
                                   algorithm=signing.RSA_PSS))
    wait_log(node, f"REFUSED task message {typed_id} (task nodes.echo) on queue node.x: signature not valid")
    wait_log(node, "but the trusted certificate's key is ed25519 (wrong key type)")
    time.sleep(1)
    assert "tampered-" not in node.ran.read_text() and "original-" not in node.ran.read_text()
    assert "typed-" not in node.ran.read_text()


def test_a_celery_auth_message_is_refused_without_the_upgrade_setting(node, tmp_path):
    """Celery's own signed content (how tasks were signed before), even by an RSA key: a node
    accepts it only with AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH."""
    from celery.security.certificate import Certificate  # noqa: PLC0415
    from celery.security.key import PrivateKey  # noqa: PLC0415
    from celery.security.serialization import SecureSerializer  # noqa: PLC0415

    key, cert = rsa_pair(tmp_path)
    old = SecureSerializer(PrivateKey(key.read_text()), Certificate(cert.read_text()), None, "sha256")
    task_id = str(uuid.uuid4())
    push(node, task_id, old.serialize(task_body(f"celery-auth-{task_id}", task_id)), signing.CELERY_AUTH_CONTENT_TYPE)
    wait_log(node, f"REFUSED task message {task_id} (task nodes.echo) on queue node.x: signed with Celery's auth")
    time.sleep(1)
    assert "celery-auth-" not in node.ran.read_text()


# ------------------------------------------------------------------ accepted

def test_a_signed_task_runs_with_its_secrets_opened_and_the_result_holds_none(node, control):
    answer = send(control, "node.x", "signed").get(timeout=30)
    assert answer == {"echo": "signed", "token_ok": True, "password_ok": True}
    assert "signed\n" in node.ran.read_text()
    stored = b"".join(results(node.port).get(k) or b"" for k in results(node.port).keys("celery-task-meta-*"))
    assert stored and TOKEN.encode() not in stored and PASSWORD.encode() not in stored


def queued(port: int, queue: str) -> bytes:
    return redis.Redis(host="127.0.0.1", port=port).lrange(queue, 0, -1)[0]


def inner_kwargs(raw: bytes) -> dict:
    """Every layer of a signed message undone: kombu's JSON, its base64 body, the signed
    format's fields (version, algorithm, key id, signature), the signed JSON body."""
    message = json.loads(raw)
    assert message["content-type"] == signing.CONTENT_TYPE  # aenv's signed serializer
    fields = base64.b64decode(message["body"]).decode().split(".", 4)
    assert fields[:2] == [signing.VERSION, signing.ED25519]
    return json.loads(fields[4])[1]


def test_secrets_are_not_in_the_raw_message_in_redis(node, control):
    send(control, "node.idle", "parked")  # nobody consumes node.idle
    raw = queued(node.port, "node.idle")
    layers = [raw, base64.b64decode(json.loads(raw)["body"])]
    for layer in layers:
        assert TOKEN.encode() not in layer and PASSWORD.encode() not in layer
    kwargs = inner_kwargs(raw)
    assert kwargs["value"] == "parked"  # only the named fields are sealed
    assert sealed.is_sealed(kwargs["access_token"]) and sealed.is_sealed(kwargs["spec"]["from_image_registry"])
    assert sealed.unseal(kwargs["access_token"], "access_token", SECRET) == TOKEN


def test_a_signed_message_replayed_or_moved_to_another_node_is_refused(node, control):
    redis_ = redis.Redis(host="127.0.0.1", port=node.port)
    redis_.delete("node.idle")
    send(control, "node.y", "for-node-y")  # signed for another node: an attacker moves it to node.x
    moved = redis_.rpop("node.y")
    redis_.lpush("node.x", moved)
    moved_id = json.loads(moved)["headers"]["id"]
    wait_log(node, f"REFUSED task {moved_id} (nodes.echo) was signed for queue node.y")
    assert "for-node-y" not in node.ran.read_text()

    once = send(control, "node.idle", "once", signed_for="node.x")  # read off the broker, then delivered twice
    raw = parked(node, "node.idle", once.id)
    redis_.lpush("node.x", raw)
    redis_.lpush("node.x", raw)
    replay_id = json.loads(raw)["headers"]["id"]
    wait_log(node, f"REFUSED task {replay_id} (nodes.echo) was already run here")
    assert node.ran.read_text().count("once\n") == 1


def test_a_message_whose_claims_expired_is_refused(node, control):
    result = send(control, "node.idle", "late", expires=1, signed_for="node.x")
    raw = parked(node, "node.idle", result.id)
    message = json.loads(raw)
    message["headers"]["expires"] = None  # the header is not signed; the claims are
    time.sleep(1.5)
    redis.Redis(host="127.0.0.1", port=node.port).lpush("node.x", json.dumps(message).encode())
    wait_log(node, f"REFUSED task {result.id} (nodes.echo) expired before it started")
    assert "late\n" not in node.ran.read_text()


def test_unsigned_remote_control_is_ignored(node, control):
    """The worker's remote control (pidbox) takes only signed content too: a broker password
    alone cannot ping, let alone shut down, a node."""
    plain = Celery("attacker", broker=f"redis://127.0.0.1:{node.port}/0")
    plain.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    try:
        assert plain.control.ping(timeout=2) == []
        plain.control.broadcast("shutdown")
        time.sleep(2)
    finally:
        plain.close()
    assert node.worker.poll() is None, node.log.read_text()[-3000:]
    assert send(control, "node.x", "after-shutdown").get(timeout=30)["echo"] == "after-shutdown"


# ------------------------------------------------------------------ sealing

def test_seal_and_open_round_trip_nested():
    kwargs = {"sandbox_id": "s", "access_token": "t0k", "source_token": None, "env_vars": {"K": "v"},
              "children": [{"sandbox_id": "c", "access_token": "c-t0k", "env_vars": {}}]}
    out = sealed.seal_fields(kwargs, SECRET)
    assert "t0k" not in json.dumps(out) and out["sandbox_id"] == "s" and out["source_token"] is None
    assert sealed.is_sealed(out["children"][0]["access_token"]) and sealed.is_sealed(out["env_vars"])
    assert sealed.open_fields(out, SECRET) == kwargs
    assert sealed.open_fields(kwargs, SECRET) == kwargs  # a direct call (nothing sealed) passes through


def test_a_tampered_moved_or_foreign_sealed_value_does_not_open():
    box = sealed.seal("t0k", "access_token", SECRET)
    raw = bytearray(base64.urlsafe_b64decode(box[sealed.MARK].split(".", 1)[1]))
    raw[-1] ^= 1
    tampered = {sealed.MARK: "v1." + base64.urlsafe_b64encode(bytes(raw)).decode()}
    with pytest.raises(sealed.SealError, match="does not open"):
        sealed.unseal(tampered, "access_token", SECRET)
    with pytest.raises(sealed.SealError, match="does not open"):  # bound to its field
        sealed.unseal(box, "source_token", SECRET)
    with pytest.raises(sealed.SealError, match="does not open"):
        sealed.unseal(box, "access_token", "another-secret-key")
    with pytest.raises(sealed.SealError, match="version"):
        sealed.unseal({sealed.MARK: "v0.AAAA"}, "access_token", SECRET)
    assert sealed.unseal(box, "access_token", SECRET) == "t0k"


# ------------------------------------------------------------------ keys and settings

def test_write_keys_is_idempotent_and_the_key_is_owner_only(tmp_path):
    key, cert, created = signing.write_keys(tmp_path / "ts")
    assert created and stat.S_IMODE(key.stat().st_mode) == 0o600
    before = key.read_bytes(), cert.read_bytes()
    assert signing.write_keys(tmp_path / "ts")[2] is False
    assert (key.read_bytes(), cert.read_bytes()) == before
    cert.unlink()
    with pytest.raises(ImproperlyConfigured, match="only one of"):
        signing.write_keys(tmp_path / "ts")


def test_resolve_uses_the_default_files_only_when_they_exist_and_refuses_a_missing_path(tmp_path):
    assert signing.resolve("", "", tmp_path / "none") == (None, None)
    key, cert, _ = signing.write_keys(tmp_path / "ts")
    assert signing.resolve("", "", tmp_path / "ts") == (str(key), str(cert))
    with pytest.raises(ImproperlyConfigured, match="does not exist"):
        signing.resolve("", str(tmp_path / "typo.pem"), tmp_path / "ts")
    with pytest.raises(ImproperlyConfigured, match="without its certificate"):
        signing.resolve(str(key), "", tmp_path / "none")
    app = Celery("resolve-test")
    assert signing.configure(app, key=None, cert=None) == "off" and list(app.conf.accept_content) == ["json"]


def pair_signer(key: Path | None, cert: Path) -> signing.Signer:
    return signing.Signer(key.read_bytes() if key else None, cert.read_bytes())


def refused(signer: signing.Signer, payload: str, match: str) -> None:
    with pytest.raises(signing.SignatureRefused, match=match):
        signer.decode(payload)


def test_write_keys_makes_ed25519_and_rotate_keeps_the_old_pair(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: PLC0415
    from cryptography.hazmat.primitives.serialization import load_pem_private_key  # noqa: PLC0415

    key, cert, _ = signing.write_keys(tmp_path / "ts")
    assert isinstance(load_pem_private_key(key.read_bytes(), None), ed25519.Ed25519PrivateKey)
    old_key, old_cert = key.read_bytes(), cert.read_bytes()
    assert signing.write_keys(tmp_path / "ts", rotate=True)[2] is True
    assert key.read_bytes() != old_key and stat.S_IMODE(key.stat().st_mode) == 0o600
    kept = sorted(p.name for p in (tmp_path / "ts").iterdir() if p.name.endswith(".old"))
    assert [n.split(".")[0] for n in kept] == ["cert", "key"]
    assert (tmp_path / "ts" / kept[0]).read_bytes() == old_cert and (tmp_path / "ts" / kept[1]).read_bytes() == old_key
    # An RSA pair made before is kept as it is (no rotate), and still signs.
    rsa_key, rsa_cert = rsa_pair(tmp_path / "rsa")
    before = rsa_key.read_bytes()
    assert signing.write_keys(tmp_path / "rsa") == (rsa_key, rsa_cert, False) and rsa_key.read_bytes() == before


def test_an_rsa_pair_made_before_still_signs_and_only_its_certificate_verifies(tmp_path):
    rsa_key, rsa_cert = rsa_pair(tmp_path / "rsa")
    control, node = pair_signer(rsa_key, rsa_cert), pair_signer(None, rsa_cert)
    assert control.algorithm == signing.RSA_PSS
    body = task_body("rsa", "t1")
    message = control.encode(body)
    assert message.split(".")[1] == signing.RSA_PSS and node.decode(message) == body
    refused(node, message.replace('"rsa"', '"RSA"'), "bad signature")  # the body changed
    ed_key, ed_cert, _ = signing.write_keys(tmp_path / "ed")
    refused(pair_signer(None, ed_cert), message, "not a trusted certificate's")  # another node's trust
    with pytest.raises(ImproperlyConfigured, match="no signing key"):
        node.encode(task_body("x", "t2"))  # a node verifies only


def test_a_certificate_file_with_two_certificates_trusts_both_keys(tmp_path):
    """A rotation: the node's file holds the old (RSA) and the new (Ed25519) certificate."""
    rsa_key, rsa_cert = rsa_pair(tmp_path / "rsa")
    ed_key, ed_cert, _ = signing.write_keys(tmp_path / "ed")
    both = signing.Signer(None, rsa_cert.read_bytes() + ed_cert.read_bytes())
    assert sorted(t.algorithm for t in both.trusted.values()) == [signing.ED25519, signing.RSA_PSS]
    for key, cert in ((rsa_key, rsa_cert), (ed_key, ed_cert)):
        assert both.decode(pair_signer(key, cert).encode(["ok"])) == ["ok"]
    other_key, other_cert, _ = signing.write_keys(tmp_path / "other")
    refused(both, pair_signer(other_key, other_cert).encode(["no"]), "not a trusted certificate's")


def test_a_key_of_another_certificate_an_expired_certificate_and_other_formats_are_refused(tmp_path):
    ed_key, ed_cert, _ = signing.write_keys(tmp_path / "ed")
    other_key, other_cert, _ = signing.write_keys(tmp_path / "other")
    with pytest.raises(ImproperlyConfigured, match="does not belong to the certificate"):
        signing.Signer(ed_key.read_bytes(), other_cert.read_bytes())
    with pytest.raises(ImproperlyConfigured, match="no valid certificate"):
        signing.Signer(None, b"not a certificate")
    node = pair_signer(None, ed_cert)
    message = pair_signer(ed_key, ed_cert).encode(["late"])
    for bad in ("v0" + message[2:], "plain json", message.split(".", 1)[1]):
        refused(node, bad, "not an aenv-signed message")
    next(iter(node.trusted.values())).not_after = time.time() - 1
    refused(node, message, "has expired")


@pytest.fixture
def registry_restored():
    """configure() registers the serializers process-wide: put back what the module's other
    tests registered."""
    from kombu.serialization import registry  # noqa: PLC0415

    saved = [dict(d) for d in (registry._encoders, registry._decoders, registry.type_to_name, registry.name_to_type)]
    yield
    for d, before in zip((registry._encoders, registry._decoders, registry.type_to_name, registry.name_to_type), saved):
        d.clear()
        d.update(before)


def test_celery_auth_content_is_accepted_only_when_configured_and_only_for_rsa(tmp_path, registry_restored):
    from celery.security.certificate import Certificate  # noqa: PLC0415
    from celery.security.key import PrivateKey  # noqa: PLC0415
    from celery.security.serialization import SecureSerializer  # noqa: PLC0415
    from kombu.exceptions import DecodeError  # noqa: PLC0415
    from kombu.serialization import loads  # noqa: PLC0415

    rsa_key, rsa_cert = rsa_pair(tmp_path / "rsa")
    ed_key, ed_cert, _ = signing.write_keys(tmp_path / "ed")
    app = Celery("legacy-test")
    assert signing.configure(app, key=None, cert=str(rsa_cert)) == "verify"
    assert list(app.conf.accept_content) == [signing.SERIALIZER]
    assert signing.configure(app, key=None, cert=str(rsa_cert), accept_celery_auth=True) == "verify"
    assert list(app.conf.accept_content) == [signing.SERIALIZER, signing.CELERY_AUTH]
    old = SecureSerializer(PrivateKey(rsa_key.read_text()), Certificate(rsa_cert.read_text()), None, "sha256")
    accept = {signing.CONTENT_TYPE, signing.CELERY_AUTH_CONTENT_TYPE}
    assert loads(old.serialize(["old"]), signing.CELERY_AUTH_CONTENT_TYPE, "utf-8", accept=accept) == ["old"]
    foreign_key, foreign_cert = rsa_pair(tmp_path / "foreign")
    foreign = SecureSerializer(PrivateKey(foreign_key.read_text()), Certificate(rsa_cert.read_text()), None, "sha256")
    with pytest.raises(DecodeError):
        loads(foreign.serialize(["forged"]), signing.CELERY_AUTH_CONTENT_TYPE, "utf-8", accept=accept)
    with pytest.raises(ImproperlyConfigured, match="RSA only"):  # Celery's auth cannot verify Ed25519
        signing.configure(Celery("e"), key=None, cert=str(ed_cert), accept_celery_auth=True)
    with pytest.raises(ImproperlyConfigured, match="for a node"):  # the control plane never accepts it
        signing.configure(Celery("c"), key=str(rsa_key), cert=str(rsa_cert), accept_celery_auth=True)


# ------------------------------------------------------------------ the real client and node tasks

SIGNING_CONF = ("accept_content", "result_serializer", "result_accept_content", "task_serializer", "worker_consumer")


@pytest.fixture(scope="module")
def signed_app(tmp_path_factory):
    """The Django process's Celery app (nodes.celery_app) signing as the control plane, for
    this module only (the previous configuration comes back after)."""
    from nodes.celery_app import app  # noqa: PLC0415

    before = {k: app.conf[k] for k in SIGNING_CONF}
    key, cert, _ = signing.write_keys(tmp_path_factory.mktemp("cp-signing"))
    assert signing.configure(app, key=str(key), cert=str(cert)) == "sign"
    yield app
    app.conf.update(before)


@pytest.fixture(scope="module")
def signed_node(signed_app, node_worker):
    """test_nodes_client's worker thread (the real agent tasks, a stub VM driver), started
    after the app signs and verifies."""
    return node_worker


@pytest.mark.django_db(transaction=True)
def test_the_real_client_and_node_tasks_keep_secrets_out_of_the_broker(signed_node, monkeypatch):
    """nodes.client.boot_sandbox → agent.tasks.boot_sandbox, signed: envd gets the token and
    the env vars in clear; the bytes pushed into Redis and the result read back hold neither."""
    import asyncio  # noqa: PLC0415

    from kombu.transport import redis as kombu_redis  # noqa: PLC0415

    from nodes import client  # noqa: PLC0415

    pushed, stored = [], []
    real_put, real_ready = kombu_redis.Channel._put, client._ready_meta
    monkeypatch.setattr(kombu_redis.Channel, "_put",
                        lambda self, queue, message, **kw: pushed.append(json.dumps(message).encode())
                        or real_put(self, queue, message, **kw))
    monkeypatch.setattr(client, "_ready_meta", lambda raw: stored.append(raw) or real_ready(raw))
    node = alive_node(signed_node.node_id)
    EnvdStub.bodies.clear()
    out = asyncio.run(client.boot_sandbox(node, sandbox_id="sealed1", env_vars={"API_KEY": PASSWORD},
                                          access_token=TOKEN, deadline=30, **BOOT))
    assert out["pid"] == 4242
    path, body = EnvdStub.bodies[-1]
    assert path == "/init" and body["accessToken"] == TOKEN and body["envVars"] == {"API_KEY": PASSWORD}
    assert len(pushed) == 1 and json.loads(pushed[0])["content-type"] == signing.CONTENT_TYPE  # signed
    kwargs = inner_kwargs(pushed[0])
    assert sealed.is_sealed(kwargs["access_token"]) and sealed.is_sealed(kwargs["env_vars"])
    assert kwargs[signing.CLAIMS]["queue"] == node.queue
    for raw in [*pushed, base64.b64decode(json.loads(pushed[0])["body"]), json.dumps(kwargs).encode(), *stored]:
        raw = raw if isinstance(raw, bytes) else str(raw).encode()
        assert TOKEN.encode() not in raw and PASSWORD.encode() not in raw
    assert stored



def test_the_command_makes_ed25519_and_rotates(tmp_path):
    import io  # noqa: PLC0415

    from django.core.management import call_command  # noqa: PLC0415

    out = io.StringIO()
    call_command("task_signing_keys", dir=str(tmp_path / "ts"), stdout=out)
    assert out.getvalue().startswith("created: key") and "(ed25519)" in out.getvalue()
    rsa_pair(tmp_path / "rsa")
    out = io.StringIO()
    call_command("task_signing_keys", dir=str(tmp_path / "rsa"), stdout=out)
    assert out.getvalue().startswith("kept: key") and f"({signing.RSA_PSS})" in out.getvalue() and "--rotate" in out.getvalue()
    out = io.StringIO()
    call_command("task_signing_keys", dir=str(tmp_path / "rsa"), rotate=True, stdout=out)
    assert out.getvalue().startswith("created: key") and "(ed25519)" in out.getvalue()
    assert len(list((tmp_path / "rsa").glob("*.old"))) == 2
