"""The network seam between a VM and the host.

Why: per-sandbox networking (a netns + TAP device per VM, an enforced egress policy) comes
next; drivers only ask a backend to attach a VM's network (vmm.net.backend.NetworkBackend:
attach / detach / forward a guest port / apply an egress policy) and build their network
device from the Attachment it returns, so a new backend lands here, not in every driver verb.
BootSpec.network (a NetworkSpec) says what a VM's network must be. Today's only backend is
QEMU's user-mode networking (SlirpBackend); it cannot filter egress, so it refuses a restriction
(UnsupportedNetworkPolicy) rather than accepting and ignoring it.

Modules: spec (NetworkSpec, guest addresses, ENVD_PORT), backend (Attachment, NetworkBackend),
slirp (SlirpBackend), ports (host port allocation for forwards).
"""

from envd import ENVD_PORT
from vmm.errors import UnsupportedNetworkPolicy
from vmm.net.backend import Attachment, NetworkBackend
from vmm.net.slirp import SlirpBackend
from vmm.net.spec import DNS, GATEWAY, GUEST_IP, GUEST_PREFIX, NetworkSpec

__all__ = ["ENVD_PORT", "DNS", "GATEWAY", "GUEST_IP", "GUEST_PREFIX", "Attachment", "NetworkBackend", "NetworkSpec",
           "SlirpBackend", "UnsupportedNetworkPolicy"]
