"""Running a node: register it, start the heartbeat (with the host's figures), the watch
over its VMs (agent.vm_watch), the sandbox metrics sampler and the Prometheus exporter,
consume ``node.<id>`` with a thread pool (VM operations are mostly waits on subprocesses and
sockets, so many boots run in parallel on few cores)."""
import logging
import os
import signal

from django.conf import settings
from django.utils import timezone

from nodes.celery_app import app as celery_app
from agent import tasks  # noqa: F401 - registers the node tasks with the Celery app this worker runs
from agent.console_logs import ConsoleCollector
from agent.driver import get_driver, get_templates
from agent.chunk_peers import start_chunk_peers
from agent.heartbeat import Heartbeat, mark_stopped, register_node
from agent import egress_trust
from agent.join import ensure_joined
from agent.host_usage import HostSampler
from agent.metrics import MetricsSampler, vm_cpu_seconds
from agent.prometheus import NodeCollector, count_round, start_exporter
from agent.reconcile import Reconciler, purge_queue, reconcile_node
from agent.shutdown import pause_all
from agent.stores import get_store
from agent.vm_watch import VmWatch
from nodes import protocol, signing
from vmm import process_heap

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
    """Blocks running the Celery worker; VMs it started keep running after it exits. Joins
    first where it must (agent.join: NodeNotAdmitted when it may not), and stops when the
    control plane revokes it (register_node and the heartbeat raise NodeRevoked)."""
    node_id = settings.AENV_NODE_ID
    process_heap.limit_arenas(settings.AENV_MALLOC_ARENAS)  # before the worker's threads allocate
    ensure_joined(node_id)
    egress_trust.node_ca()  # the TLS-interception CA: made now if this node has none (AENV_EGRESS_CA_DIR)
    driver = get_driver()
    vcpus, memory_mb = node_capacity(driver, vcpu_overcommit, memory_overcommit)
    network = start_network(driver)

    def count_running() -> int:
        return len(driver.list())

    host_sampler = HostSampler(["/", str(settings.AENV_HOME), str(settings.AENV_IMAGES_DIR),
                                str(settings.AENV_SHM_DIR)])
    host_sampler.probes["chunkCache"] = lambda: get_store().chunk_cache_figures()  # lazy restores
    getattr(get_store(), "warm_up", lambda: None)()  # lazy restores: the chunkfs daemon, the own-chunk index
    chunk_peers = start_chunk_peers(node_id, get_store())  # AENV_CHUNK_PEER_FETCH
    if chunk_peers is not None:
        host_sampler.probes["chunkPeerPort"] = lambda: chunk_peers.port  # how the other nodes find it
        # a fork's capture may be handed to and from this node before its upload ends
        host_sampler.probes[protocol.FORK_HANDOFF] = lambda: chunk_peers.port is not None and get_store().hands_over()
    heartbeat = Heartbeat(node_id, settings.AENV_NODE_HEARTBEAT_INTERVAL, count_running, host_sampler=host_sampler,
                          history=settings.AENV_NODE_HOST_HISTORY, local_snapshots=lambda: get_store().local_ids(),
                          on_revoked=_stop_revoked)
    metrics_port = start_exporter(settings.AENV_NODE_ADDRESS, settings.AENV_NODE_METRICS_PORT,
                                  NodeCollector(node_id, count_running, lambda: heartbeat.last_host, (vcpus, memory_mb),
                                                chunk_cache=lambda: get_store().chunk_cache_figures()),
                                  token=settings.AENV_METRICS_TOKEN)
    if metrics_port:
        host_sampler.extra["metricsPort"] = metrics_port
    heartbeat.last_host = host_sampler.sample()
    node = register_node(
        node_id=node_id, address=settings.AENV_NODE_ADDRESS, driver_name=settings.AENV_DRIVER,
        accel=driver.accel, vcpu_capacity=vcpus, memory_mb_capacity=memory_mb,
        sandboxes_running=count_running(), version=_version(), host=heartbeat.last_host,
        snapshots_here=get_store().local_ids(),
    )
    log.info("node %s registered: accel=%s network=%s capacity=%d vCPU / %d MiB, queue %s",
             node.id, node.accel, network.get("network", "?"), vcpus, memory_mb, node.queue)
    if signing.SERIALIZER in celery_app.conf.accept_content:
        log.info("node %s runs only tasks signed by the control plane (certificate %s)", node.id,
                 settings.AENV_TASK_SIGNING_CERT or settings.AENV_TASK_SIGNING_DIR / signing.CERT_FILE)
    else:
        log.warning("node %s runs UNSIGNED tasks: no task-signing certificate (AENV_TASK_SIGNING_CERT); "
                    "whoever can write to the broker can make it run anything", node.id)
    heartbeat.start()
    trimmer = process_heap.Trimmer(settings.AENV_MALLOC_TRIM_INTERVAL)
    trimmer.start()
    reconciler = Reconciler(node_id, driver, settings.AENV_RECONCILE_INTERVAL, settings.AENV_RECONCILE_STALE)
    watch = VmWatch(node_id, driver, settings.AENV_VM_WATCH_INTERVAL, lazy=lambda: getattr(get_store(), "lazy", None))
    sampler = MetricsSampler(node_id, settings.AENV_SANDBOX_METRICS_INTERVAL, settings.AENV_SANDBOX_METRICS_RETENTION,
                             on_round=count_round, idle_interval=settings.AENV_SANDBOX_METRICS_IDLE_INTERVAL,
                             host_cpu=lambda: vm_cpu_seconds(driver))
    consoles = ConsoleCollector(node_id, driver, settings.AENV_SANDBOX_LOGS_INTERVAL,
                                settings.AENV_SANDBOX_LOGS_RETENTION)
    try:
        reattach(node_id, node.queue, driver)
        prepare_default_template(driver)
        reconciler.start()
        watch.start()
        sampler.start()
        consoles.start()
        celery_app.worker_main(worker_argv(node_id, concurrency, loglevel))
    finally:
        try:
            mark_stopped(node_id)  # no new placement while it pauses its sandboxes and leaves
        except Exception:  # noqa: BLE001 - then its heartbeat ages out as before
            log.exception("could not record node %s as stopped", node_id)
        consoles.stop()
        sampler.stop()
        watch.stop()
        reconciler.stop()
        if settings.AENV_NODE_STOP_PAUSE:  # the worker took its last task: nothing runs unattended
            try:
                pause_all(node_id, driver, float(settings.AENV_NODE_STOP_TIMEOUT))
            except Exception:  # noqa: BLE001 - the VMs keep running; the next start reattaches them
                log.exception("stopping: pausing the sandboxes of node %s failed", node_id)
        stop_network(driver)
        heartbeat.stop()
        trimmer.stop()
        if chunk_peers is not None:
            chunk_peers.stop()  # the daemon keeps serving its cache: it outlives the worker


