"""``manage.py revoke_node NODE_ID``: as ``POST /nodes/{id}/revoke`` (``nodes.join.revoke_node``)."""
from django.core.management.base import BaseCommand, CommandError

from nodes import join
from sandboxes.errors import LifecycleError


class Command(BaseCommand):
    help = ("Revoke a node: no placement, no task sent, its heartbeats ignored, its unspent join tokens "
            "revoked; it may join again only with a join token created for its id afterwards.")

    def add_arguments(self, parser):
        parser.add_argument("node_id")

    def handle(self, *args, node_id, **opts):
        try:
            node = join.revoke_node(node_id)
        except LifecycleError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(f"node {node.pk} revoked at {node.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
