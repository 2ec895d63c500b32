"""The node's side of joining (``nodes.join``): on its first start a node given
``AENV_CONTROL_PLANE_URL`` spends ``AENV_NODE_JOIN_TOKEN`` at ``POST /nodes/join`` and keeps
the credential it gets in ``AENV_HOME/node_credential`` (0600); at every later start it
presents that credential to ``POST /nodes/check-in``. The control plane's refusal (unknown:
401, revoked: 403) stops the node with its message: ``NodeNotAdmitted``.

A Kubernetes DaemonSet pod has no join token: given ``AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE``
(its projected service-account token, which the kubelet rotates, so it is read at each join)
it posts that file's token as ``kubernetesToken`` instead, and the control plane checks it
with the cluster (``nodes.join.kubernetes_identity``).

Where the control plane hands out per-node database roles (``nodes.db_roles``), the join's
answer also carries ``databaseUrl``: it is kept in ``AENV_NODE_DATABASE_URL_FILE`` (0600)
and the process then re-executes itself, so that its settings load the role from their
start (``config.node_database``) and no connection, pool or thread keeps the old user."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import httpx
from django.conf import settings
from nodes.signing import write_atomically

log = logging.getLogger(__name__)

CREDENTIAL_FILE = "node_credential"
# How long a starting node waits for the control plane to answer at all (it may start first).
CONNECT_WAIT = 120.0


class NodeNotAdmitted(Exception):
    """The node may not run: no way to join, or the control plane refused it."""


class Refused(NodeNotAdmitted):
    """The control plane answered, and said no (its message says why)."""


def credential_path() -> Path:
    return Path(settings.AENV_HOME) / CREDENTIAL_FILE


def stored_credential(node_id: str) -> str | None:
    """This node id's credential from an earlier join, or None."""
    try:
        saved = json.loads(credential_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("nodeId") != node_id:
        return None
    return saved.get("credential") or None


def store_credential(node_id: str, credential: str) -> None:
    write_atomically(credential_path(), json.dumps({"nodeId": node_id, "credential": credential}).encode(), 0o600)


def store_database_url(url: str) -> Path:
    path = Path(settings.AENV_NODE_DATABASE_URL_FILE)
    write_atomically(path, (url + "\n").encode(), 0o600)
    return path


def restart_process() -> None:
    """Run this same command again (same interpreter, arguments and environment)."""
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def kubernetes_token() -> str | None:
    """The pod's projected service-account token (AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE), or
    None where none is configured; a configured file that cannot be read: NodeNotAdmitted."""
    path = settings.AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise NodeNotAdmitted(f"the Kubernetes token AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE={path} cannot be read "
                              f"({exc.strerror or exc}): is the projected token volume mounted?") from exc
    if not token:
        raise NodeNotAdmitted(f"the Kubernetes token file {path} is empty")
    return token


def _post(path: str, bearer: str | None, body: dict, wait: float, http: httpx.Client | None) -> dict:
    """POST to the control plane, retrying while it cannot be reached (for ``wait`` s);
    a 401/403 (or any other refusal) is NodeNotAdmitted with the control plane's message."""
    url = settings.AENV_CONTROL_PLANE_URL + path
    deadline = time.monotonic() + wait
    delay = 1.0
    while True:
        try:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
            answer = (http or httpx).post(url, json=body, headers=headers, timeout=15)
            break
        except httpx.HTTPError as exc:
            if time.monotonic() + delay > deadline:
                raise NodeNotAdmitted(f"the control plane at {settings.AENV_CONTROL_PLANE_URL} cannot be reached: "
                                      f"{exc}") from exc
            log.warning("control plane %s not reachable (%s); retrying", settings.AENV_CONTROL_PLANE_URL, exc)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    try:
        data = answer.json()
    except ValueError:
        data = {}
    if answer.status_code != 200:
        message = data.get("message") if isinstance(data, dict) else None
        raise Refused(f"the control plane refused node {body.get('nodeId')} ({answer.status_code}): "
                              f"{message or answer.text[:200]}")
    return data


def ensure_joined(node_id: str, wait: float = CONNECT_WAIT, http: httpx.Client | None = None,
                  restart=restart_process) -> str | None:
    """Before registering (and before any use of the database): this node's credential,
    joining first if it has none; None when joining is neither required nor asked for (the
    single-machine default). Raises NodeNotAdmitted saying what to do. ``http``: the client to
    use (tests: on the app itself); ``restart``: called after a join that gave a database
    role (the default re-executes the process)."""
    token = settings.AENV_NODE_JOIN_TOKEN
    kubernetes = bool(settings.AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE)
    if not settings.AENV_NODE_JOIN_REQUIRED and not token and not kubernetes:
        return None
    if not settings.AENV_CONTROL_PLANE_URL:
        raise NodeNotAdmitted("joining needs AENV_CONTROL_PLANE_URL (the API's base URL, e.g. https://api.example:3000)")
    credential = stored_credential(node_id)
    if credential is not None:
        try:
            _post("/nodes/check-in", credential, {"nodeId": node_id}, wait, http)
        except Refused as exc:
            if not token and not kubernetes:  # e.g. revoked: only a new token issued for this node re-admits it
                raise
            log.warning("%s; joining again with %s", exc,
                        "AENV_NODE_JOIN_TOKEN" if token else "the Kubernetes token")
        else:
            log.info("node %s checked in with its credential (%s)", node_id, credential_path())
            return credential
    if token:
        answer = _post("/nodes/join", token, {"nodeId": node_id}, wait, http)
    elif kubernetes:
        answer = _post("/nodes/join", None, {"nodeId": node_id, "kubernetesToken": kubernetes_token()}, wait, http)
    else:
        raise NodeNotAdmitted(f"node {node_id} has not joined: set AENV_NODE_JOIN_TOKEN to a join token "
                              "(manage.py node_tokens create --node-id ID on the control plane)")
    if answer.get("nodeId") != node_id or not answer.get("credential"):
        raise NodeNotAdmitted(f"the control plane answered the join of {node_id} with {sorted(answer)}")
    store_credential(node_id, answer["credential"])
    log.info("node %s joined; its credential is in %s", node_id, credential_path())
    if answer.get("databaseUrl"):
        path = store_database_url(answer["databaseUrl"])
        log.info("node %s has a database role of its own (%s): restarting to use it", node_id, path)
        restart()
    return answer["credential"]
