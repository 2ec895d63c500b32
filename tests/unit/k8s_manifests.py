"""The Kubernetes manifests (deploy/k8s) rendered per overlay, and what they must get right
beyond the schemas, as functions that list the problems of a set of documents.

Why a renderer here: kustomize (or kubectl, which embeds it) is no package of the registries
the build machines reach, so the overlays use only what this renders itself: resources (files
and directories with a kustomization.yaml), strategic-merge patches by kind and name, and image
tags. A kustomization using anything else fails to render here instead of being half-applied.
Where a kubectl with kustomize is on PATH, test_deploy.py compares the two renderings.

Why checks that return problems: each test feeds them the real rendering (no problems) and a
doctored one (the problem it must find), so no check passes vacuously."""
from __future__ import annotations

import copy
import ipaddress
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
# A Kubernetes version kubernetes-validate ships schemas for (it bundles 1.25 on).
K8S_VERSION = "1.32.0"
OVERLAYS = ("external", "trial")
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
# Strategic merge: lists of objects merged by these keys (the ones the overlays could touch).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "envFrom": None}
CONTROL_PLANE = ("api", "dataplane", "sweeper", "events", "migrate")
DATA_SERVICES = {"redis": 6379, "postgres": 5432}
NETWORK_ANNOTATIONS = ("aenv.dev/host-network", "aenv.dev/pod-network", "aenv.dev/service-network")
REDIS_URL = re.compile(r"rediss?://[^\s\"']*")
# The Redis ACL users (deploy/redis/users.acl.template) by role, with the variable holding the
# password (base/secret.yaml: one Secret each), and the database of each URL (0: the broker,
# which the ACL's literal /0.celery.pidbox channel needs; a node has no channel layer).
REDIS_USERS = {"control": ("aenv-control", "REDIS_CONTROL_PASSWORD"), "node": ("aenv-node", "REDIS_NODE_PASSWORD")}
REDIS_DATABASES = {"CELERY_BROKER_URL": 0, "CELERY_RESULT_BACKEND": 1, "AENV_CHANNEL_LAYER_URL": 2}
ROLE_URL = re.compile(r"rediss?://([^:@/]+):\$\((\w+)\)@\$\(AENV_K8S_REDIS_ADDRESS\)/(\d+)")


# ---------------------------------------------------------------- rendering

def _merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise ValueError(f"strategic-merge directive {key} is not rendered here")
            out[key] = _merge_list(key, base[key], value) if key in base and isinstance(value, list) else (
                _merge(base[key], value) if key in base else copy.deepcopy(value))
        return out
    return copy.deepcopy(patch)


