"""Per-node sandbox slot pools read from one folder: one file per node, named after it,
holding its ``AENV_NET_POOL`` (Kubernetes: the ``aenv-node-pools`` ConfigMap, mounted).

Why one module: the node's entrypoint takes its own pool from this folder, and the route
syncer (``nodes.pool_routes``) routes every other node's pool; both must read and check the
folder the same way. Two nodes with overlapping pools would hand out the same guest
addresses, so a folder with an overlap is refused as a whole."""
from __future__ import annotations

import ipaddress
import pathlib
import sys


class PoolError(ValueError):
    """The pools folder is unusable: a file is not an IPv4 network, two pools overlap, or a
    node has no pool. The message names the node(s)."""


def read_pools(folder: str | pathlib.Path) -> dict[str, ipaddress.IPv4Network]:
    """Node name -> pool, from every regular, non-hidden file of `folder` (a mounted
    ConfigMap also holds ``..data`` links and hidden folders, which are skipped)."""
    pools: dict[str, ipaddress.IPv4Network] = {}
    for path in sorted(pathlib.Path(folder).iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        text = path.read_text().strip()
        try:
            pools[path.name] = ipaddress.IPv4Network(text)
        except ValueError as exc:
            raise PoolError(f"the pool of node {path.name} ({text!r}) is not an IPv4 network: {exc}") from exc
    names = sorted(pools)
    for i, name in enumerate(names):
        for other in names[i + 1:]:
            if pools[name].overlaps(pools[other]):
                raise PoolError(f"node {name}'s pool {pools[name]} overlaps node {other}'s {pools[other]}: "
                                "give each node its own")
    return pools


def pool_of(folder: str | pathlib.Path, node_id: str) -> ipaddress.IPv4Network:
    """This node's pool, after the whole folder was checked."""
    pools = read_pools(folder)
    if node_id not in pools:
        raise PoolError(f"no slot pool for node {node_id} in {folder}: "
                        f"add the key {node_id} to the aenv-node-pools ConfigMap")
    return pools[node_id]


def main(argv: list[str]) -> int:
    """``python -m nodes.pools FOLDER NODE_ID``: print the node's pool (the entrypoint's
    ``node-pool``), or the reason it has none on stderr and exit 1."""
    if len(argv) != 2:
        print("usage: python -m nodes.pools FOLDER NODE_ID", file=sys.stderr)
        return 2
    try:
        print(pool_of(argv[0], argv[1]))
    except (PoolError, OSError) as exc:
        print(f"entrypoint: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
