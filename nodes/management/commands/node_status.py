"""Prints every node and whether it is alive; exits 1 when no node is alive.

Used by scripts/up.sh to wait for the node worker, and by people to look."""
from django.core.management.base import BaseCommand

from nodes.models import Node


class Command(BaseCommand):
    help = "Show nodes and their heartbeat; exit status 1 if none is alive."

    def add_arguments(self, parser):
        parser.add_argument("--quiet", action="store_true", help="print nothing, only set the exit status")

    def handle(self, *args, quiet=False, **options):
        alive = 0
        for node in Node.objects.all():
            ok = node.is_alive()
            alive += ok
            if not quiet:
                self.stdout.write(
                    f"{node.id:20} {'alive' if ok else 'dead':6} driver={node.driver} accel={node.accel} "
                    f"vcpus={node.vcpu_capacity} memory_mb={node.memory_mb_capacity} "
                    f"running={node.sandboxes_running} heartbeat={node.last_heartbeat_at}"
                )
        if not alive:
            if not quiet:
                self.stderr.write("no node is alive")
            raise SystemExit(1)