def _merge_list(field: str, base: list, patch: list) -> list:
    key = MERGE_KEYS.get(field)
    if key is None or not all(isinstance(i, dict) and key in i for i in base + patch):
        return copy.deepcopy(patch)  # a plain list: replaced, as strategic merge does
    out = [copy.deepcopy(i) for i in base]
    for item in patch:
        at = next((n for n, i in enumerate(out) if i[key] == item[key]), None)
        if at is None:
            out.append(copy.deepcopy(item))
        else:
            out[at] = _merge(out[at], item)
    return out


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def render(directory: Path) -> list[dict]:
    """The documents `kubectl kustomize directory` gives, for the features listed above."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields not rendered here: {sorted(unknown)}")
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only strategic-merge patches by path are rendered here: {patch}")
        for body in yaml.safe_load_all((directory / patch["path"]).read_text()):
            at = [n for n, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                  (body["kind"], body["metadata"]["name"])]
            if len(at) != 1:
                raise ValueError(f"{directory}/{patch['path']}: {len(at)} targets for {body['kind']}/{body['metadata']['name']}")
            docs[at[0]] = _merge(docs[at[0]], body)
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in containers(doc):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return docs


def overlay(name: str) -> list[dict]:
    return render(K8S / "overlays" / name)


def documents() -> list[tuple[str, dict]]:
    """Every document of every overlay as rendered: ("overlay:Kind/name", document)."""
    return [(f"{name}:{doc['kind']}/{doc['metadata']['name']}", doc) for name in OVERLAYS for doc in overlay(name)]


def find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def pod_labels(doc: dict) -> dict:
    return doc["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def component(docs: list[dict], name: str) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS and
            pod_labels(d).get("app.kubernetes.io/component") == name]


# ---------------------------------------------------------------- checks

def cluster_networks(docs: list[dict]) -> dict[str, ipaddress.IPv4Network]:
    annotations = find(docs, "ConfigMap", "aenv-node-pools")["metadata"].get("annotations", {})
    return {key: ipaddress.IPv4Network(annotations[key]) for key in NETWORK_ANNOTATIONS if key in annotations}


def pool_problems(docs: list[dict]) -> list[str]:
    """Every node's slot pool (aenv-node-pools) is an IPv4 network of its own: no two overlap,
    none overlaps the cluster's host, pod or service network, and the slots admit the pod
    network (AENV_NET_INGRESS_FROM), where the data plane and the API run."""
    pools_map = find(docs, "ConfigMap", "aenv-node-pools")
    if pools_map is None:
        return ["no ConfigMap aenv-node-pools"]
    problems = []
    networks = cluster_networks(docs)
    problems += [f"the cluster network {key} is not documented" for key in NETWORK_ANNOTATIONS if key not in networks]
    pools = {}
    for node, text in (pools_map.get("data") or {}).items():
        try:
            pools[node] = ipaddress.IPv4Network(text)
        except ValueError as exc:
            problems.append(f"node {node}: pool {text!r}: {exc}")
    if len(pools) < 2:
        problems.append(f"{len(pools)} node pools: an example needs several")
    names = sorted(pools)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if pools[a].overlaps(pools[b]):
                problems.append(f"the pools of {a} ({pools[a]}) and {b} ({pools[b]}) overlap")
        for key, network in networks.items():
            if pools[a].overlaps(network):
                problems.append(f"the pool of {a} ({pools[a]}) overlaps {key} {network}")
    config = find(docs, "ConfigMap", "aenv-config")["data"]
    pod_network = networks.get("aenv.dev/pod-network")
    if pod_network is not None and config.get("AENV_NET_INGRESS_FROM") != str(pod_network):
        problems.append(f"AENV_NET_INGRESS_FROM {config.get('AENV_NET_INGRESS_FROM')!r} is not the pod network {pod_network}")
    return problems


def network_problems(docs: list[dict]) -> list[str]:
    """The nodes use netns, each with the pool named after its node: nothing sets one pool or
    another network for all of them."""
    problems = []
    config = find(docs, "ConfigMap", "aenv-config")["data"]
    if config.get("AENV_NETWORK") != "netns":
        problems.append(f"AENV_NETWORK is {config.get('AENV_NETWORK')!r}, not netns")
    if "AENV_NET_POOL" in config:
        problems.append("aenv-config sets one AENV_NET_POOL for every node")
    node = find(docs, "DaemonSet", "aenv-node")
    container = containers(node)[0]
    env = {e["name"]: e for e in container.get("env", [])}
    for name in ("AENV_NET_POOL", "AENV_NETWORK"):
        if name in env:
            problems.append(f"the node DaemonSet sets {name}")
    if env.get("AENV_NODE_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        problems.append("AENV_NODE_ID is not the node's name (spec.nodeName): the pools are keyed by it")
    pools_dir = env.get("AENV_K8S_NODE_POOLS", {}).get("value")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in node["spec"]["template"]["spec"].get("volumes", [])}
    mounted = volumes.get(mounts.get(pools_dir, ""), {}).get("configMap", {}).get("name")
    if mounted != "aenv-node-pools":
        problems.append(f"AENV_K8S_NODE_POOLS ({pools_dir}) is not the aenv-node-pools ConfigMap mounted")
    return problems


def _quantity(text) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units[unit]


def container_problems(docs: list[dict]) -> list[str]:
    """Every container has CPU and memory requests and limits; every long-running one a
    readiness and a liveness probe (Jobs run to completion: none); every /dev/shm is a memory
    emptyDir with a size that fits in its container's memory limit."""
    problems = []
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"].get("volumes", [])}
        for c in containers(doc):
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                for what in ("cpu", "memory"):
                    if what not in resources.get(kind, {}):
                        problems.append(f"{where} {c['name']}: no {what} {kind[:-1]}")
            if doc["kind"] != "Job":
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in c:
                        problems.append(f"{where} {c['name']}: no {probe}")
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] != "/dev/shm":
                    continue
                shm = volumes.get(mount["name"], {}).get("emptyDir", {})
                limit = resources.get("limits", {}).get("memory")
                if shm.get("medium") != "Memory" or "sizeLimit" not in shm:
                    problems.append(f"{where} {c['name']}: /dev/shm is not a sized memory emptyDir")
                elif limit is not None and _quantity(shm["sizeLimit"]) >= _quantity(limit):
                    problems.append(f"{where} {c['name']}: /dev/shm {shm['sizeLimit']} leaves nothing of the "
                                    f"memory limit {limit} for QEMU")
    return problems


