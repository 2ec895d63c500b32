"""Kubernetes joins (issue 23): a DaemonSet pod presents its projected service-account token to
POST /nodes/join and the control plane checks it with the cluster's TokenReview API
(nodes.token_review, nodes.join.kubernetes_identity / join_kubernetes, agent.join).

Why a TokenReview server of the test's own: no Kubernetes runs on the build machines, so this
contract test starts a real HTTPS endpoint on 127.0.0.1 (a cluster CA and a serving certificate
made here with `cryptography`) that answers POST /apis/authentication.k8s.io/v1/tokenreviews as
the API server does: it authenticates the caller's bearer token, refuses a token whose
audiences miss the review's, and for a pod-bound service-account token answers its user with
the pod's node in `extra`. The control plane runs for real (the Django app over WSGI, its
database), so each answer is the one a node would get."""
from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.core.wsgi import get_wsgi_application
from django.db import connection

from agent import join as node_side
from config.log_redaction import redact
from nodes import join, token_review
from nodes.models import Node, NodeJoinToken

pytestmark = pytest.mark.django_db(transaction=True)

REVIEWER_TOKEN = "control-plane-sa-token-0123456789"  # the control plane's own service-account token
AUDIENCE = "aenv-join"
NODES_ACCOUNT = "aenv:aenv-node"


# --- the API server's TokenReview endpoint --------------------------------------------------

@dataclass
class Claims:
    """What the cluster knows of a token it issued."""
    account: str = NODES_ACCOUNT
    node: str | None = "node-a"
    audiences: tuple[str, ...] = (AUDIENCE,)
    # An authenticator that ignores the review's audiences (answers none): the control plane
    # must not take that as "for aenv-join".
    audience_blind: bool = False


@dataclass
class ApiServer:
    url: str
    ca_file: str
    tokens: dict[str, Claims] = field(default_factory=dict)
    reviews: list[dict] = field(default_factory=list)  # every request: path, authorization, body
    fail_with: int | None = None  # answer every review with this status
    delay: float = 0.0  # answer every review this late


def _review_status(server: ApiServer, spec: dict) -> dict:
    claims = server.tokens.get(spec.get("token", ""))
    if claims is None:
        return {"authenticated": False, "error": "[invalid bearer token, square/go-jose: compact JWS format must "
                                                 "have three parts]"}
    wanted = spec.get("audiences") or ["https://kubernetes.default.svc.cluster.local"]
    common = [a for a in wanted if a in claims.audiences]
    if not common and not claims.audience_blind:
        return {"authenticated": False, "error": f"[invalid bearer token, token audiences {list(claims.audiences)} "
                                                 f"is invalid for the target audiences {wanted}]"}
    namespace, name = claims.account.split(":")
    extra = {}
    if claims.node:
        extra = {token_review.POD_NAME: [f"aenv-node-{claims.node}"], "authentication.kubernetes.io/pod-uid": ["u-1"],
                 token_review.NODE_NAME: [claims.node]}
    return {"authenticated": True, "audiences": [] if claims.audience_blind else common,
            "user": {"username": f"system:serviceaccount:{namespace}:{name}", "uid": "sa-uid",
                     "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                                "system:authenticated"], "extra": extra}}


def _handler(server: ApiServer):
    class TokenReviews(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            server.reviews.append({"path": self.path, "authorization": self.headers.get("Authorization"),
                                   "body": body})
            if server.delay:
                time.sleep(server.delay)
            if self.headers.get("Authorization") != f"Bearer {REVIEWER_TOKEN}":
                return self._answer(401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401})
            if server.fail_with:
                return self._answer(server.fail_with, {"kind": "Status", "status": "Failure", "code": server.fail_with})
            if self.path != token_review.REVIEW_PATH or body.get("kind") != "TokenReview":
                return self._answer(404, {"kind": "Status", "status": "Failure", "code": 404})
            self._answer(201, {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                               "metadata": {"creationTimestamp": None}, "spec": body["spec"],
                               "status": _review_status(server, body["spec"])})
    return TokenReviews


def _certificate(subject: str, key, signer, issuer: str, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
                                  critical=False))
    return builder.sign(signer, hashes.SHA256())


def _pem(thing) -> bytes:
    if isinstance(thing, x509.Certificate):
        return thing.public_bytes(serialization.Encoding.PEM)
    return thing.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())


