"""The network backend interface: how a VM gets the network its NetworkSpec asks for.

Why an interface: the hypervisor driver only needs to know what to hand the hypervisor (an
Attachment) and which host endpoint reaches a guest port; who provides the network (QEMU's
user-mode slirp today, a netns + TAP device with an egress filter next) is the backend's.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

from envd import ENVD_PORT
from vmm.errors import UnsupportedNetworkPolicy
from vmm.net.spec import DNS, GATEWAY, GUEST_IP, NetworkSpec


@dataclass
class Attachment:
    """What a backend set up for one VM: the hypervisor's network device is built from it
    (QEMU: `-netdev user` with a hostfwd per forward), and a VM that moves to a new process
    (resume) keeps it."""

    backend: str  # the backend's name ("slirp")
    sandbox_id: str
    host_address: str  # where the host side of the forwards listens
    forwards: dict[int, int] = field(default_factory=dict)  # guest TCP port -> host port
    guest_ip: str = GUEST_IP
    gateway: str = GATEWAY
    dns: str = DNS
    # netns backend: the slot index the VM runs in, and where every guest port is reachable
    # (the slot address); slirp: None and "" (only `forwards` reach the guest).
    slot: int | None = None
    guest_host: str = ""

    def host_port(self, guest_port: int) -> int:
        return self.forwards[guest_port]


class NetworkBackend(abc.ABC):
    """attach / detach a VM, forward a guest port, apply an egress policy."""

    name: str
    enforces_egress: bool = False  # can apply_egress() filter a VM's outgoing traffic?

    def check(self, spec: NetworkSpec) -> None:
        """Raises UnsupportedNetworkPolicy, before anything is set up, if this backend cannot
        give a VM the network `spec` asks for."""
        restrictions = spec.restrictions()
        if restrictions and not self.enforces_egress:
            raise UnsupportedNetworkPolicy(
                f"the {self.name} network backend cannot restrict egress ({'; '.join(restrictions)}); "
                "aenv does not enforce egress policies yet")

    host_address: str  # where the host side of the forwards listens

    def attach(self, sandbox_id: str, state_dir: Path, spec: NetworkSpec) -> Attachment:
        """Sets up the VM's network before its hypervisor starts: checks `spec`, forwards
        envd's port and each of its guest ports, applies its egress policy. Claims live in
        `state_dir` (they go with it)."""
        self.check(spec)
        attachment = Attachment(self.name, sandbox_id, self.host_address)
        for guest_port in dict.fromkeys((ENVD_PORT, *spec.forward_ports)):
            self.forward(attachment, state_dir, guest_port)
        self.apply_egress(attachment, spec)
        return attachment

    @abc.abstractmethod
    def forward(self, attachment: Attachment, state_dir: Path, guest_port: int) -> int:
        """Makes guest_port reachable from the host before the VM starts; the host port."""

    @abc.abstractmethod
    def apply_egress(self, attachment: Attachment, spec: NetworkSpec) -> None:
        """Enforces spec's egress policy for the VM, or raises UnsupportedNetworkPolicy."""

    @abc.abstractmethod
    def detach(self, attachment: Attachment, state_dir: Path) -> None:
        """Releases what attach() set up (after the VM stopped for good)."""
