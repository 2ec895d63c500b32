"""`manage.py run_node`: this machine's node worker (see agent.worker)."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent.join import NodeNotAdmitted
from agent.worker import run_node
from nodes.join import NodeRevoked


class Command(BaseCommand):
    help = "Register this node, heartbeat, and run VM tasks from queue node.<AENV_NODE_ID>."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int,
                            default=settings.AENV_NODE_CONCURRENCY,
                            help="worker threads (parallel VM operations)")
        parser.add_argument("--vcpu-overcommit", type=float,
                            default=settings.AENV_NODE_VCPU_OVERCOMMIT,
                            help="vCPUs placement may hand out per host CPU")
        parser.add_argument("--memory-overcommit", type=float,
                            default=settings.AENV_NODE_MEMORY_OVERCOMMIT,
                            help="guest MiB placement may hand out per host MiB")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts):
        try:
            run_node(concurrency=opts["concurrency"], vcpu_overcommit=opts["vcpu_overcommit"],
                     memory_overcommit=opts["memory_overcommit"], loglevel=opts["loglevel"])
        except NodeNotAdmitted as exc:  # never joined, or refused by the control plane
            raise CommandError(f"node {settings.AENV_NODE_ID} not started: {exc}") from exc
        except NodeRevoked as exc:
            raise CommandError(f"node {settings.AENV_NODE_ID} not started: {exc.message}") from exc