def _string_values(docs: list[dict]):
    """(where, text) of every string a process may be given: ConfigMap and Secret values,
    container env values, commands and args."""
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        for field in ("data", "stringData"):
            for key, value in (doc.get(field) or {}).items():
                yield f"{where} {key}", str(value)
        for c in containers(doc):
            for e in c.get("env", []):
                if "value" in e:
                    yield f"{where} {c['name']} {e['name']}", str(e["value"])
            for arg in c.get("command", []) + c.get("args", []):
                yield f"{where} {c['name']}", str(arg)


def _defined(docs: list[dict], container: dict) -> dict[str, str]:
    """What a container's $(VAR) references can resolve to: its envFrom sources, then its env."""
    defined = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        doc = find(docs, kind, ref["name"]) or {}
        defined.update({k: str(v) for k, v in (doc.get("data") or doc.get("stringData") or {}).items()})
    for e in container.get("env", []):
        defined[e["name"]] = str(e.get("value", "<from a reference>"))
    return defined


def _redis_url_problems(docs: list[dict]) -> list[str]:
    """Every Redis URL anywhere names a user (not default) and a password $(VAR)."""
    problems = []
    for where, text in _string_values(docs):
        for url in REDIS_URL.findall(text):
            userinfo, at, _ = url.split("://", 1)[1].partition("@")
            user, colon, password = userinfo.partition(":")
            if not at or not colon or not password:
                problems.append(f"{where}: Redis URL without a password: {url}")
            elif user in ("", "default"):
                problems.append(f"{where}: Redis URL without an ACL user: {url}")
            elif not re.fullmatch(r"\$\(\w+\)", password):
                problems.append(f"{where}: Redis URL with a literal password, not a $(VAR) from a Secret: {url}")
    return problems


def _role_problems(docs: list[dict], doc: dict, c: dict) -> list[str]:
    """An aenv container's Redis URLs are its role's user, password variable and database;
    a node's pod names neither the control password (nor a Secret holding it) nor the
    channel layer."""
    where = f"{doc['kind']}/{doc['metadata']['name']} {c['name']}"
    role = pod_labels(doc).get("app.kubernetes.io/component")
    if role == "routes":
        # The route syncer reads the database only: no broker, no Redis password at all.
        defined = _defined(docs, c)
        return [f"{where}: the route syncer names {name}" for name in
                (*REDIS_DATABASES, *(v for _, v in REDIS_USERS.values()), "REDIS_CONTROL_PASSWORD")
                if name in defined]
    if role != "node" and role not in CONTROL_PLANE:
        return [f"{where}: an aenv container of no known role ({role})"]
    user, variable = REDIS_USERS["node" if role == "node" else "control"]
    defined, problems = _defined(docs, c), []
    names = [n for n in REDIS_DATABASES if role != "node" or n != "AENV_CHANNEL_LAYER_URL"]
    for name in names:
        url = ROLE_URL.fullmatch(defined.get(name, ""))
        if url is None:
            problems.append(f"{where}: no Redis URL {name} of the form redis://USER:$(VAR)@$(AENV_K8S_REDIS_ADDRESS)/DB")
        elif (url[1], url[2], int(url[3])) != (user, variable, REDIS_DATABASES[name]):
            problems.append(f"{where}: {name} is {url[0]}, not {user} with $({variable}) on "
                            f"database {REDIS_DATABASES[name]}")
    if any(e["name"] == variable and "value" in e for e in c.get("env", [])):
        problems.append(f"{where}: {variable} written into the manifest, not from a Secret")
    if role == "node":
        control_secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"
                           and "REDIS_CONTROL_PASSWORD" in (d.get("data") or d.get("stringData") or {})]
        pod = yaml.safe_dump(doc["spec"]["template"])
        for forbidden in ("REDIS_CONTROL_PASSWORD", "AENV_CHANNEL_LAYER_URL", *control_secrets):
            if forbidden in defined or re.search(rf"\b{re.escape(forbidden)}\b", pod):
                problems.append(f"{where}: the node's pod names {forbidden}")
    return problems


