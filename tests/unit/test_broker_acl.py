"""The broker's ACL users (deploy/redis/users.acl.template, rendered by
deploy/redis/render-acl.sh) against real ``redis-server`` processes of our own (free
loopback ports, tmp dirs; never the machine's :6379): no connection without credentials or
with wrong ones; a real Celery round trip with the control-plane user sending to ``node.x``
and a real worker process, as the node user, answering — with nothing denied on the way
(``ACL LOG`` stays empty, so the ACL holds everything kombu uses); what the node user must
not do is refused; and the same over TLS (``rediss://`` with ``ssl_cert_reqs=required`` and
the CA), where a plaintext connection gets nothing. Per-node users (``aenv-node-a``): a worker
consumes ``node.a`` with nothing refused, and ``node.b`` is out of its reach (the role user, the
contrast, reaches it)."""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery

from agent.worker import worker_argv
from events.management.commands.run_events_worker import worker_argv as events_worker_argv
from harness.stack import free_port

ROOT = Path(__file__).resolve().parents[2]
RENDER = ROOT / "deploy" / "redis" / "render-acl.sh"
CONTROL, NODE = "aenv-control", "aenv-node"
NODE_A, NODE_B = "aenv-node-a", "aenv-node-b"  # per-node users (NODE_IDS="a b"): queues node.a, node.b

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (scripts/setup.sh)")

# The worker: a Celery app as the node's (json only, no late acks, prefetch 1), with one task.
WORKER_APP = '''
import os
from celery import Celery
app = Celery("acltest", broker=os.environ["BROKER"], backend=os.environ["BACKEND"])
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                task_acks_late=False, worker_prefetch_multiplier=1, result_expires=3600,
                broker_connection_retry_on_startup=True)

@app.task(name="nodes.echo")
def echo(value):
    return {"echo": value, "pid": os.getpid()}
'''


def stop_worker(worker: subprocess.Popen) -> str:
    """A Celery worker subprocess stopped (SIGTERM, then SIGKILL after 30 s): its output."""
    worker.terminate()
    try:
        out, _ = worker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        out, _ = worker.communicate()
    return out


@dataclass
class Broker:
    port: int
    passwords: dict
    home: Path
    tls: dict | None = None  # {"ca": path} when TLS-only

    def url(self, user: str | None, db: int, password: str | None = None) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f"{user}:{password or self.passwords[user]}@" if user else ""
        query = f"?ssl_cert_reqs=required&ssl_ca_certs={self.tls['ca']}" if self.tls else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{db}{query}"

    def client(self, user: str | None = CONTROL, **kw) -> redis.Redis:
        extra = {"ssl": True, "ssl_ca_certs": self.tls["ca"], "ssl_cert_reqs": "required"} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, username=user,
                           password=self.passwords.get(user) if user else None,
                           socket_timeout=5, **extra, **kw)


def render_acl(path: Path) -> dict:
    passwords = {user: secrets.token_hex(32) for user in (CONTROL, NODE, NODE_A, NODE_B)}
    env = {**os.environ, "REDIS_CONTROL_PASSWORD": passwords[CONTROL], "REDIS_NODE_PASSWORD": passwords[NODE],
           "NODE_IDS": "a b", "REDIS_NODE_PASSWORD_A": passwords[NODE_A], "REDIS_NODE_PASSWORD_B": passwords[NODE_B]}
    out = subprocess.run(["sh", str(RENDER)], env=env, check=True, capture_output=True, text=True).stdout
    path.write_text(out)
    return passwords


ADMIN = "acl-test-admin"  # the test's own, appended to the rendered file: only it reads ACL LOG


