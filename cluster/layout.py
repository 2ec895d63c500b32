"""Where everything of a one-machine cluster lives: names, addresses, ports, directories,
and the environment each process gets. Pure data: no I/O, so the script, the test and
the unit tests agree on one plan.

Node ``i`` (1-based) is a network namespace ``<name><i>`` joined to the root namespace by
a veth (``<name><i>`` in the root namespace, ``uplink`` inside); its link is the first /30
of the i-th /24 of ``link_net`` (default 10.210.i.0/30: the root side .1, the node .2) and
its slot pool the i-th /20 of ``pool_net`` (default 10.211.16(i-1).0/20).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPLINK = "uplink"  # the node's end of its link, inside its namespace
MAX_NODES = 16  # /20 pools in a /16


class LayoutError(ValueError):
    """The cluster cannot be laid out as asked (a clear message for the operator)."""


@dataclass(frozen=True)
class NodeLayout:
    cluster: "ClusterLayout"
    index: int

    @property
    def netns(self) -> str:
        return f"{self.cluster.name}{self.index}"

    @property
    def link(self) -> str:
        """The root namespace's end of the node's veth."""
        return self.netns

    @property
    def node_id(self) -> str:
        return f"{self.cluster.name}-{self.index}"

    @property
    def _link_base(self) -> ipaddress.IPv4Address:
        return ipaddress.ip_network(self.cluster.link_net).network_address + 256 * self.index

    @property
    def gateway_ip(self) -> str:
        """The root namespace's address on this node's link: where it reaches PostgreSQL and
        Redis, and the source of the data plane's and the dashboard's connections to it."""
        return str(self._link_base + 1)

    @property
    def address(self) -> str:
        """The node's own address (``AENV_NODE_ADDRESS``)."""
        return str(self._link_base + 2)

    @property
    def pool(self) -> str:
        base = ipaddress.ip_network(self.cluster.pool_net).network_address + 4096 * (self.index - 1)
        return f"{base}/20"

    @property
    def net_prefix(self) -> str:
        return f"{self.netns}s"

    @property
    def home(self) -> Path:
        return self.cluster.state_dir / f"node-{self.index}"

    def env(self, secret_key: str, deny_extra: tuple[str, ...] = (), join_token: str = "") -> dict[str, str]:
        """The node worker's settings: its own id, home, address and network instance; the
        shared database and broker through its gateway; the API there to join at with
        ``join_token`` (its first start; later it checks in with the credential it keeps in
        its home); only its gateway may open connections into its slots; guests reach none of
        ``deny_extra`` (the root namespace's addresses) nor any cluster address."""
        c = self.cluster
        return {
            **c.shared_env(secret_key, self.gateway_ip),
            "AENV_CONTROL_PLANE_URL": f"http://{self.gateway_ip}:{c.api_port}",
            "AENV_NODE_JOIN_TOKEN": join_token,
            "AENV_HOME": str(self.home),
            "AENV_NODE_ID": self.node_id,
            "AENV_NODE_ADDRESS": self.address,
            "AENV_NETWORK": "netns",
            "AENV_NET_PREFIX": self.net_prefix,
            "AENV_NET_POOL": self.pool,
            "AENV_NET_INGRESS_FROM": f"{self.gateway_ip}/32",
            "AENV_NET_DENY_EXTRA": ",".join(dict.fromkeys((*deny_extra, c.link_net, c.pool_net))),
        }


@dataclass(frozen=True)
class ClusterLayout:
    nodes: int = 3
    name: str = "aenvh"  # namespaces and links aenvh1..N, node ids aenvh-1..N
    link_net: str = "10.210.0.0/16"
    pool_net: str = "10.211.0.0/16"
    state_dir: Path = ROOT / "var" / "cluster"
    images_dir: Path = ROOT / "var" / "images"
    database: str = "cluster"
    pg_user: str = "postgres"
    pg_port: int = 5432
    redis_port: int = 6379
    redis_db: int = 4  # broker; +1 results, +2 the channel layer
    api_port: int = 3010
    dataplane_port: int = 3011
    extra_env: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not re.fullmatch(r"[a-z]{1,6}", self.name):
            raise LayoutError(f"cluster name {self.name!r}: 1 to 6 lowercase letters (it names namespaces and links)")
        if not 1 <= self.nodes <= MAX_NODES:
            raise LayoutError(f"{self.nodes} nodes: between 1 and {MAX_NODES}")
        link, pool = ipaddress.ip_network(self.link_net), ipaddress.ip_network(self.pool_net)
        if link.prefixlen > 19 or pool.prefixlen > 16:
            raise LayoutError(f"link_net must be a /19 or larger and pool_net a /16 or larger ({link}, {pool})")
        if link.overlaps(pool):
            raise LayoutError(f"link_net {link} overlaps pool_net {pool}")
        if not 0 <= self.redis_db <= 13:
            raise LayoutError(f"redis_db {self.redis_db}: 0..13 (three databases from it)")

    def node(self, index: int) -> NodeLayout:
        return NodeLayout(self, index)

    @property
    def all_nodes(self) -> list[NodeLayout]:
        return [self.node(i) for i in range(1, self.nodes + 1)]

    @property
    def table(self) -> str:
        """The root namespace's nftables table of this cluster."""
        return f"aenvcluster_{self.name}"

    @property
    def signing_dir(self) -> Path:
        """The control plane's task-signing key pair (manage.py task_signing_keys' files)."""
        return self.state_dir / "task-signing"

    @property
    def control_home(self) -> Path:
        """AENV_HOME of the API, the data plane and the sweeper (the API key file)."""
        return self.state_dir / "control"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def sandbox_url(self) -> str:
        return f"http://127.0.0.1:{self.dataplane_port}"

    def database_url(self, host: str = "127.0.0.1") -> str:
        return f"postgres://{self.pg_user}@{host}:{self.pg_port}/{self.database}"

    def shared_env(self, secret_key: str, host: str = "127.0.0.1") -> dict[str, str]:
        """What every process of the cluster shares, reaching the services at ``host``."""
        redis = f"redis://{host}:{self.redis_port}"
        return {
            **self.extra_env,
            "DATABASE_URL": self.database_url(host),
            "CELERY_BROKER_URL": f"{redis}/{self.redis_db}",
            "CELERY_RESULT_BACKEND": f"{redis}/{self.redis_db + 1}",
            "AENV_CHANNEL_LAYER_URL": f"{redis}/{self.redis_db + 2}",
            "DJANGO_SECRET_KEY": secret_key,
            # Signed node tasks (nodes.signing): every process has the certificate, so each
            # node runs only what the control plane signed; the key is control_env's alone.
            "AENV_TASK_SIGNING_CERT": str(self.signing_dir / "cert.pem"),
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "AENV_IMAGES_DIR": str(self.images_dir),
            "AENV_API_PUBLIC_URL": self.api_url,
            "AENV_SANDBOX_PUBLIC_URL": self.sandbox_url,
            "PYTHONUNBUFFERED": "1",
        }

    def control_env(self, secret_key: str) -> dict[str, str]:
        """The control plane's settings: its nodes all join (placement skips any that did not),
        each getting a database role of its own (nodes.db_roles)."""
        return {**self.shared_env(secret_key), "AENV_HOME": str(self.control_home), "AENV_NODE_JOIN_REQUIRED": "1",
                "AENV_NODE_DATABASE_ROLES": "1", "AENV_TASK_SIGNING_KEY": str(self.signing_dir / "key.pem")}
