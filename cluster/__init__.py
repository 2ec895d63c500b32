"""aenv on many nodes on one machine, for tests and demos (``scripts/cluster.sh``).

Each node worker is a host of its own: a network namespace with its own address, slot pool,
nftables table and ``AENV_HOME``; the root namespace is their gateway and runs PostgreSQL,
Redis, the API, the data plane and the sweeper. ``layout`` says where everything lives,
``hostnet`` makes the namespaces, links, routes and rules, ``processes`` tracks the
processes, ``cluster`` brings it all up and down (the tests drive the same class), and
``__main__`` is the command line. Not deployed: ``deploy/`` is how real machines join.
"""
from cluster.cluster import Cluster, ClusterError
from cluster.layout import ClusterLayout, LayoutError, NodeLayout

__all__ = ["Cluster", "ClusterError", "ClusterLayout", "LayoutError", "NodeLayout"]
