"""Keep this machine's routes to every node's slot pool (nodes.pool_routes).

Runs where the API, data plane or dashboard terminal run (Kubernetes: the ``aenv-routes``
DaemonSet, host network, NET_ADMIN only). Every ``--interval`` seconds: the pools folder and
the nodes' addresses from the database, then the route changes they call for. A failed pass
(database away, folder being rewritten) is logged and retried; it never removes routes.
--heartbeat FILE: its mtime is set after every pass that reached the database (the probe)."""
import logging
import threading
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, close_old_connections
from pyroute2 import IPRoute

from nodes import pool_routes, pools
from nodes.models import Node

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Route every node's slot pool (a folder of one file per node) to the node's address."

    def add_arguments(self, parser):
        parser.add_argument("--pools", required=True, type=Path,
                            help="folder with one file per node name holding its pool (the aenv-node-pools ConfigMap)")
        parser.add_argument("--interval", type=float, default=30.0, help="seconds between passes")
        parser.add_argument("--once", action="store_true", help="one pass, then exit (1 if it failed)")
        parser.add_argument("--heartbeat", type=Path, default=None)

    def handle(self, *args, pools: Path, interval: float, once: bool, heartbeat: Path | None, **options):
        if interval <= 0:
            raise CommandError("--interval must be positive")
        stop = threading.Event()
        while True:
            close_old_connections()   # a long-lived process: never a connection the database dropped
            ok = self.one_pass(pools, heartbeat)
            if once:
                if not ok:
                    raise CommandError("the pass failed (see the log)")
                return
            if stop.wait(interval):
                return

    def one_pass(self, folder: Path, heartbeat: Path | None) -> bool:
        """Read, compute, apply; True when it reached the database and the folder."""
        try:
            wanted_pools = pools.read_pools(folder)
        except (pools.PoolError, OSError) as exc:
            log.error("pools folder %s: %s; routes left as they are", folder, exc)
            return False
        try:
            addresses = dict(Node.objects.values_list("id", "address"))
        except DatabaseError as exc:
            log.error("cannot read the nodes' addresses: %s; routes left as they are", exc)
            return False
        with IPRoute() as ipr:
            changes = pool_routes.sync(ipr, wanted_pools, addresses)
        for change in changes:
            self.stdout.write(f"{change.action} {change.pool} via {change.gateway}")
        if heartbeat is not None:
            heartbeat.touch()
        return True
