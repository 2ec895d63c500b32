"""Running a node: register it, start the heartbeat, consume ``node.<id>`` with a
thread pool (VM operations are mostly waits on subprocesses and sockets, so many
boots run in parallel on few cores)."""
import logging

from django.conf import settings

from aenv_site.celery import app as celery_app
from nodes.driver import get_driver
from nodes.heartbeat import Heartbeat, register_node

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 32


def node_capacity(driver, vcpu_overcommit: float, memory_overcommit: float) -> tuple[int, int]:
    """What placement may reserve on this host: host size times the overcommit factors."""
    host = driver.capacity()
    return int(host["vcpus"] * vcpu_overcommit), int(host["memory_mb"] * memory_overcommit)


def worker_argv(node_id: str, concurrency: int, loglevel: str = "INFO") -> list[str]:
    return [
        "worker",
        "--queues", f"node.{node_id}",
        "--pool", "threads",
        "--concurrency", str(concurrency),
        "--hostname", f"{node_id}@%h",
        "--loglevel", loglevel,
        "--without-gossip",
        "--without-mingle",
    ]


def run_node(*, concurrency: int = DEFAULT_CONCURRENCY, vcpu_overcommit: float, memory_overcommit: float,
             loglevel: str = "INFO") -> None:
    """Blocks running the Celery worker; VMs it started keep running after it exits."""
    driver = get_driver()
    node_id = settings.AENV_NODE_ID
    vcpus, memory_mb = node_capacity(driver, vcpu_overcommit, memory_overcommit)

    def count_running() -> int:
        return len(driver.list())

    node = register_node(
        node_id=node_id, address=settings.AENV_NODE_ADDRESS, driver_name=settings.AENV_DRIVER,
        accel=driver.accel, vcpu_capacity=vcpus, memory_mb_capacity=memory_mb,
        sandboxes_running=count_running(), version=_version(),
    )
    log.info("node %s registered: accel=%s capacity=%d vCPU / %d MiB, queue %s",
             node.id, node.accel, vcpus, memory_mb, node.queue)
    heartbeat = Heartbeat(node_id, settings.AENV_NODE_HEARTBEAT_INTERVAL, count_running)
    heartbeat.start()
    try:
        celery_app.worker_main(worker_argv(node_id, concurrency, loglevel))
    finally:
        heartbeat.stop()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("aenv")
    except Exception:
        return ""
