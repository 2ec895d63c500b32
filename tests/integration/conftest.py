"""A real aenv stack (daphne + uvicorn + node worker + lifecycle sweeper + events worker + QEMU VMs) for
the whole session, and `running_stack` for modules that need their own settings; a two-node
stack on the S3 store shared by the cross-node tests (`s3_two_nodes`); a local OCI registry with
one test image for the template-build tests (Python and TypeScript SDK)."""
import os
import shutil
import time
import uuid

import pytest

from harness import oci_images, oci_registry
from harness.moto_s3 import CREDENTIALS, moto_server
from harness.second_node import SecondNode
from harness.stack import ROOT, running_stack  # noqa: F401 - the modules' own stacks import it from here
from .tls_ingress import TlsIngress


@pytest.fixture(scope="session")
def stack():
    # With the events worker, and webhooks allowed to reach the tests' receivers on 127.0.0.1.
    with running_stack(with_events=True, extra_env={"AENV_WEBHOOK_ALLOW_PRIVATE": "1"}) as s:
        yield s


@pytest.fixture
def sdk_env(stack, monkeypatch):
    """Points the official E2B SDK at the stack through its environment variables."""
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return stack


@pytest.fixture(scope="session")
def tls_ingress(stack, tmp_path_factory):
    """Host routing's TLS terminator in front of the session's data plane, as the SDKs'
    ``proxy`` (tls_ingress.py): no VM, no DNS name, no port 443."""
    host, port = stack.sandbox_url.removeprefix("http://").rsplit(":", 1)
    ingress = TlsIngress((host, int(port)), tmp_path_factory.mktemp("ingress")).start()
    yield ingress
    ingress.stop()


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """Debian's docker-registry on 127.0.0.1 for the session (skips where it cannot run)."""
    reason = oci_registry.available() or oci_images.available()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("registry")
    reg = oci_registry.start(root / "registry")
    yield reg
    oci_registry.stop(root / "registry")


@pytest.fixture(scope="session")
def app_image(registry):
    """debian (small) + an app layer, pushed once per session as <registry>/aenv-test/app:v1."""
    token = f"tpl-{uuid.uuid4().hex[:8]}"
    return oci_images.make_test_image(registry.host, "aenv-test/app", "v1", token,
                                      base_layer=oci_images.debootstrap_layer(oci_images.debian_rootfs()))


# ------------------------------------------- the second shared stack: node kills and own settings

NODE_KILL_STACK = "node_kill_stack"
_node_kill = {}  # "exit": the ExitStack of the running stack, closed after its last user
# Settings the session's stack must not have, each for one module of this stack's:
METRICS_TOKEN = "metrics-e2e-" + "0" * 32  # test_metrics_e2e.py: /metrics of all three wants it
WARM_SLOTS = 2  # test_network_faults.py counts the instance's slots: the warm pool is all that is left
NODE_KILL_STACK_ENV = {
    "AENV_SANDBOX_METRICS_INTERVAL": "1",  # test_metrics_e2e.py: samples within its test
    "AENV_METRICS_TOKEN": METRICS_TOKEN,
    "AENV_NET_WARM_SLOTS": str(WARM_SLOTS),
    # test_egress_proxy_vm.py: its upstream proxies are on the test world's private addresses
    "AENV_EGRESS_PROXY_ALLOW_PRIVATE": "1",
}


