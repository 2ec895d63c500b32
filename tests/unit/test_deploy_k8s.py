"""The Kubernetes manifests (deploy/k8s: a base and two kustomize overlays), rendered and
checked without a cluster (the other deploy files: test_deploy.py).

Why these checks: no cluster runs on the build machines, so each overlay is rendered here
(tests/unit/k8s_manifests.py; compared with kustomize where one is installed), every document
is held to the Kubernetes schemas (kubernetes-validate, strict), and what the schemas cannot
see is checked: every node has a slot pool of its own, clear of the cluster's networks, and
uses netns; every container has resources and probes; every Redis URL is its role's ACL user
(aenv-control, aenv-node; a node never sees the control password) and the trial Redis loads
the users from a Secret; a NetworkPolicy keeps Redis and PostgreSQL to the control plane and
the nodes; the API and the data plane have disruption budgets; the nodes join with projected
service-account tokens the API may review (system:auth-delegator). Each check is also fed a
doctored rendering it must fault.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess

import kubernetes_validate
import pytest
import yaml

from config.secret_key import PUBLIC_DEFAULT_KEY
from tests.unit import k8s_manifests as k8s
DEPLOY, K8S, K8S_VERSION = k8s.DEPLOY, k8s.K8S, k8s.K8S_VERSION


def k8s_documents() -> list[tuple[str, dict]]:
    return k8s.documents()


@pytest.mark.parametrize("name,doc", k8s_documents(), ids=[n for n, _ in k8s_documents()])
def test_kubernetes_manifest_validates_against_the_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validation_rejects_a_misspelt_field_and_a_wrong_type():
    """The check above has teeth: strict schemas refuse unknown fields and wrong types."""
    daemonset = next(doc for _, doc in k8s_documents() if doc["kind"] == "DaemonSet")
    misspelt = copy.deepcopy(daemonset)
    misspelt["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "360"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)


def test_kustomizations_use_every_manifest():
    """Every YAML file of the base and of each overlay is a resource or a patch of its
    kustomization, and the overlays are the two documented ones."""
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == sorted(k8s.OVERLAYS)
    assert sorted(p.name for p in K8S.iterdir()) == ["base", "overlays"]
    for directory in [K8S / "base", *(K8S / "overlays" / o for o in k8s.OVERLAYS)]:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used = [r for r in kustomization.get("resources", []) if r.endswith(".yaml")]
        used += [p["path"] for p in kustomization.get("patches", [])]
        on_disk = [p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"]
        assert sorted(used) == sorted(on_disk), directory


def test_renderer_refuses_what_it_cannot_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["../base"], "namePrefix": "x-"}))
    with pytest.raises(ValueError, match="namePrefix"):
        k8s.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(K8S / "base")], "patches": [{"path": "p.yaml", "target": {"kind": "Secret"}}]}))
    with pytest.raises(ValueError, match="strategic-merge"):
        k8s.render(tmp_path)


@pytest.mark.parametrize("name", k8s.OVERLAYS)
def test_renderer_agrees_with_kustomize(name):
    """Where a kubectl with kustomize is installed (not on the build machines' registries),
    it renders each overlay exactly as the test's renderer does."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (kustomize) on PATH")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0 and "unknown command" in done.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert done.returncode == 0, done.stderr
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(k8s.overlay(name), key=key) == sorted((d for d in yaml.safe_load_all(done.stdout) if d), key=key)


@pytest.mark.parametrize("name", k8s.OVERLAYS)
def test_overlay_passes_every_check(name):
    docs = k8s.overlay(name)
    for check in (k8s.pool_problems, k8s.network_problems, k8s.container_problems, k8s.redis_problems,
                  k8s.policy_problems, k8s.disruption_problems, k8s.join_problems):
        assert check(docs) == [], check.__name__


def _doctored(name: str, change) -> list[dict]:
    docs = k8s.overlay(name)
    change(docs)
    return docs


def _pools(docs) -> dict:
    return k8s.find(docs, "ConfigMap", "aenv-node-pools")


def _node(docs) -> dict:
    return k8s.containers(k8s.find(docs, "DaemonSet", "aenv-node"))[0]


def test_node_pool_check_finds_overlaps_and_clashes():
    def overlapping(docs):
        _pools(docs)["data"]["aenv-node-b"] = _pools(docs)["data"]["aenv-node-a"].replace("/20", "/21")
    assert any("overlap" in p for p in k8s.pool_problems(_doctored("external", overlapping)))
    def in_services(docs):
        _pools(docs)["data"]["aenv-node-c"] = "10.96.16.0/20"
    assert any("service-network" in p for p in k8s.pool_problems(_doctored("trial", in_services)))
    def in_hosts(docs):
        _pools(docs)["metadata"]["annotations"]["aenv.dev/host-network"] = "10.212.0.0/16"
    assert any("host-network" in p for p in k8s.pool_problems(_doctored("trial", in_hosts)))
    def ingress(docs):
        k8s.find(docs, "ConfigMap", "aenv-config")["data"]["AENV_NET_INGRESS_FROM"] = "0.0.0.0/0"
    assert any("AENV_NET_INGRESS_FROM" in p for p in k8s.pool_problems(_doctored("trial", ingress)))
    def one_pool(docs):
        _pools(docs)["data"] = {"aenv-node-a": "10.212.0.0/20"}
    assert k8s.pool_problems(_doctored("trial", one_pool))


def test_network_check_finds_slirp_and_a_shared_pool():
    def slirp(docs):
        k8s.find(docs, "ConfigMap", "aenv-config")["data"]["AENV_NETWORK"] = "slirp"
    assert k8s.network_problems(_doctored("external", slirp))
    def shared(docs):
        _node(docs)["env"].append({"name": "AENV_NET_POOL", "value": "10.212.0.0/16"})
    assert k8s.network_problems(_doctored("external", shared))
    def unmounted(docs):
        _node(docs)["volumeMounts"] = [m for m in _node(docs)["volumeMounts"] if m["name"] != "pools"]
    assert k8s.network_problems(_doctored("trial", unmounted))


def test_container_check_finds_missing_limits_probes_and_an_unsized_shm():
    def no_limit(docs):
        del k8s.containers(k8s.find(docs, "Deployment", "aenv-api"))[0]["resources"]["limits"]
    assert any("aenv-api" in p and "limit" in p for p in k8s.container_problems(_doctored("external", no_limit)))
    def no_probe(docs):
        del k8s.containers(k8s.find(docs, "Deployment", "aenv-sweeper"))[0]["livenessProbe"]
    assert any("livenessProbe" in p for p in k8s.container_problems(_doctored("external", no_probe)))
    def redis_unprobed(docs):
        del k8s.containers(k8s.find(docs, "Deployment", "redis"))[0]["readinessProbe"]
    assert any("redis" in p for p in k8s.container_problems(_doctored("trial", redis_unprobed)))
    def unsized(docs):
        volumes = k8s.find(docs, "DaemonSet", "aenv-node")["spec"]["template"]["spec"]["volumes"]
        next(v for v in volumes if v["name"] == "shm")["emptyDir"] = {"medium": "Memory"}
    assert any("/dev/shm" in p for p in k8s.container_problems(_doctored("external", unsized)))
    def too_big(docs):
        volumes = k8s.find(docs, "DaemonSet", "aenv-node")["spec"]["template"]["spec"]["volumes"]
        next(v for v in volumes if v["name"] == "shm")["emptyDir"]["sizeLimit"] = "64Gi"
    assert any("/dev/shm" in p for p in k8s.container_problems(_doctored("external", too_big)))


def _env(docs, kind: str, name: str) -> list[dict]:
    return k8s.containers(k8s.find(docs, kind, name))[0]["env"]


def _set_url(docs, kind: str, name: str, variable: str, url: str) -> None:
    next(e for e in _env(docs, kind, name) if e["name"] == variable)["value"] = url


def test_redis_check_finds_urls_without_a_user_or_a_password():
    address = "@$(AENV_K8S_REDIS_ADDRESS)/0"
    def bare(docs):
        _set_url(docs, "Deployment", "aenv-dataplane", "CELERY_BROKER_URL", "redis://$(AENV_K8S_REDIS_ADDRESS)/0")
    assert any("without a password" in p for p in k8s.redis_problems(_doctored("external", bare)))
    def no_user(docs):
        _set_url(docs, "Deployment", "aenv-api", "CELERY_BROKER_URL", "redis://:$(REDIS_CONTROL_PASSWORD)" + address)
    assert any("without an ACL user" in p for p in k8s.redis_problems(_doctored("trial", no_user)))
    def default_user(docs):
        _set_url(docs, "DaemonSet", "aenv-node", "CELERY_BROKER_URL", "redis://default:$(REDIS_NODE_PASSWORD)" + address)
    assert any("without an ACL user" in p for p in k8s.redis_problems(_doctored("external", default_user)))
    def literal(docs):
        _set_url(docs, "Deployment", "aenv-sweeper", "CELERY_BROKER_URL", "redis://aenv-control:hunter2" + address)
    assert any("literal password" in p for p in k8s.redis_problems(_doctored("trial", literal)))
    def empty_password(docs):
        k8s.find(docs, "Secret", "aenv-redis-node")["stringData"]["REDIS_NODE_PASSWORD"] = ""
    assert any("REDIS_NODE_PASSWORD" in p for p in k8s.redis_problems(_doctored("trial", empty_password)))
    def in_config(docs):
        k8s.find(docs, "ConfigMap", "aenv-config")["data"]["CELERY_BROKER_URL"] = "redis://redis:6379/0"
    assert k8s.redis_problems(_doctored("external", in_config))


def test_redis_check_holds_each_role_to_its_user():
    """Control-plane pods as aenv-control on 0, 1, 2; node pods as aenv-node on 0, 1, never
    naming the control password (directly, through a Secret, or shared in aenv-secrets) nor
    the channel layer."""
    def as_node(docs):
        _set_url(docs, "Job", "aenv-migrate", "CELERY_RESULT_BACKEND",
                 "redis://aenv-node:$(REDIS_NODE_PASSWORD)@$(AENV_K8S_REDIS_ADDRESS)/1")
    assert any("aenv-migrate" in p and "not aenv-control" in p
               for p in k8s.redis_problems(_doctored("external", as_node)))
    def other_database(docs):
        _set_url(docs, "Deployment", "aenv-api", "CELERY_BROKER_URL",
                 "redis://aenv-control:$(REDIS_CONTROL_PASSWORD)@$(AENV_K8S_REDIS_ADDRESS)/3")
    assert any("database 0" in p for p in k8s.redis_problems(_doctored("trial", other_database)))
    def node_as_control(docs):
        _set_url(docs, "DaemonSet", "aenv-node", "CELERY_BROKER_URL",
                 "redis://aenv-control:$(REDIS_NODE_PASSWORD)@$(AENV_K8S_REDIS_ADDRESS)/0")
    assert any("not aenv-node" in p for p in k8s.redis_problems(_doctored("external", node_as_control)))
    def node_channel_layer(docs):
        _env(docs, "DaemonSet", "aenv-node").append(
            {"name": "AENV_CHANNEL_LAYER_URL", "value": "redis://aenv-node:$(REDIS_NODE_PASSWORD)@$(AENV_K8S_REDIS_ADDRESS)/2"})
    assert any("AENV_CHANNEL_LAYER_URL" in p for p in k8s.redis_problems(_doctored("trial", node_channel_layer)))
    def node_control_secret(docs):
        _node(docs)["envFrom"].append({"secretRef": {"name": "aenv-redis-control"}})
    assert any("REDIS_CONTROL_PASSWORD" in p for p in k8s.redis_problems(_doctored("external", node_control_secret)))
    def node_key_ref(docs):
        _env(docs, "DaemonSet", "aenv-node").append({"name": "SPARE", "valueFrom": {
            "secretKeyRef": {"name": "aenv-redis-control", "key": "REDIS_CONTROL_PASSWORD"}}})
    assert any("aenv-node" in p and "CONTROL" in p for p in k8s.redis_problems(_doctored("trial", node_key_ref)))
    def shared(docs):
        k8s.find(docs, "Secret", "aenv-secrets")["stringData"]["REDIS_CONTROL_PASSWORD"] = "x" * 64
    assert any("node's pod names REDIS_CONTROL_PASSWORD" in p for p in k8s.redis_problems(_doctored("trial", shared)))
    def written_in(docs):
        _env(docs, "Deployment", "aenv-api").insert(0, {"name": "REDIS_CONTROL_PASSWORD", "value": "x" * 64})
    assert any("not from a Secret" in p for p in k8s.redis_problems(_doctored("external", written_in)))


def test_redis_check_wants_the_trial_redis_on_an_acl_file_from_a_secret():
    def redis(docs):
        return k8s.containers(k8s.find(docs, "Deployment", "redis"))[0]
    def requirepass(docs):
        redis(docs)["args"] = ["redis-server", "--requirepass", "$(REDIS_NODE_PASSWORD)", "--save", ""]
    problems = k8s.redis_problems(_doctored("trial", requirepass))
    assert any("--requirepass" in p for p in problems) and any("without --aclfile" in p for p in problems)
    def both(docs):
        redis(docs)["args"] += ["--requirepass", "$(REDIS_NODE_PASSWORD)"]
    assert any("--requirepass" in p for p in k8s.redis_problems(_doctored("trial", both)))
    def open_broker(docs):
        redis(docs)["args"] = ["redis-server", "--save", ""]
    assert any("without --aclfile" in p for p in k8s.redis_problems(_doctored("trial", open_broker)))
    def not_a_secret(docs):
        volumes = k8s.find(docs, "Deployment", "redis")["spec"]["template"]["spec"]["volumes"]
        acl = next(v for v in volumes if v["name"] == "acl")
        del acl["secret"]
        acl["emptyDir"] = {}
    assert any("not a file of a mounted Secret" in p for p in k8s.redis_problems(_doctored("trial", not_a_secret)))
    def default_probe(docs):
        command = redis(docs)["readinessProbe"]["exec"]["command"]
        command[-1] = command[-1].replace(" --user aenv-node", "")
    assert any("readinessProbe" in p for p in k8s.redis_problems(_doctored("trial", default_probe)))
    def literal_probe(docs):
        command = redis(docs)["livenessProbe"]["exec"]["command"]
        command[-1] = 'REDISCLI_AUTH=hunter2 redis-cli --user aenv-node ping | grep -q PONG'
    assert any("livenessProbe" in p for p in k8s.redis_problems(_doctored("trial", literal_probe)))


def test_trial_redis_acl_secret_is_the_documented_rendering():
    """The one command that makes the trial Redis's ACL Secret (redis.yaml's comment and
    docs/deployment.md) names the Secret and key the Redis pod mounts and loads; render-acl.sh
    renders a file for it, and refuses base/secret.yaml's placeholders."""
    text = (K8S / "overlays" / "trial" / "redis.yaml").read_text()
    command = re.compile(r"deploy/redis/render-acl\.sh \\?\s*(?:#\s*)?\| kubectl -n aenv create secret generic "
                         r"(\S+) --from-file=([\w.]+)=/dev/stdin")
    found = command.search(text)
    assert found, "redis.yaml does not show the command that makes the ACL Secret"
    docs_command = command.search((DEPLOY.parent / "docs" / "deployment.md").read_text())
    assert docs_command and docs_command.groups() == found.groups()
    docs = k8s.overlay("trial")
    spec = k8s.find(docs, "Deployment", "redis")["spec"]["template"]["spec"]
    argv = spec["containers"][0]["args"]
    aclfile = argv[argv.index("--aclfile") + 1]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if aclfile.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert (volume["secret"]["secretName"], aclfile.rsplit("/", 1)[1]) == found.groups()
    render = DEPLOY / "redis" / "render-acl.sh"
    env = {"PATH": os.environ["PATH"], "REDIS_CONTROL_PASSWORD": "c" * 64, "REDIS_NODE_PASSWORD": "n" * 64}
    done = subprocess.run(["sh", str(render)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and "user aenv-node on" in done.stdout, done.stderr
    env.update(k8s.find(docs, "Secret", "aenv-redis-control")["stringData"])
    env.update(k8s.find(docs, "Secret", "aenv-redis-node")["stringData"])
    placeholders = subprocess.run(["sh", str(render)], capture_output=True, text=True, timeout=60, env=env)
    assert placeholders.returncode != 0 and not placeholders.stdout


def test_policy_check_finds_a_missing_or_open_policy():
    def dropped(docs):
        docs[:] = [d for d in docs if d["kind"] != "NetworkPolicy"]
    for name in k8s.OVERLAYS:
        problems = k8s.policy_problems(_doctored(name, dropped))
        assert any("redis" in p for p in problems) and any("postgres" in p for p in problems)
    def everyone(docs):
        rule = k8s.find(docs, "NetworkPolicy", "aenv-data-services")["spec"]["ingress"][0]
        rule["from"][1]["ipBlock"]["cidr"] = "0.0.0.0/0"
    assert any("ipBlock" in p for p in k8s.policy_problems(_doctored("trial", everyone)))
    def any_pod(docs):
        rule = k8s.find(docs, "NetworkPolicy", "aenv-data-services")["spec"]["ingress"][0]
        del rule["from"][0]["podSelector"]["matchExpressions"]
    assert any("any aenv pod" in p for p in k8s.policy_problems(_doctored("trial", any_pod)))
    def no_nodes(docs):
        rule = k8s.find(docs, "NetworkPolicy", "aenv-data-services")["spec"]["ingress"][0]
        rule["from"] = rule["from"][:1]
    assert any("nodes" in p for p in k8s.policy_problems(_doctored("trial", no_nodes)))


def test_disruption_check_finds_a_missing_or_blocking_budget():
    def dropped(docs):
        docs[:] = [d for d in docs if (d["kind"], d["metadata"]["name"]) != ("PodDisruptionBudget", "aenv-api")]
    assert any("api" in p for p in k8s.disruption_problems(_doctored("external", dropped)))
    def blocking(docs):
        k8s.find(docs, "PodDisruptionBudget", "aenv-dataplane")["spec"]["minAvailable"] = 2
    assert any("blocks" in p for p in k8s.disruption_problems(_doctored("external", blocking)))


def test_trial_data_services_share_their_passwords_with_aenv():
    """The in-cluster PostgreSQL's and MinIO's credentials are the ones aenv's URLs and keys
    carry, and the external overlay runs no data service at all."""
    docs = k8s.overlay("trial")
    secrets = k8s.find(docs, "Secret", "aenv-secrets")["stringData"]
    data = k8s.find(docs, "Secret", "aenv-trial-data")["stringData"]
    database = re.fullmatch(r"postgres://aenv:([^@]+)@postgres\.aenv\.svc\.cluster\.local:5432/aenv",
                            secrets["DATABASE_URL"])
    assert database and database.group(1) == data["POSTGRES_PASSWORD"]
    assert (secrets["AWS_ACCESS_KEY_ID"], secrets["AWS_SECRET_ACCESS_KEY"]) == (data["MINIO_ROOT_USER"],
                                                                                data["MINIO_ROOT_PASSWORD"])
    config = k8s.find(docs, "ConfigMap", "aenv-config")["data"]
    bucket_job = " ".join(k8s.containers(k8s.find(docs, "Job", "aenv-s3-bucket"))[0]["args"])
    assert f"store/{config['AENV_S3_BUCKET']}" in bucket_job
    external = k8s.overlay("external")
    assert not [d for d in external if d["kind"] in k8s.WORKLOADS and k8s.pod_labels(d).get(
        "app.kubernetes.io/component") in ("redis", "postgres", "s3")]
    assert "postgres.aenv.svc" not in k8s.find(external, "Secret", "aenv-secrets")["stringData"]["DATABASE_URL"]


def test_entrypoint_gives_each_node_its_own_pool(tmp_path):
    """entrypoint.sh node-pool, the node's start in Kubernetes: the pool named after the node,
    from the ConfigMap's files (its ..data links skipped); a node with no pool or one
    overlapping another's does not start."""
    pools = tmp_path / "node-pools"
    (pools / "..2026_12_03").mkdir(parents=True)
    (pools / "..data").symlink_to("..2026_12_03")
    for node, pool in _pools(k8s.overlay("trial"))["data"].items():
        (pools / node).write_text(pool)

    def node_pool(node_id):
        return subprocess.run(["bash", str(DEPLOY / "docker" / "entrypoint.sh"), "node-pool", str(pools)],
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "AENV_NODE_ID": node_id})
    done = node_pool("aenv-node-b")
    assert done.returncode == 0 and done.stdout.strip() == "10.212.16.0/20", done.stderr
    missing = node_pool("aenv-node-z")
    assert missing.returncode != 0 and "add the key aenv-node-z" in missing.stderr
    (pools / "aenv-node-d").write_text("10.212.20.0/22")
    clash = node_pool("aenv-node-b")
    assert clash.returncode != 0 and "overlaps node aenv-node-d" in clash.stderr
    (pools / "aenv-node-d").write_text("not-a-network")
    assert "not an IPv4 network" in node_pool("aenv-node-a").stderr


def test_kubernetes_shape():
    """What the manifests must get right beyond the checks above: the node DaemonSet is
    privileged, on the host's network, with its node id and address from the node it runs
    on, AENV_HOME on the host; its liveness probe never asks the database (a restart would
    end every VM on the node); one sweeper; every workload and Service selects its own pods;
    the placeholder signing key is the one aenv refuses to start with."""
    for overlay in k8s.OVERLAYS:
        docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in k8s.overlay(overlay)}
        node = docs["DaemonSet/aenv-node"]["spec"]["template"]["spec"]
        container = node["containers"][0]
        assert node["hostNetwork"] is True and node["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert container["securityContext"]["privileged"] is True
        assert container["livenessProbe"]["exec"]["command"][-2:] == ["health", "worker"]
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
        assert env == {"AENV_NODE_ID": "spec.nodeName", "AENV_NODE_ADDRESS": "status.hostIP"}
        volumes = {v["name"]: v for v in node["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        config = docs["ConfigMap/aenv-config"]["data"]
        assert volumes[mounts[config["AENV_HOME"]]]["hostPath"]["path"] == config["AENV_HOME"]
        assert node["terminationGracePeriodSeconds"] >= 330  # AENV_NODE_TASK_DEADLINE's default
        assert docs["Deployment/aenv-sweeper"]["spec"]["replicas"] == 1
        workloads = [d for d in docs.values() if d["kind"] in k8s.WORKLOADS and d["kind"] != "Job"]
        for key, doc in docs.items():
            if doc in workloads:
                assert k8s.selects(doc["spec"]["selector"], k8s.pod_labels(doc)), key
            if doc["kind"] == "Service":
                targets = [w for w in workloads if k8s.selects({"matchLabels": doc["spec"]["selector"]}, k8s.pod_labels(w))]
                assert [t["metadata"]["name"] for t in targets] == [doc["metadata"]["name"]], key
        assert docs["Secret/aenv-secrets"]["stringData"]["DJANGO_SECRET_KEY"] == PUBLIC_DEFAULT_KEY
        rules = docs["Ingress/aenv"]["spec"]["rules"]
        assert f"*.{config['AENV_SANDBOX_DOMAIN']}" in {r["host"] for r in rules}


def test_node_liveness_asks_only_the_worker(tmp_path):
    """entrypoint.sh health worker (the node's liveness probe) passes while something serves
    the metrics port on loopback, fails when nothing does, and passes with metrics off."""
    def health(port):
        env = {"PATH": os.environ["PATH"], "AENV_NODE_METRICS_PORT": str(port), "AENV_NODE_ADDRESS": "127.0.0.1"}
        return subprocess.run(["bash", str(DEPLOY / "docker" / "entrypoint.sh"), "health", "worker"],
                              capture_output=True, text=True, timeout=60, env=env)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert health(port).returncode == 0
    down = health(port)
    assert down.returncode != 0 and f"metrics port {port}" in down.stderr
    assert health(0).returncode == 0


def test_every_host_routes_the_pools_with_net_admin_only():
    """aenv-routes (nodes.pool_routes): on every host (no node selector), on the host's
    network, reading the same aenv-node-pools ConfigMap the nodes take their pools from, with
    CAP_NET_ADMIN alone (not privileged), probed by its last pass."""
    for overlay in k8s.OVERLAYS:
        docs = k8s.overlay(overlay)
        routes = k8s.find(docs, "DaemonSet", "aenv-routes")
        pod = routes["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["args"] == ["routes"]
        assert pod["hostNetwork"] is True and "nodeSelector" not in pod and "affinity" not in pod
        security = container["securityContext"]
        assert not security.get("privileged") and security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts[env["AENV_K8S_NODE_POOLS"]]]["configMap"]["name"] == "aenv-node-pools"
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"][-2:] == ["health", "routes"]


def test_the_task_signing_key_reaches_the_control_plane_only():
    """Signed node tasks (nodes.signing): the API, data plane, sweeper and events worker get the
    key and the certificate from the Secret aenv-task-signing at the paths their settings name; the node
    DaemonSet mounts only cert.pem and names no key, so a node (or whoever takes one over)
    cannot sign a task."""
    for overlay in k8s.OVERLAYS:
        docs = k8s.overlay(overlay)
        for kind, name, files in (("Deployment", "aenv-api", {"key.pem", "cert.pem"}),
                                  ("Deployment", "aenv-dataplane", {"key.pem", "cert.pem"}),
                                  ("Deployment", "aenv-sweeper", {"key.pem", "cert.pem"}),
                                  ("Deployment", "aenv-events", {"key.pem", "cert.pem"}),
                                  ("DaemonSet", "aenv-node", {"cert.pem"})):
            doc = k8s.find(docs, kind, name)
            pod = doc["spec"]["template"]["spec"]
            container = k8s.containers(doc)[0]
            volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "aenv-task-signing")
            mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
            items = volume["secret"].get("items")
            mounted = {i["path"] for i in items} if items else {"key.pem", "cert.pem"}
            assert mounted == files and mount.get("readOnly") is True, (overlay, name)
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["AENV_TASK_SIGNING_CERT"] == f"{mount['mountPath']}/cert.pem", (overlay, name)
            if "key.pem" in files:
                assert env["AENV_TASK_SIGNING_KEY"] == f"{mount['mountPath']}/key.pem", (overlay, name)
            else:
                assert "AENV_TASK_SIGNING_KEY" not in env, (overlay, name)


def _node_pod(docs) -> dict:
    return k8s.find(docs, "DaemonSet", "aenv-node")["spec"]["template"]["spec"]


def _join_volume(docs) -> dict:
    return next(v for v in _node_pod(docs)["volumes"] if v["name"] == "join-token")


def test_nodes_join_with_a_projected_token_the_api_may_review():
    """Kubernetes joins (nodes.join.kubernetes_identity) as shipped: joining required and
    Kubernetes joins on in both overlays; the DaemonSet runs as aenv-node (the account the
    control plane expects), mounts no API token, only a 10-minute token for aenv-join at the
    file the node reads, and joins at aenv-api, whose account aenv-control-plane is bound to
    system:auth-delegator (TokenReview) and nothing binds the nodes' account."""
    for overlay in k8s.OVERLAYS:
        docs = k8s.overlay(overlay)
        config = k8s.find(docs, "ConfigMap", "aenv-config")["data"]
        assert (config["AENV_NODE_JOIN_REQUIRED"], config["AENV_NODE_JOIN_KUBERNETES"]) == ("1", "1")
        assert config["AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT"] == "aenv:aenv-node"
        pod = _node_pod(docs)
        assert pod["serviceAccountName"] == "aenv-node" and pod["automountServiceAccountToken"] is False
        source = _join_volume(docs)["projected"]["sources"][0]["serviceAccountToken"]
        assert source == {"audience": config["AENV_NODE_JOIN_KUBERNETES_AUDIENCE"], "expirationSeconds": 600,
                          "path": "token"}
        env = {e["name"]: e.get("value") for e in _node(docs)["env"]}
        assert env["AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE"] == "/var/run/secrets/aenv/join/token"
        assert env["AENV_CONTROL_PLANE_URL"] == "http://aenv-api.aenv.svc.cluster.local:3000"
        api = k8s.find(docs, "Deployment", "aenv-api")["spec"]["template"]["spec"]
        assert api["serviceAccountName"] == "aenv-control-plane"
        binding = k8s.find(docs, "ClusterRoleBinding", "aenv-control-plane-token-review")
        assert binding["roleRef"]["name"] == "system:auth-delegator"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "aenv-control-plane", "namespace": "aenv"}]
        assert "AENV_CONTROL_PLANE_URL" not in config  # the control plane must not read itself as a node


def test_join_check_finds_what_would_break_kubernetes_joins():
    def off(docs):
        k8s.find(docs, "ConfigMap", "aenv-config")["data"]["AENV_NODE_JOIN_REQUIRED"] = "0"
    assert any("AENV_NODE_JOIN_REQUIRED" in p for p in k8s.join_problems(_doctored("external", off)))
    def kubernetes_off(docs):
        del k8s.find(docs, "ConfigMap", "aenv-config")["data"]["AENV_NODE_JOIN_KUBERNETES"]
    assert any("AENV_NODE_JOIN_KUBERNETES is not on" in p for p in k8s.join_problems(_doctored("trial", kubernetes_off)))
    def other_account(docs):
        _node_pod(docs)["serviceAccountName"] = "default"
    assert any("not the AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT" in p
               for p in k8s.join_problems(_doctored("external", other_account)))
    def api_token(docs):
        del _node_pod(docs)["automountServiceAccountToken"]
        k8s.find(docs, "ServiceAccount", "aenv-node")["automountServiceAccountToken"] = True
    assert any("API token" in p for p in k8s.join_problems(_doctored("trial", api_token)))
    def wrong_audience(docs):
        _join_volume(docs)["projected"]["sources"][0]["serviceAccountToken"]["audience"] = "https://kubernetes.default.svc"
    assert any("audience" in p for p in k8s.join_problems(_doctored("external", wrong_audience)))
    def long_lived(docs):
        _join_volume(docs)["projected"]["sources"][0]["serviceAccountToken"]["expirationSeconds"] = 86400
    assert any("lives 86400 s" in p for p in k8s.join_problems(_doctored("trial", long_lived)))
    def unmounted(docs):
        _node(docs)["volumeMounts"] = [m for m in _node(docs)["volumeMounts"] if m["name"] != "join-token"]
    assert any("no projected" in p for p in k8s.join_problems(_doctored("external", unmounted)))
    def elsewhere(docs):
        _set_url(docs, "DaemonSet", "aenv-node", "AENV_CONTROL_PLANE_URL", "http://aenv-dataplane.aenv.svc:3000")
    assert any("AENV_CONTROL_PLANE_URL" in p for p in k8s.join_problems(_doctored("trial", elsewhere)))
    def api_cannot_review(docs):
        k8s.find(docs, "Deployment", "aenv-api")["spec"]["template"]["spec"]["serviceAccountName"] = "default"
    assert any("cannot create TokenReviews" in p for p in k8s.join_problems(_doctored("external", api_cannot_review)))
    def unbound(docs):
        k8s.find(docs, "ClusterRoleBinding", "aenv-control-plane-token-review")["roleRef"]["name"] = "view"
    assert any("cannot create TokenReviews" in p for p in k8s.join_problems(_doctored("trial", unbound)))
    def node_rights(docs):
        binding = k8s.find(docs, "ClusterRoleBinding", "aenv-control-plane-token-review")
        binding["subjects"].append({"kind": "ServiceAccount", "name": "aenv-node", "namespace": "aenv"})
    assert any("gives the nodes' account rights" in p for p in k8s.join_problems(_doctored("external", node_rights)))