def start_redis(home: Path, tls_args: list[str] | None = None):
    passwords = render_acl(home / "users.acl")
    passwords[ADMIN] = secrets.token_hex(32)
    with (home / "users.acl").open("a") as f:
        f.write(f"user {ADMIN} on >{passwords[ADMIN]} ~* &* +@all\n")
    port = free_port()
    listen = ["--port", "0", "--tls-port", str(port), *tls_args] if tls_args else ["--port", str(port)]
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", *listen, "--aclfile", str(home / "users.acl"),
                             "--save", "", "--appendonly", "no", "--dir", str(home), "--logfile", str(home / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port, passwords


def wait_up(broker: Broker, proc) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            if broker.client().ping():
                return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (broker.home / "redis.log").read_text() if (broker.home / "redis.log").exists() else ""
                raise AssertionError(f"redis-server did not start: {log[-2000:]}") from None
            time.sleep(0.05)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    home = tmp_path_factory.mktemp("acl-redis")
    proc, port, passwords = start_redis(home)
    b = Broker(port, passwords, home)
    try:
        wait_up(b, proc)
        yield b
    finally:
        stop(proc)


def make_ca_and_server_cert(where: Path) -> dict:
    """A test CA and a server certificate for 127.0.0.1 signed by it (``cryptography``)."""
    from cryptography import x509  # noqa: PLC0415 - only the TLS test needs it
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    now = datetime.datetime.now(datetime.timezone.utc)

    def write_key(key, name):
        (where / name).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv test broker CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (where / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (where / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(key, "server.key")
    return {"ca": str(where / "ca.pem"), "cert": str(where / "server.pem"), "key": str(where / "server.key")}


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    home = tmp_path_factory.mktemp("acl-redis-tls")
    files = make_ca_and_server_cert(home)
    proc, port, passwords = start_redis(home, ["--tls-cert-file", files["cert"], "--tls-key-file", files["key"],
                                               "--tls-ca-cert-file", files["ca"], "--tls-auth-clients", "no"])
    b = Broker(port, passwords, home, tls={"ca": files["ca"]})
    try:
        wait_up(b, proc)
        yield b
    finally:
        stop(proc)


def round_trip(broker: Broker, tmp_path: Path, queue: str = "node.x", user: str = NODE,
               argv: list[str] | None = None) -> dict:
    """The control-plane user sends ``nodes.echo`` to ``queue``; a real worker process (the
    node's flags: agent.worker.worker_argv, or ``argv``) as ``user`` runs it; the sender reads
    the result."""
    (tmp_path / "acl_worker_app.py").write_text(WORKER_APP)
    env = {**os.environ, "BROKER": broker.url(user, 0), "BACKEND": broker.url(user, 1),
           "PYTHONPATH": str(tmp_path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # a plain Celery app: no Django fixup in the worker
    argv = list(argv or worker_argv(queue.removeprefix("node."), 2, "WARNING"))
    argv[argv.index("--concurrency") + 1] = "2"
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "acl_worker_app", *argv], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    producer = Celery("acltest-producer", broker=broker.url(CONTROL, 0), backend=broker.url(CONTROL, 1))
    producer.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                         broker_connection_retry_on_startup=True)
    try:
        result = producer.send_task("nodes.echo", kwargs={"value": "hello"}, queue=queue, expires=60)
        answer = result.get(timeout=60)
    finally:
        out = stop_worker(worker)
        producer.close()
    assert worker.returncode in (0, -15), out
    assert "NOPERM" not in out and "Traceback" not in out, out
    assert answer["echo"] == "hello" and answer["pid"] == worker.pid, (answer, out)
    return answer


def acl_denials(broker: Broker) -> list:
    return [{k: (v.decode() if isinstance(v, bytes) else v) for k, v in entry.items()
             if k in ("username", "reason", "object", "context")} for entry in broker.client(ADMIN).acl_log()]


# ---------------------------------------------------------------- (a) who may connect

def test_no_credentials_and_wrong_credentials_are_refused(broker):
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: the default user is off
        broker.client(None).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=broker.port, username=NODE, password="x" * 64).ping()
    with pytest.raises(redis.AuthenticationError):  # the other user's password
        redis.Redis(host="127.0.0.1", port=broker.port, username=NODE, password=broker.passwords[CONTROL]).ping()
    with pytest.raises(redis.AuthenticationError):  # the old style: AUTH <password> is the default user
        redis.Redis(host="127.0.0.1", port=broker.port, password=broker.passwords[CONTROL]).ping()
    assert broker.client(NODE).ping() and broker.client(CONTROL).ping()


def test_a_celery_client_without_credentials_cannot_send(broker):
    app = Celery("anon", broker=broker.url(None, 0))
    app.conf.broker_connection_retry_on_startup = False
    try:
        with pytest.raises(Exception, match="(?i)auth"):
            app.send_task("nodes.echo", kwargs={"value": 1}, queue="node.x", retry=False)
    finally:
        app.close()
    assert broker.client(CONTROL).llen("node.x") == 0


def test_the_rendered_file_holds_no_password_and_refuses_short_ones(tmp_path):
    passwords = render_acl(tmp_path / "users.acl")
    text = (tmp_path / "users.acl").read_text()
    assert "user default off" in text and not any(p in text for p in passwords.values())
    assert "#" not in text.split("\n")[0] and "{{" not in text
    env = {**os.environ, "REDIS_CONTROL_PASSWORD": "short", "REDIS_NODE_PASSWORD": "n" * 40}
    done = subprocess.run(["sh", str(RENDER)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "REDIS_CONTROL_PASSWORD" in done.stderr
    env["REDIS_CONTROL_PASSWORD"] = "a" * 31 + "@"  # would break a redis:// URL
    done = subprocess.run(["sh", str(RENDER)], env=env, capture_output=True, text=True)
    assert done.returncode == 2


# ---------------------------------------------------------------- (b) the round trip

def test_celery_round_trip_with_the_acl_users(broker, tmp_path):
    broker.client(ADMIN).acl_log_reset()
    round_trip(broker, tmp_path)
    assert acl_denials(broker) == []  # nothing kombu or the worker did was refused


def test_celery_round_trip_as_a_per_node_user(broker, tmp_path):
    """aenv-node-a, whose keys are node.a's (and the shared kombu/result keys), runs a worker
    on node.a: a real round trip, nothing refused."""
    broker.client(ADMIN).acl_log_reset()
    round_trip(broker, tmp_path, queue="node.a", user=NODE_A)
    assert acl_denials(broker) == []


def test_the_control_planes_queue_is_the_control_users_alone(broker, tmp_path):
    """control.events (webhook deliveries: manage.py run_events_worker's flags) runs a real
    worker as the control-plane user with nothing refused; no node user may push to it, to its
    priority lists, or take from it (the control user, the contrast, may)."""
    broker.client(ADMIN).acl_log_reset()
    round_trip(broker, tmp_path, queue="control.events", user=CONTROL,
               argv=events_worker_argv("control.events", 2, "WARNING"))
    assert acl_denials(broker) == []
    calls = {"LPUSH": lambda c: c.lpush("control.events", "x"),
             "LPUSH priority": lambda c: c.lpush("control.events\x06\x163", "x"),
             "BRPOP": lambda c: c.brpop(["control.events"], timeout=0.1)}
    for user in (NODE, NODE_A):
        for name, call in calls.items():
            assert _refused(lambda: call(broker.client(user))), f"{user} may {name} control.events"
    control = broker.client(CONTROL)
    for name, call in calls.items():
        assert not _refused(lambda: call(control)), f"the control user may not {name} control.events"
    control.delete("control.events", "control.events\x06\x163")


# ---------------------------------------------------------------- (c) least rights of the node user

def _refused(call) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_a_per_node_user_cannot_push_to_or_read_another_nodes_queue(broker):
    """As aenv-node-a: node.b (and its priority lists and bindings) is out of reach; the shared
    role user aenv-node (or, for LRANGE, the control plane) does the same calls, and
    aenv-node-a does them on its own node.a, so each refusal is the per-node user's."""
    def calls(queue):
        return {
            "LPUSH": lambda c: c.lpush(queue, "x"), "RPUSH": lambda c: c.rpush(queue, "x"),
            "LPUSH priority": lambda c: c.lpush(f"{queue}\x06\x163", "x"),
            "BRPOP": lambda c: c.brpop([queue], timeout=0.1), "LLEN": lambda c: c.llen(queue),
            "SADD binding": lambda c: c.sadd(f"_kombu.binding.{queue}", f"{queue}\x06\x16\x06\x16node.a"),
            "DEL": lambda c: c.delete(f"_kombu.binding.{queue}-nothing", queue + "-nothing"),
        }
    node_a, role, control = broker.client(NODE_A), broker.client(NODE), broker.client(CONTROL)
    for name, call in calls("node.b").items():
        assert _refused(lambda: call(node_a)), f"{NODE_A} may {name} node.b"
        assert not _refused(lambda: call(role)), f"the role user may not {name} node.b: no contrast"
    for name, call in calls("node.a").items():
        if name != "DEL":  # node.a-nothing is no key of node a's
            assert not _refused(lambda: call(node_a)), f"{NODE_A} may not {name} its own node.a"
    assert _refused(lambda: node_a.lrange("node.b", 0, -1)) and _refused(lambda: node_a.lrange("node.a", 0, -1))
    assert control.lrange("node.b", 0, -1)  # the role user pushed there above; the control plane reads it
    with pytest.raises(redis.exceptions.NoPermissionError):  # nor another node's remote-control mailbox
        node_a.lpush("b@host.celery.pidbox", "x")
    node_a.lpush("a@host.celery.pidbox", "x")
    control.delete("node.a", "node.b", "node.a\x06\x163", "node.b\x06\x163", "a@host.celery.pidbox")
    control.srem("_kombu.binding.node.a", "node.a\x06\x16\x06\x16node.a")
    control.srem("_kombu.binding.node.b", "node.b\x06\x16\x06\x16node.a")


def test_per_node_users_are_rendered_from_node_ids_and_the_role_user_is_off_without_its_password(tmp_path):
    base = {**os.environ, "REDIS_CONTROL_PASSWORD": "c" * 64}
    base.pop("REDIS_NODE_PASSWORD", None)
    done = subprocess.run(["sh", str(RENDER), str(RENDER.parent / "users.acl.template"), "node-1", "n.2"],
                          env={**base, "REDIS_NODE_PASSWORD_NODE_1": "1" * 64, "REDIS_NODE_PASSWORD_N_2": "2" * 64},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    users = {line.split()[1]: line for line in done.stdout.splitlines()}
    assert set(users) == {"default", CONTROL, NODE, "aenv-node-node-1", "aenv-node-n.2"}
    assert users[NODE].startswith("user aenv-node off resetpass resetkeys")  # no password: no login
    assert " ~node.node-1 " in users["aenv-node-node-1"] and "~node.*" not in users["aenv-node-node-1"]
    assert "1" * 64 not in done.stdout and "{{" not in done.stdout
    missing = subprocess.run(["sh", str(RENDER)], env={**base, "NODE_IDS": "node-1"}, capture_output=True, text=True)
    assert missing.returncode == 2 and "REDIS_NODE_PASSWORD_NODE_1" in missing.stderr and not missing.stdout
    bad = subprocess.run(["sh", str(RENDER)], env={**base, "NODE_IDS": "Node*", "REDIS_NODE_PASSWORD_NODE*": "x" * 64},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "node id" in bad.stderr

@pytest.mark.parametrize("command", [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "yes"), ("KEYS", "*"),
    ("SCAN", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("ACL", "SETUSER", "x", "on"),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "TYPE", "normal"), ("MONITOR",), ("SCRIPT", "FLUSH"), ("SAVE",),
    ("REPLICAOF", "127.0.0.1", "1"), ("MODULE", "LIST"), ("FUNCTION", "FLUSH"), ("SWAPDB", "0", "1"),
], ids=lambda c: " ".join(c[:2]))
def test_the_node_user_cannot_run_admin_or_dangerous_commands(broker, command):
    with pytest.raises(redis.exceptions.NoPermissionError):
        broker.client(NODE).execute_command(*command)


def test_the_node_user_cannot_touch_channels_keys_or_other_keys(broker):
    control, node = broker.client(CONTROL, db=2), broker.client(NODE, db=2)
    control.zadd("asgi:group:sandbox-events", {"specific.abc!def": 1.0})
    control.set("asgi-secret", "x")
    for call in (lambda: node.zrange("asgi:group:sandbox-events", 0, -1), lambda: node.get("asgi-secret"),
                 lambda: node.delete("asgi-secret"), lambda: node.set("other:key", "x"),
                 lambda: node.get("sessions:abc"), lambda: node.eval("return redis.call('get', KEYS[1])", 1, "asgi-secret"),
                 lambda: node.eval("return redis.call('get', 'asgi-secret')", 0)):
        with pytest.raises((redis.exceptions.NoPermissionError, redis.exceptions.ResponseError), match="(?i)perm|acl|can't access"):
            call()
    with pytest.raises(redis.exceptions.NoPermissionError):
        node.publish("asgi:anything", "x")
    assert control.get("asgi-secret") == b"x"  # the control plane has them


def test_the_control_plane_user_has_no_admin_commands_either(broker):
    for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            broker.client(CONTROL).execute_command(*command)


# ---------------------------------------------------------------- (d) TLS

def test_tls_round_trip_with_the_ca_and_a_refused_plaintext_connection(tls_broker, tmp_path):
    tls_broker.client(ADMIN).acl_log_reset()
    round_trip(tls_broker, tmp_path)
    assert acl_denials(tls_broker) == []
    with pytest.raises(redis.ConnectionError):  # plaintext to the TLS port: no answer
        redis.Redis(host="127.0.0.1", port=tls_broker.port, username=NODE, password=tls_broker.passwords[NODE],
                    socket_timeout=3, socket_connect_timeout=3).ping()


def test_tls_refuses_a_server_the_ca_did_not_sign(tls_broker, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    wrong_ca = make_ca_and_server_cert(other)["ca"]
    client = redis.Redis.from_url(tls_broker.url(NODE, 0).replace(tls_broker.tls["ca"], wrong_ca), socket_timeout=3)
    with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
        client.ping()


def test_the_control_plane_user_runs_the_channel_layer(broker):
    """Channels (channels_redis) as the control-plane user: a send and a group send arrive,
    and nothing is denied; the node user cannot."""
    import asyncio  # noqa: PLC0415

    from channels_redis.core import RedisChannelLayer  # noqa: PLC0415

    async def exchange(user: str):
        layer = RedisChannelLayer(hosts=[broker.url(user, 2)])
        try:
            name = await layer.new_channel()
            await layer.send(name, {"type": "hello"})
            first = await asyncio.wait_for(layer.receive(name), 5)
            await layer.group_add("sandbox-events", name)
            await layer.group_send("sandbox-events", {"type": "event"})
            second = await asyncio.wait_for(layer.receive(name), 5)
            await layer.group_discard("sandbox-events", name)
            return first, second
        finally:
            await layer.close_pools()

    broker.client(ADMIN).acl_log_reset()
    assert asyncio.run(exchange(CONTROL)) == ({"type": "hello"}, {"type": "event"})
    assert acl_denials(broker) == []
    with pytest.raises(redis.exceptions.NoPermissionError):
        asyncio.run(exchange(NODE))


# ---------------------------------------------------------------- the shipped configurations

def test_compose_gives_every_process_its_redis_user_and_redis_the_acl():
    import yaml  # noqa: PLC0415

    services = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]
    redis_service = services["redis"]
    assert "--aclfile" in " ".join(redis_service["command"]) and "render-acl.sh" in " ".join(redis_service["command"])
    assert "./redis:/aenv-redis:ro" in redis_service["volumes"]
    assert "--user aenv-node-node-1" in " ".join(redis_service["healthcheck"]["test"])
    # aenv's own processes (the data services' images are aenv-postgres, aenv-redis, ...)
    aenv = {name: s for name, s in services.items()
            if s.get("image", "").split(":")[0] in ("aenv-control-plane", "aenv-node")}
    nodes = sorted(n for n in aenv if n.startswith("node-"))
    assert len(nodes) == 3
    # one Redis user per node service, each rendered from its own password; the role user is off
    assert redis_service["environment"]["NODE_IDS"].split() == nodes
    assert "REDIS_NODE_PASSWORD" not in redis_service["environment"]
    for name, s in aenv.items():
        env = s["environment"]
        urls = [env[k] for k in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "AENV_CHANNEL_LAYER_URL") if env.get(k)]
        assert urls, name
        node = name.startswith("node-")
        if node:
            assert env["AENV_NODE_ID"] == name
            user, secret = f"aenv-node-{name}", "REDIS_NODE_PASSWORD_" + name.upper().replace("-", "_")
            assert secret in redis_service["environment"], name
        else:
            user, secret = CONTROL, "REDIS_CONTROL_PASSWORD"
        for url in urls:
            assert url.startswith(f"redis://{user}:${{{secret}" + ("}" if node else "")) and "@redis:6379/" in url, (name, url)
        if node:  # a node never holds the control plane's password, nor another node's
            others = [n.upper().replace("-", "_") for n in nodes if n != name]
            assert not any("REDIS_CONTROL_PASSWORD" in str(v) or any(o in str(v) for o in others) for v in env.values()), name