@pytest.fixture(scope="package")
def node_kill_stack():
    """The second stack of the package, for the modules that stop or SIGKILL its node worker
    and start it again (test_node_stop.py, test_network_faults.py, test_template_build_faults.py),
    which the session's stack must not have done to it, and for those that need settings the
    session's must not have (``NODE_KILL_STACK_ENV``: test_metrics_e2e.py, test_egress_proxy_vm.py;
    test_ttl.py restarts only its sweeper with a short retention, ``restart_lifecycle``): one
    start (~17 s) and stop (~6 s) for all of them instead of one each. Its node's Prometheus
    endpoint is at ``.node_metrics_url``. They run one after the other
    (``pytest_collection_modifyitems``), test_node_stop.py first (it counts the stack's pause
    events and reads its node log), and the stack stops right after the last of them
    (``pytest_runtest_teardown``), not at the package's end. A test must leave the node worker
    running with the stack's settings, and nothing of its own behind: no sandbox, no file in
    the node's hosts.d."""
    from contextlib import ExitStack  # noqa: PLC0415

    from harness.stack import free_port  # noqa: PLC0415

    port = free_port()
    with ExitStack() as exit_stack:
        _node_kill["exit"] = exit_stack
        s = exit_stack.enter_context(running_stack(
            "nodekill", extra_env={**NODE_KILL_STACK_ENV, "AENV_NODE_METRICS_PORT": str(port)}))
        s.node_metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield s
        _node_kill.pop("exit", None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if NODE_KILL_STACK in getattr(item, "fixturenames", ()) and (
            nextitem is None or NODE_KILL_STACK not in getattr(nextitem, "fixturenames", ())):
        exit_stack = _node_kill.pop("exit", None)
        if exit_stack is not None:
            exit_stack.close()


# ------------------------------------------------------------------ the shared S3 two-node stack

S3_TWO_NODES = "s3_two_nodes"
S3_TWO_NODES_BUCKET = "aenv-two-nodes"


@pytest.fixture(scope="package")
def _s3_two_nodes_stack():
    """One moto server, one stack on the S3 store (node A) and a second node worker (node B: a
    home, images dir and network instance of its own, the base disk hard-linked in) for the
    cross-node tests of this package: starting them is ~20 s for the stack and ~15 s for node B
    under the VM pass's load, and their stops ~6 s each, once instead of once per module. Its
    settings are every user's: AENV_FORK_MAX_PER_NODE=2 (a fork of four spans the nodes), lazy
    restores where FUSE works (the default). Tests that kill a node or need other settings keep
    their own stack (test_node_death.py, test_snapshot_s3_e2e.py)."""
    with moto_server(S3_TWO_NODES_BUCKET) as url:
        prefix = f"two-{uuid.uuid4().hex[:6]}"
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": S3_TWO_NODES_BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": prefix, **CREDENTIALS,
               "AENV_FORK_MAX_PER_NODE": "2"}
        with running_stack("s3two", extra_env=env) as s:
            root = ROOT / "var" / "test-runs" / f"xn-{uuid.uuid4().hex[:6]}"  # QMP paths stay short
            root.mkdir(parents=True)
            node_b = None
            try:
                node_b = SecondNode(s, root)
                s.s3, s.node_b = (url, prefix), node_b
                yield s
            finally:
                if node_b is not None:
                    node_b.stop()
                shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def s3_two_nodes(_s3_two_nodes_stack, monkeypatch):
    """The shared S3 two-node stack (``.node_b``: its SecondNode, ``.s3``: (endpoint, prefix)),
    the E2B SDK pointed at it. Each test starts with both nodes taking sandboxes and must kill
    what it made; after it, neither node is left draining and no sandbox is left running."""
    stack = _s3_two_nodes_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    yield stack
    left = stack.db("from nodes.models import Node; from sandboxes.models import Sandbox as S; "
                    "Node.objects.update(draining=False); "
                    "print(S.objects.filter(state__in=['running', 'paused']).count())").strip()
    deadline = time.monotonic() + 30  # kills answered; the rows follow
    while left != "0" and time.monotonic() < deadline:
        time.sleep(1)
        left = stack.db("from sandboxes.models import Sandbox as S; "
                        "print(S.objects.filter(state__in=['running', 'paused']).count())").strip()
    assert left == "0", "a test on the shared S3 two-node stack left sandboxes behind"


def pytest_collection_modifyitems(config, items):
    """The modules on a shared package-scoped stack run together, after this package's other
    tests: the stack starts once for them and stops right after them, instead of idling
    (heartbeats, sweeps) beside every test between the first and the last of them; within
    the node kill stack's, test_node_stop.py first."""
    here = os.path.dirname(__file__)
    for name, first in ((NODE_KILL_STACK, "test_node_stop.py"), (S3_TWO_NODES, None)):
        shared = {str(i.path) for i in items if name in getattr(i, "fixturenames", ())}
        if not shared:
            continue
        group = [i for i in items if str(i.path) in shared]
        if first:
            group.sort(key=lambda i: i.path.name != first)  # stable: the modules' own order stays
        rest = [i for i in items if str(i.path) not in shared]
        at = items.index(group[0])  # where the first of them was: the rest before it stay before
        for n, item in enumerate(rest):
            if os.path.dirname(str(item.path)) == here and not (
                    {NODE_KILL_STACK, S3_TWO_NODES} & set(getattr(item, "fixturenames", ()))):
                at = max(at, n + 1)  # after this package's last other test
        items[:] = rest[:at] + group + rest[at:]
