"""VM drivers, guest images and host networking, with no Django: the driver contract and
registry (``driver``), the fake and QEMU drivers, booted templates (``templates``), the
network seam (``net``) and the guest image builders (``images``, ``rootfs``,
``toolsdrive``). See vmm/README.md."""
