"""The restricted slirp fallback with a real VM (issue 10 item 8): where a node cannot make
network namespaces its guests still run and answer on envd's forwarded port, but reach
neither the host (slirp's 10.0.2.2 used to be every host service) nor anything beyond it,
refuse egress policies they cannot enforce, and the node says so loudly at start."""
import logging
import socket
import threading

import pytest

from vmm.driver import BootSpec, UnsupportedNetworkPolicy, get_driver
from vmm.images import ensure_image
from vmm.net import NetworkSpec
from vmm.qemu.process import envd_healthy

from .test_lifecycle_vm import IMAGES_DIR

pytestmark = pytest.mark.vm


def test_restricted_slirp_guest_reaches_nothing(tmp_path, caplog):
    ensure_image(IMAGES_DIR, "base")
    with caplog.at_level(logging.WARNING, logger="vmm.net"):
        driver = get_driver("qemu", tmp_path / "home", IMAGES_DIR, network="slirp")
    assert driver.net.name == "slirp" and "restricted slirp" in caplog.text and "NO egress" in caplog.text
    assert driver.fingerprint()["net"] == "slirp"
    with pytest.raises(UnsupportedNetworkPolicy):
        driver.boot(BootSpec("slirp-policy", network=NetworkSpec(deny_out=("1.1.1.1/32",))))

    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    info = driver.boot(BootSpec("slirp-1", cpu_count=1, memory_mb=256))
    try:
        assert info.envd_host == "127.0.0.1" and info.envd_port != 49983 and info.guest_host == ""
        assert envd_healthy(info.envd_host, info.envd_port)
        from envd_client import EnvdClient  # noqa: PLC0415

        with EnvdClient.at(info.envd_host, info.envd_port) as envd:
            addr = envd.run("ip -4 -o addr show eth0", deadline=60).stdout.decode()
            assert "10.0.2.15/24" in addr
            probe = envd.run(f"timeout 8 bash -c 'exec 3<>/dev/tcp/10.0.2.2/{port}' && echo OPEN || echo closed",
                             deadline=60).stdout.decode()
        assert probe.strip() == "closed" and accepted == []
    finally:
        driver.kill("slirp-1")
        listener.close()