def _stop_revoked(error) -> None:
    """The heartbeat found this node revoked: the worker's warm shutdown (as on SIGTERM)."""
    log.error("node revoked by the control plane, shutting down: %s", error.message)
    os.kill(os.getpid(), signal.SIGTERM)


def prepare_default_template(driver) -> None:
    """The default template's restores readied before the first create (QEMU: its RAM file made
    ahead, AENV_WARM_RAM_COPIES), so a node's first create is as fast as its next ones."""
    prepare = getattr(driver, "prepare_restores", None)
    if prepare is None:
        return
    from vmm.driver import BootSpec  # noqa: PLC0415

    spec = BootSpec(sandbox_id="default-template", image="base", cpu_count=settings.AENV_BASE_CPU_COUNT,
                    memory_mb=settings.AENV_BASE_MEMORY_MB, disk_size_mb=settings.AENV_BASE_DISK_MB)
    try:
        template = get_templates().find(driver, spec)
        if template is not None:
            prepare(template)
    except Exception:  # noqa: BLE001 - only a head start; creates copy the RAM themselves
        log.exception("readying the default template's restores failed")


def start_network(driver) -> dict:
    """Before serving: the driver's network backend takes over this instance's slots (those
    of VMs that outlived the worker are kept, the rest removed) and its resolver; reported
    like the accelerator."""
    start = getattr(driver, "start_network", None)
    report = start() if start is not None else {"network": getattr(getattr(driver, "net", None), "name", "none")}
    log.info("network backend: %s", ", ".join(f"{k}={v}" for k, v in report.items()))
    return report


def stop_network(driver) -> None:
    """After the last task: the network backend's warm slots go, and so do its accepts in the
    host's firewall (Docker's) if no sandbox runs any more (best effort: the next start puts
    everything right)."""
    stop = getattr(driver, "stop_network", None)
    if stop is None:
        return
    try:
        stop()
    except Exception:  # noqa: BLE001 - the worker exits either way
        log.exception("stopping: the network backend did not stop cleanly")


def reattach(node_id: str, queue: str, driver) -> list:
    """Before consuming: drop tasks sent while no worker ran, then reconcile every
    sandbox of this node with the VM the driver finds in its state dir (running and
    paused VMs outlive the worker and are simply served again; operations the previous
    worker died in are settled to the VM's real state — see agent.reconcile)."""
    from agent.builder import abandon_interrupted, trim_image_cache_at_start

    started = timezone.now()
    purged = purge_queue(queue)
    try:
        abandon_interrupted(node_id, driver)  # template builds die with the worker that ran them
    except Exception:  # noqa: BLE001 - reported; the sandboxes still get reconciled
        log.exception("cleanup of interrupted template builds on node %s failed", node_id)
    trim_image_cache_at_start(driver)  # AENV_IMAGE_CACHE_MB may have shrunk; only logs on failure
    try:
        done = reconcile_node(node_id, driver, older_than=started, settled=True)
    except Exception:  # noqa: BLE001 - the node still serves; the periodic pass retries
        log.exception("reconcile of node %s at start failed", node_id)
        return []
    log.info("node %s reattached: %d stale task(s) dropped, %d sandbox(es) reconciled", node_id, purged, len(done))
    return done


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("aenv")
    except Exception:
        return ""