def _cluster_ca(tmp_path, name: str):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(f"{name} CA", ca_key, ca_key, f"{name} CA", ca=True)
    (tmp_path / f"{name}-ca.crt").write_bytes(_pem(ca))
    return ca_key, tmp_path / f"{name}-ca.crt"


@pytest.fixture
def cluster(settings, tmp_path):
    """The API server's TokenReview endpoint over HTTPS, and the control plane configured to
    ask it (AENV_NODE_JOIN_KUBERNETES on, its own token and the cluster's CA in files)."""
    ca_key, ca_file = _cluster_ca(tmp_path, "cluster")
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "apiserver.pem").write_bytes(_pem(_certificate("kube-apiserver", key, ca_key, "cluster CA", ca=False))
                                             + _pem(key))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "apiserver.pem")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), None)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    server = ApiServer(url=f"https://127.0.0.1:{httpd.server_address[1]}", ca_file=str(ca_file))
    httpd.RequestHandlerClass = _handler(server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    (tmp_path / "sa-token").write_text(REVIEWER_TOKEN + "\n")
    settings.AENV_NODE_JOIN_KUBERNETES = True
    settings.AENV_NODE_JOIN_KUBERNETES_AUDIENCE = AUDIENCE
    settings.AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT = NODES_ACCOUNT
    settings.AENV_KUBERNETES_API_URL = server.url
    settings.AENV_KUBERNETES_TOKEN_FILE = str(tmp_path / "sa-token")
    settings.AENV_KUBERNETES_CA_FILE = server.ca_file
    settings.AENV_KUBERNETES_TIMEOUT = 1
    server.stop = lambda: (httpd.shutdown(), httpd.server_close())
    yield server
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def http():
    """A client on the real app (what agent.join posts with)."""
    with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()),
                      base_url="http://control.test") as c:
        yield c


@pytest.fixture
def pod(settings, tmp_path):
    """The node pod's side: the control plane's URL, joining required, its projected token's file."""
    settings.AENV_CONTROL_PLANE_URL = "http://control.test"
    settings.AENV_NODE_JOIN_REQUIRED = True
    settings.AENV_NODE_JOIN_TOKEN = ""
    settings.AENV_HOME = tmp_path / "home"
    settings.AENV_HOME.mkdir()
    token_file = tmp_path / "join" / "token"
    token_file.parent.mkdir()
    settings.AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE = str(token_file)
    return token_file


def _join(http, token, node_id="node-a", **headers):
    return http.post("/nodes/join", json={"kubernetesToken": token, "nodeId": node_id}, headers=headers)


# --- joining ---------------------------------------------------------------------------------

def test_a_pod_joins_as_its_node_and_checks_in_with_its_credential(cluster, pod, http):
    """The node worker's own start (agent.join, as run_node calls it): the pod's token
    becomes a credential of its own, kept for later starts; the review carried the audience,
    the token, and the control plane's bearer token."""
    cluster.tokens["pod-token-a"] = Claims(node="node-a")
    pod.write_text("pod-token-a\n")
    credential = node_side.ensure_joined("node-a", wait=0, http=http)
    assert credential.startswith(join.CREDENTIAL_MARK)
    node = Node.objects.get(pk="node-a")
    assert node.credential_hash == join.hash_secret(credential) and node.joined_via is None
    [review] = cluster.reviews
    assert review["path"] == "/apis/authentication.k8s.io/v1/tokenreviews"
    assert review["authorization"] == f"Bearer {REVIEWER_TOKEN}"
    assert review["body"] == {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                              "spec": {"token": "pod-token-a", "audiences": [AUDIENCE]}}
    # the credential works for check-in (for its own id only), and the next start uses it: no review
    assert http.post("/nodes/check-in", json={"nodeId": "node-a"},
                     headers={"Authorization": f"Bearer {credential}"}).json() == {"nodeId": "node-a"}
    assert node_side.ensure_joined("node-a", wait=0, http=http) == credential
    assert len(cluster.reviews) == 1


