"""The control plane's client of Kubernetes' TokenReview API: asks the cluster's API server
what a service-account token proves (``nodes.join.kubernetes_identity`` decides what it
admits; this module only asks).

Why a plain HTTPS client: one POST is all aenv needs of Kubernetes, and the ``kubernetes``
client package is no dependency. In a pod the API server is
``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, trusted through the service
account's CA file, and the control plane authenticates with its own service-account token
(read at each review: the kubelet rotates it); ``AENV_KUBERNETES_API_URL``,
``AENV_KUBERNETES_CA_FILE`` and ``AENV_KUBERNETES_TOKEN_FILE`` override them. The control
plane's service account needs ``system:auth-delegator`` to create TokenReviews.

Every way the review itself can fail (no API server configured, unreachable, timeout, a TLS
failure, the API server refusing the control plane, an answer that is not a TokenReview) is
``Unavailable`` (503): the node's token was not judged, so the node may retry."""
from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
from django.conf import settings

from sandboxes.errors import Unavailable

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
# How a pod-bound service-account token names the node its pod runs on (Kubernetes 1.30 on:
# ServiceAccountTokenPodNodeInfo, on by default from 1.30, GA in 1.32).
NODE_NAME = "authentication.kubernetes.io/node-name"
POD_NAME = "authentication.kubernetes.io/pod-name"


def _unavailable(message: str) -> Unavailable:
    return Unavailable(f"cannot check the Kubernetes token: {message}", code="kubernetes_review_unavailable")


def api_url() -> str:
    """The API server's base URL: the setting, else the in-cluster Service's address."""
    if settings.AENV_KUBERNETES_API_URL:
        return settings.AENV_KUBERNETES_API_URL
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "").strip() or "443"
    if not host:
        raise _unavailable("no Kubernetes API server: not in a pod (KUBERNETES_SERVICE_HOST is unset) "
                           "and AENV_KUBERNETES_API_URL is empty")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise _unavailable(f"the control plane's {what} ({path}) cannot be read: {exc.strerror or exc}") from exc


def review(token: str, audience: str) -> dict:
    """The ``status`` of a TokenReview of ``token`` for ``audience`` (authenticated, user,
    audiences, error), as the API server answered it."""
    url = api_url() + REVIEW_PATH
    bearer = _read(settings.AENV_KUBERNETES_TOKEN_FILE, "service-account token")
    _read(settings.AENV_KUBERNETES_CA_FILE, "Kubernetes CA")
    try:
        tls = ssl.create_default_context(cafile=settings.AENV_KUBERNETES_CA_FILE)
    except (OSError, ssl.SSLError) as exc:
        raise _unavailable(f"the Kubernetes CA ({settings.AENV_KUBERNETES_CA_FILE}) is not a certificate: {exc}") \
            from exc
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]}}
    try:
        with httpx.Client(verify=tls, timeout=settings.AENV_KUBERNETES_TIMEOUT) as client:
            answer = client.post(url, json=body, headers={"Authorization": f"Bearer {bearer}"})
    except httpx.TimeoutException as exc:
        raise _unavailable(f"the API server at {url} did not answer within {settings.AENV_KUBERNETES_TIMEOUT} s") \
            from exc
    except httpx.HTTPError as exc:
        raise _unavailable(f"the API server at {url} cannot be reached: {exc}") from exc
    if answer.status_code == 401:
        raise _unavailable("the API server does not accept the control plane's own service-account token "
                           f"({settings.AENV_KUBERNETES_TOKEN_FILE})")
    if answer.status_code == 403:
        raise _unavailable("the API server refused the control plane's TokenReview (403): its service account "
                           "needs the ClusterRole system:auth-delegator")
    if answer.status_code not in (200, 201):
        raise _unavailable(f"the API server answered {answer.status_code}: {answer.text[:200]}")
    try:
        data = answer.json()
    except ValueError:
        data = None
    status = data.get("status") if isinstance(data, dict) and data.get("kind") == "TokenReview" else None
    if not isinstance(status, dict):
        raise _unavailable(f"the API server's answer is not a TokenReview: {answer.text[:200]}")
    return status
