"""SlirpBackend: the fallback where a node cannot make network namespaces: QEMU's user-mode
networking with ``restrict=on``.

The guest gets 10.0.2.15/24 (gateway 10.0.2.2, configured by the guest init) but reaches
neither the host nor anything beyond it: restrict=on isolates it, and only the explicit
forwards work, each a `hostfwd` on a free host port (vmm.net.ports: claimed in the VM's
state dir), envd's among them. It cannot filter egress per destination, so it refuses any
policy (check) instead of pretending; forwards are fixed when QEMU starts.
"""

from __future__ import annotations

from pathlib import Path

from envd import ENVD_PORT
from vmm.net import ports
from vmm.net.backend import Attachment, NetworkBackend
from vmm.net.spec import NetworkSpec


class SlirpBackend(NetworkBackend):
    name = "slirp"
    enforces_egress = False

    def __init__(self, host_address: str, sandboxes_dir: Path, port_range: tuple[int, int] = ports.PORT_RANGE):
        self.host_address = host_address
        self.sandboxes_dir = Path(sandboxes_dir)
        self.port_range = port_range

    def forward(self, attachment: Attachment, state_dir: Path, guest_port: int) -> int:
        if guest_port in attachment.forwards:
            return attachment.forwards[guest_port]
        claim = "port" if guest_port == ENVD_PORT else f"port-{guest_port}"
        host_port = ports.allocate(self.sandboxes_dir, Path(state_dir), self.host_address, self.port_range,
                                   claim=claim)
        attachment.forwards[guest_port] = host_port
        return host_port

    def apply_egress(self, attachment: Attachment, spec: NetworkSpec) -> None:
        self.check(spec)  # nothing to apply: slirp lets everything out, and refuses any restriction

    def detach(self, attachment: Attachment, state_dir: Path) -> None:
        for guest_port in attachment.forwards:  # the claims (they also go with the state dir)
            claim = "port" if guest_port == ENVD_PORT else f"port-{guest_port}"
            (Path(state_dir) / claim).unlink(missing_ok=True)
