"""`manage.py run_node`: this machine's node worker (see agent.worker)."""
from django.conf import settings
from django.core.management.base import BaseCommand

from agent.worker import run_node


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
        run_node(concurrency=opts["concurrency"], vcpu_overcommit=opts["vcpu_overcommit"],
                 memory_overcommit=opts["memory_overcommit"], loglevel=opts["loglevel"])
