"""Firecracker driver placeholder: production KVM hosts only.

Why no implementation yet: Firecracker needs a usable /dev/kvm and its binary, neither of which
exists on development/CI hosts; constructing it fails loudly instead of pretending to work.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vmm.driver import VMError
from vmm.hostinfo import kvm_openable


class FirecrackerDriver:
    name = "firecracker"
    accel = "kvm"

    def __init__(self, home: Path, images_dir: Path, host_address: str = "127.0.0.1", **options):
        if not kvm_openable() or shutil.which("firecracker") is None:
            raise VMError("firecracker needs a usable /dev/kvm and the firecracker binary; not available on this host")
        raise VMError("the firecracker driver is not implemented yet; use AENV_DRIVER=qemu")
