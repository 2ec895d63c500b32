"""The key that seals team secrets in the shipped deployments: the control plane's processes
get it from outside their scratch AENV_HOME, the nodes never (docs/secrets.md, The key)."""
import yaml

from tests.unit import k8s_manifests as k8s
from tests.unit.test_deploy import COMPOSE


def _env_sources(doc: dict) -> set[str]:
    return {ref["secretRef"]["name"] for c in k8s.containers(doc) for ref in c.get("envFrom", [])
            if "secretRef" in ref}


def test_kubernetes_gives_the_key_to_the_api_pods_only():
    for name in k8s.OVERLAYS:
        docs = k8s.overlay(name)
        assert "AENV_SECRETS_KEY" in k8s.find(docs, "Secret", "aenv-secrets-key")["stringData"]
        holders = {d["metadata"]["name"] for d in docs if d["kind"] in k8s.WORKLOADS
                   and "aenv-secrets-key" in _env_sources(d)}
        assert holders == {"aenv-api"}, (name, holders)
        for doc in docs:  # nor through another Secret or a plain value
            if doc["kind"] == "Secret" and doc["metadata"]["name"] != "aenv-secrets-key":
                assert "AENV_SECRETS_KEY" not in (doc.get("stringData") or {}), doc["metadata"]["name"]
            for c in (k8s.containers(doc) if doc["kind"] in k8s.WORKLOADS else []):
                assert "AENV_SECRETS_KEY" not in {e["name"] for e in c.get("env", [])}


def test_compose_requires_it_for_the_control_plane_and_never_gives_it_to_a_node():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        env = service.get("environment") or {}
        has = "AENV_SECRETS_KEY" in env
        if name.startswith("node-"):
            assert not has, name
        elif name in ("api", "dataplane", "sweeper"):
            assert has and env["AENV_SECRETS_KEY"].startswith("${AENV_SECRETS_KEY:?"), name