def test_the_node_id_is_the_pods_node_and_a_rejoin_replaces_the_credential(cluster, http, assert_error):
    """No nodeId: the pod's node name. A pod on a node that joined before (its host's
    AENV_HOME lost) gets a new credential; the old one stops working."""
    cluster.tokens["pod-token-b"] = Claims(node="node-b")
    first = http.post("/nodes/join", json={"kubernetesToken": "pod-token-b"})
    assert first.status_code == 200 and first.json()["nodeId"] == "node-b"
    assert first.headers["Cache-Control"] == "no-store"
    second = _join(http, "pod-token-b", "node-b")
    assert second.status_code == 200 and second.json()["credential"] != first.json()["credential"]
    assert_error(http.post("/nodes/check-in", json={}, headers={"Authorization": f"Bearer {first.json()['credential']}"}),
                 401, "unknown node credential")


def test_each_refusal_has_its_status_and_code(cluster, http, assert_error):
    """Unknown, wrong-audience, audience-blind, wrong-account, unbound and other-node tokens:
    401/403 JSON {code, message, error_code}, and no node row."""
    cluster.tokens.update({
        "for-the-api-server": Claims(audiences=("https://kubernetes.default.svc.cluster.local",)),
        "audience-blind": Claims(audience_blind=True),
        "default-account": Claims(account="aenv:default"),
        "other-namespace": Claims(account="tenant:aenv-node"),
        "no-pod": Claims(node=None),
        "pod-on-b": Claims(node="node-b"),
    })
    cases = [("not-a-token", 401, "kubernetes_token_invalid", "invalid bearer token"),
             ("for-the-api-server", 401, "kubernetes_token_invalid", "is invalid for the target audiences"),
             ("audience-blind", 403, "kubernetes_token_audience", "not for the audience 'aenv-join'"),
             ("default-account", 403, "kubernetes_token_service_account", "system:serviceaccount:aenv:default"),
             ("other-namespace", 403, "kubernetes_token_service_account", "aenv:aenv-node"),
             ("no-pod", 403, "kubernetes_token_no_node", "names no node"),
             ("pod-on-b", 403, "kubernetes_token_other_node", "on node node-b, not node-a")]
    for token, status, code, words in cases:
        body = assert_error(_join(http, token), status, words)
        assert body["error_code"] == code, token
    assert len(cluster.reviews) == len(cases)
    assert not Node.objects.exists()
    # a join token and a Kubernetes token at once; neither
    _, raw = join.create_token()
    assert_error(_join(http, "pod-on-b", "node-b", Authorization=f"Bearer {raw}"), 400, "not both")
    assert_error(http.post("/nodes/join", json={"kubernetesToken": "", "nodeId": "node-a"}), 401, "kubernetesToken")


def test_kubernetes_joins_are_off_by_default(cluster, settings, http, assert_error):
    settings.AENV_NODE_JOIN_KUBERNETES = False
    cluster.tokens["pod-token-a"] = Claims()
    body = assert_error(_join(http, "pod-token-a"), 403, "AENV_NODE_JOIN_KUBERNETES is off")
    assert body["error_code"] == "kubernetes_join_off" and cluster.reviews == []


def test_a_review_that_cannot_be_had_is_503(cluster, settings, http, assert_error, tmp_path, monkeypatch):
    """The API server failing, slow, refusing the control plane, gone, or not trusted: 503
    (the node may retry), never 500, and no node row."""
    cluster.tokens["pod-token-a"] = Claims()

    def unavailable(words):
        body = assert_error(_join(http, "pod-token-a"), 503, words)
        assert body["error_code"] == "kubernetes_review_unavailable"

    cluster.fail_with = 500
    unavailable("answered 500")
    cluster.fail_with = 403
    unavailable("system:auth-delegator")
    cluster.fail_with = None
    cluster.delay = 2.5
    unavailable("did not answer within 1 s")
    cluster.delay = 0
    (tmp_path / "stale-token").write_text("an-old-token")
    settings.AENV_KUBERNETES_TOKEN_FILE = str(tmp_path / "stale-token")
    unavailable("does not accept the control plane's own service-account token")
    settings.AENV_KUBERNETES_TOKEN_FILE = str(tmp_path / "missing")
    unavailable("service-account token")
    settings.AENV_KUBERNETES_TOKEN_FILE = str(tmp_path / "sa-token")
    _, other_ca = _cluster_ca(tmp_path, "other")
    settings.AENV_KUBERNETES_CA_FILE = str(other_ca)
    unavailable("cannot be reached")  # the API server's certificate is not the trusted cluster's
    settings.AENV_KUBERNETES_CA_FILE = cluster.ca_file
    settings.AENV_KUBERNETES_API_URL = ""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    unavailable("not in a pod")
    settings.AENV_KUBERNETES_API_URL = cluster.url
    cluster.stop()
    unavailable("cannot be reached")
    assert not Node.objects.exists()


