"""``manage.py node_tokens create|list|revoke``: the operators' join tokens (``nodes.join``)
from the control plane's shell, as ``POST/GET/DELETE /nodes/join-tokens`` and the dashboard."""
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from nodes import join
from nodes.models import NodeJoinToken
from sandboxes.errors import LifecycleError


class Command(BaseCommand):
    help = "Create (printed once), list or revoke the join tokens new nodes join with."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="a new single-use join token, printed once")
        create.add_argument("--node-id", default="", help="the only node id it admits (needed to re-admit a "
                                                          "revoked node or replace a joined node's credential)")
        create.add_argument("--ttl", default=None, help="how long it is valid: seconds, or 30m, 24h, 7d "
                                                        "(default AENV_NODE_JOIN_TOKEN_TTL)")
        sub.add_parser("list", help="every token: prefix, node id, expiry, state")
        revoke = sub.add_parser("revoke", help="revoke a token by its prefix (as listed)")
        revoke.add_argument("prefix")

    def handle(self, *args, action, **opts):
        try:
            if action == "create":
                token, raw = join.create_token(node_id=opts["node_id"], ttl=opts["ttl"], created_by="manage.py")
                self.stderr.write(f"join token {token.prefix}… for {token.node_id or 'any new node id'}, "
                                  f"valid until {token.expires_at:%Y-%m-%d %H:%M} UTC, single use; shown once:")
                self.stdout.write(raw)
            elif action == "list":
                now = timezone.now()
                for token in NodeJoinToken.objects.order_by("-created_at"):
                    used = f" by {token.used_by}" if token.used_at else ""
                    self.stdout.write(f"{token.prefix}  {token.node_id or '*':20} {token.state(now) + used:24} "
                                      f"expires {token.expires_at:%Y-%m-%d %H:%M}  created by {token.created_by or '?'}")
            else:
                token = join.revoke_token(opts["prefix"])
                self.stdout.write(f"join token {token.prefix}… revoked")
        except LifecycleError as exc:
            raise CommandError(exc.message) from exc