def _redis_server_problems(redis: dict) -> list[str]:
    """A Redis the overlay runs loads the ACL users from a Secret (--aclfile, never one
    --requirepass password for every role) and its probes log in as an aenv user."""
    spec, problems = redis["spec"]["template"]["spec"], []
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        where = f"{redis['kind']}/{redis['metadata']['name']} {c['name']}"
        argv = c.get("command", []) + c.get("args", [])
        if any("requirepass" in str(a) for a in argv):
            problems.append(f"{where}: Redis with --requirepass (one password for every role), not --aclfile")
        path = argv[argv.index("--aclfile") + 1] if "--aclfile" in argv[:-1] else ""
        mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        if not path:
            problems.append(f"{where}: Redis without --aclfile (the users of deploy/redis/users.acl.template)")
        elif not mounts or "secret" not in volumes.get(mounts[0]["name"], {}):
            problems.append(f"{where}: --aclfile {path} is not a file of a mounted Secret")
        env = {e["name"]: e for e in c.get("env", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = " ".join(c.get(probe, {}).get("exec", {}).get("command", []))
            if "redis-cli" not in command:
                continue
            user = re.search(r"--user\s+(\S+)", command)
            auth = re.search(r"REDISCLI_AUTH=\W*\$\{?(\w+)", command)
            if not user or user[1] not in {u for u, _ in REDIS_USERS.values()}:
                problems.append(f"{where} {probe}: redis-cli does not log in as aenv-control or aenv-node")
            if not auth or "secretKeyRef" not in env.get(auth[1], {}).get("valueFrom", {}):
                problems.append(f"{where} {probe}: redis-cli's password (REDISCLI_AUTH) is not from a Secret")
    return problems


def redis_problems(docs: list[dict]) -> list[str]:
    """The Redis ACL users everywhere (deploy/redis/users.acl.template): every Redis URL names
    a user and a password $(VAR), each $(VAR) resolves to a non-empty value, control-plane pods
    connect as aenv-control on databases 0, 1, 2 and node pods as aenv-node on 0, 1 without
    any sight of the control password or the channel layer, and a Redis the overlay runs
    takes its users from a Secret (--aclfile) with probes logging in as one of them."""
    problems = _redis_url_problems(docs)
    for doc in docs:
        for c in containers(doc):
            where = f"{doc['kind']}/{doc['metadata']['name']} {c['name']}"
            defined = _defined(docs, c)
            for e in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(e.get("value", ""))):
                    if not defined.get(ref):
                        problems.append(f"{where} {e['name']}: $({ref}) is not defined before it")
            if c["image"].startswith("aenv-"):
                problems += _role_problems(docs, doc, c)
    for redis in component(docs, "redis"):
        problems += _redis_server_problems(redis)
    return problems


def policy_problems(docs: list[dict]) -> list[str]:
    """A NetworkPolicy selects Redis and PostgreSQL and admits, on their ports, only the
    control plane's pods and the nodes' host network (the documented aenv.dev/host-network):
    not the other pods of the namespace, not every address."""
    problems = []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    host_network = cluster_networks(docs).get("aenv.dev/host-network")
    plane = {name: pod_labels(d) for name in CONTROL_PLANE for d in component(docs, name)}
    for service, port in DATA_SERVICES.items():
        ran = component(docs, service)
        labels = [pod_labels(d) for d in ran] or [{"app.kubernetes.io/part-of": "aenv",
                                                    "app.kubernetes.io/component": service}]
        for pod in labels:
            chosen = [p for p in policies if selects(p["spec"]["podSelector"], pod)
                      and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
            if not chosen:
                problems.append(f"no NetworkPolicy selects {service} ({pod})")
            for policy in chosen:
                for rule in policy["spec"].get("ingress", []):
                    if port not in [p.get("port") for p in rule.get("ports", [])]:
                        continue
                    if not rule.get("from"):
                        problems.append(f"{policy['metadata']['name']}: {service} open to everyone")
                    for peer in rule.get("from", []):
                        if "ipBlock" in peer:
                            if host_network is None or ipaddress.IPv4Network(peer["ipBlock"]["cidr"]) != host_network:
                                problems.append(f"{policy['metadata']['name']}: ipBlock {peer['ipBlock']['cidr']} is not "
                                                f"the nodes' network {host_network}")
                        elif "podSelector" in peer:
                            others = {"app.kubernetes.io/part-of": "aenv", "app.kubernetes.io/component": "anything"}
                            if selects(peer["podSelector"], others):
                                problems.append(f"{policy['metadata']['name']}: {service} open to any aenv pod")
                            for name, pod_l in plane.items():
                                if name in ("api", "dataplane", "sweeper") and not selects(peer["podSelector"], pod_l):
                                    problems.append(f"{policy['metadata']['name']}: {name} cannot reach {service}")
                        else:
                            problems.append(f"{policy['metadata']['name']}: {service} open to {peer}")
                    if not any("ipBlock" in peer for peer in rule.get("from", [])):
                        problems.append(f"{policy['metadata']['name']}: the nodes (hostNetwork) cannot reach {service}")
    return problems


def disruption_problems(docs: list[dict]) -> list[str]:
    """Each control-plane Deployment with more than one replica has a PodDisruptionBudget that
    selects its pods and lets a drain evict one of them."""
    problems = []
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for name in ("api", "dataplane"):
        for deployment in component(docs, name):
            replicas = deployment["spec"].get("replicas", 1)
            chosen = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(deployment))]
            if replicas < 2 or not chosen:
                problems.append(f"{name}: {replicas} replica(s), {len(chosen)} PodDisruptionBudget(s)")
            for b in chosen:
                if b["spec"].get("minAvailable", 0) >= replicas:
                    problems.append(f"{b['metadata']['name']}: minAvailable {b['spec']['minAvailable']} blocks every drain")
    return problems