def test_in_cluster_the_api_server_is_the_kubernetes_service(settings, monkeypatch):
    settings.AENV_KUBERNETES_API_URL = ""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert token_review.api_url() == "https://10.96.0.1:443"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00:10:96::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    assert token_review.api_url() == "https://[fd00:10:96::1]:6443"
    settings.AENV_KUBERNETES_API_URL = "https://kube.example:6443"
    assert token_review.api_url() == "https://kube.example:6443"


# --- revocation ------------------------------------------------------------------------------

def test_a_revoked_node_comes_back_only_with_a_token_issued_for_it(cluster, pod, http, assert_error):
    """Revoked: its credential and its pod's token are both refused (the node stops with the
    message), whatever unbound or earlier token exists; once an operator issues a token for
    its id, the pod's next join spends it and the node is back."""
    cluster.tokens["pod-token-a"] = Claims(node="node-a")
    pod.write_text("pod-token-a")
    node_side.ensure_joined("node-a", wait=0, http=http)
    _, before = join.create_token(node_id="node-a")
    join.revoke_node("node-a")
    _, unbound = join.create_token()
    with pytest.raises(node_side.NodeNotAdmitted, match="403.*revoked"):
        node_side.ensure_joined("node-a", wait=0, http=http)
    assert assert_error(_join(http, "pod-token-a"), 403, "was revoked")["error_code"] == "node_revoked"
    issued, _ = join.create_token(node_id="node-a")
    credential = node_side.ensure_joined("node-a", wait=0, http=http)
    node = Node.objects.get(pk="node-a")
    assert node.revoked_at is None and not node.draining and node.joined_via_id == issued.pk
    assert node.credential_hash == join.hash_secret(credential)
    issued.refresh_from_db()
    assert issued.state() == "used" and issued.used_by == "node-a"
    assert NodeJoinToken.objects.get(prefix=unbound[:join.PREFIX_LEN]).state() == "active"
    assert NodeJoinToken.objects.get(prefix=before[:join.PREFIX_LEN]).state() == "revoked"


def test_a_pod_without_its_token_file_does_not_start(pod, http):
    with pytest.raises(node_side.NodeNotAdmitted, match="cannot be read .*projected token volume"):
        node_side.ensure_joined("node-a", wait=0, http=http)


def test_the_join_token_of_a_pod_never_reaches_a_log(caplog):
    """A projected token is a JWT; logs show none."""
    jwt = "eyJhbGciOiJSUzI1NiIsImtpZCI6IjEifQ.eyJhdWQiOlsiYWVudi1qb2luIl19.c2lnbmF0dXJlLWJ5dGVz-_x"
    text = redact(f'posting {{"kubernetesToken": "{jwt}", "nodeId": "node-a"}} failed; token {jwt}')
    assert "eyJ" not in text and text.count("[redacted]") == 2
    with caplog.at_level(logging.WARNING):
        logging.getLogger("agent.join").warning("join with %s refused", jwt)
    assert jwt not in caplog.text


def test_with_database_roles_a_kubernetes_join_gets_its_role(cluster, settings, http):
    """The same outcome as a token join: the node's own PostgreSQL role in the answer."""
    if connection.vendor != "postgresql":
        pytest.skip("per-node database roles need PostgreSQL (the PostgreSQL pass of scripts/test.sh)")
    from tests.unit.test_node_db_roles import _drop_role  # noqa: PLC0415 - the roles' own cleanup
    from nodes import db_roles  # noqa: PLC0415
    settings.AENV_NODE_DATABASE_ROLES = True
    node_id = "k8s-roles-node"
    cluster.tokens["pod-token"] = Claims(node=node_id)
    try:
        answer = _join(http, "pod-token", node_id)
        assert answer.status_code == 200, answer.text
        assert f"{db_roles.role_name(node_id)}:" in answer.json()["databaseUrl"]
    finally:
        _drop_role(db_roles.role_name(node_id))
