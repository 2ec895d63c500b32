"""``python -m cluster up [N] | down [--purge] | status [--json]`` (``scripts/cluster.sh``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from cluster.cluster import Cluster, ClusterError
from cluster.layout import ClusterLayout, LayoutError


def _layout(nodes: int | None) -> ClusterLayout:
    """The default layout with ``nodes`` (none given: as the cluster was brought up, else 3);
    ports from AENV_CLUSTER_API_PORT / AENV_CLUSTER_DATAPLANE_PORT."""
    env = os.environ.get
    default = ClusterLayout()
    saved = default.state_dir / "cluster.json"
    if nodes is None:
        nodes = json.loads(saved.read_text()).get("nodes", 3) if saved.exists() else 3
    return ClusterLayout(nodes=nodes, api_port=int(env("AENV_CLUSTER_API_PORT", "3010")),
                         dataplane_port=int(env("AENV_CLUSTER_DATAPLANE_PORT", "3011")))


def _print_status(status: dict) -> None:
    for name, pid in status["processes"].items():
        print(f"  {name:10} {'pid ' + str(pid) if pid else 'not running'}")
    for netns, present in status["namespaces"].items():
        print(f"  netns {netns:10} {'present' if present else 'absent'}")
    for node in status["nodes"] or []:
        m = node["metrics"]
        print(f"  node {node['id']:10} {node['status']:8} {node['address']:12} sandboxes {node['sandboxCount']:3} "
              f"reserved {m['allocatedCPU']} vCPU / {m['allocatedMemoryBytes'] // 2**20} MiB "
              f"of {node['capacity']['cpu']} vCPU / {node['capacity']['memoryBytes'] // 2**20} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start N node workers (default 3), each in its own namespace, and the control plane")
    up.add_argument("nodes", nargs="?", type=int, default=None)
    down = sub.add_parser("down", help="stop everything; node workers pause their sandboxes to disk first")
    down.add_argument("--purge", action="store_true", help="also drop the database, the Redis databases and var/cluster")
    st = sub.add_parser("status", help="processes, namespaces and GET /nodes")
    st.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        cluster = Cluster(_layout(getattr(args, "nodes", None)))
        if args.cmd == "up":
            status = cluster.up()
            print("aenv cluster is up")
            _print_status(status)
            env = cluster.sdk_env()
            print("\nexport " + " ".join(f"{k}={v}" for k, v in env.items()))
        elif args.cmd == "down":
            cluster.down(purge=args.purge)
            print("aenv cluster is down" + (" (purged)" if args.purge else ""))
        else:
            status = cluster.status()
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _print_status(status)
    except (ClusterError, LayoutError) as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