TRUE = ("1", "true", "yes", "on")
TOKEN_REVIEWER = "system:auth-delegator"
# The shortest life Kubernetes gives a projected token, and the longest one aenv wants a token
# that admits a node to live (a copied token admits its node for that long).
JOIN_TOKEN_SECONDS = (600, 3600)
SERVICE_URL = re.compile(r"https?://([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?:(\d+)/?")


def _bound_to(docs: list[dict], namespace: str, account: str, cluster_role: str) -> bool:
    return any(d["kind"] == "ClusterRoleBinding" and d["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role} and
        {"kind": "ServiceAccount", "name": account, "namespace": namespace} in d.get("subjects", []) for d in docs)


def join_problems(docs: list[dict]) -> list[str]:
    """Nodes join with their pods' Kubernetes tokens (nodes.join.kubernetes_identity): joining
    is required and Kubernetes joins are on; the DaemonSet runs as the service account the
    control plane expects, mounts no API token, only a projected token for the join audience
    (short-lived) at the file the node reads, and joins at a Service whose pods' service account
    may create TokenReviews (system:auth-delegator); the nodes' account is bound to nothing."""
    problems = []
    config = find(docs, "ConfigMap", "aenv-config")["data"]
    for key in ("AENV_NODE_JOIN_REQUIRED", "AENV_NODE_JOIN_KUBERNETES"):
        if str(config.get(key, "")).lower() not in TRUE:
            problems.append(f"aenv-config: {key} is not on")
    audience = config.get("AENV_NODE_JOIN_KUBERNETES_AUDIENCE", "aenv-join")
    namespace, _, account = config.get("AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT", "aenv:aenv-node").partition(":")
    node = find(docs, "DaemonSet", "aenv-node")
    pod = node["spec"]["template"]["spec"]
    if (node["metadata"].get("namespace"), pod.get("serviceAccountName")) != (namespace, account):
        problems.append(f"aenv-node runs as {node['metadata'].get('namespace')}:{pod.get('serviceAccountName')}, "
                        f"not the AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT {namespace}:{account}")
    sa = find(docs, "ServiceAccount", account)
    if sa is None or sa["metadata"].get("namespace") != namespace:
        problems.append(f"no ServiceAccount {namespace}:{account}")
    # The pod's own setting wins over its account's; neither: mounted.
    mounted = pod.get("automountServiceAccountToken", (sa or {}).get("automountServiceAccountToken", True))
    if mounted is not False:
        problems.append("aenv-node: its pods get an API token (automountServiceAccountToken is not false)")
    for binding in docs:
        if binding["kind"] in ("ClusterRoleBinding", "RoleBinding") and any(
                s.get("kind") == "ServiceAccount" and s.get("name") == account for s in binding.get("subjects", [])):
            problems.append(f"{binding['kind']} {binding['metadata']['name']} gives the nodes' account rights")
    container = next(c for c in pod["containers"] if c["name"] == "node")
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    token_file = env.get("AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE") or ""
    folder, _, file_name = token_file.rpartition("/")
    mount = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == folder), None)
    volume = next((v for v in pod.get("volumes", []) if mount and v["name"] == mount["name"]), None)
    sources = [s["serviceAccountToken"] for s in (volume or {}).get("projected", {}).get("sources", [])
               if "serviceAccountToken" in s and s["serviceAccountToken"].get("path") == file_name]
    if not sources:
        problems.append(f"aenv-node: AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE {token_file!r} is no projected "
                        "service-account token the pod mounts")
    for source in sources:
        if source.get("audience") != audience:
            problems.append(f"aenv-node: its join token is for the audience {source.get('audience')!r}, "
                            f"not AENV_NODE_JOIN_KUBERNETES_AUDIENCE {audience!r}")
        seconds = source.get("expirationSeconds", 3600)
        if not JOIN_TOKEN_SECONDS[0] <= seconds <= JOIN_TOKEN_SECONDS[1]:
            problems.append(f"aenv-node: its join token lives {seconds} s, not {JOIN_TOKEN_SECONDS[0]} to "
                            f"{JOIN_TOKEN_SECONDS[1]}")
    url = SERVICE_URL.fullmatch(env.get("AENV_CONTROL_PLANE_URL") or "")
    service = find(docs, "Service", url.group(1)) if url else None
    if service is None or service["metadata"].get("namespace") != url.group(2) or int(url.group(3)) not in [
            p["port"] for p in service["spec"]["ports"]]:
        problems.append(f"aenv-node: AENV_CONTROL_PLANE_URL {env.get('AENV_CONTROL_PLANE_URL')!r} is not a "
                        "Service of the control plane")
        return problems
    servers = [d for d in docs if d["kind"] == "Deployment" and selects(
        {"matchLabels": service["spec"]["selector"]}, pod_labels(d))]
    for server in servers:
        server_pod = server["spec"]["template"]["spec"]
        server_account = server_pod.get("serviceAccountName", "default")
        if server_account in ("default", account) or server_pod.get("automountServiceAccountToken") is False or \
                not _bound_to(docs, server["metadata"]["namespace"], server_account, TOKEN_REVIEWER):
            problems.append(f"{server['metadata']['name']} (where nodes join) cannot create TokenReviews: its "
                            f"service account {server_account} needs {TOKEN_REVIEWER} and its token mounted")
    if not servers:
        problems.append(f"the Service {service['metadata']['name']} the nodes join at selects no Deployment")
    return problems
