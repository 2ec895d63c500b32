#!/bin/sh
# aenv mini initramfs (PID 1 before switch_root). Why: Debian's udev initramfs costs ~3 s
# under TCG; we only need virtio modules, the root disk and the tools drive.
export PATH=/bin
mount -t devtmpfs dev /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
while read -r m; do
    insmod "/lib/modules/$m.ko" 2>/dev/null
done < /modules.order
if grep -q aenv.probe /proc/cmdline; then
    echo "AENV-PROBE-OK"
    poweroff -f
fi
# Disks are found by filesystem label: virtio-mmio enumeration order is not guaranteed.
root=""; tools=""; n=0
while [ -z "$root" ] || [ -z "$tools" ]; do
    root=$(findfs LABEL=aenv-root 2>/dev/null)
    tools=$(findfs LABEL=aenv-tools 2>/dev/null)
    n=$((n + 1))
    if [ $n -gt 500 ]; then echo "aenv-initramfs: disks not found (root=$root tools=$tools)"; ls /dev; sleep 1; poweroff -f; fi
    if [ -z "$root" ] || [ -z "$tools" ]; then usleep 10000; fi
done
mkdir -p /newroot
mount -t ext4 -o rw,noatime "$root" /newroot || { echo "aenv-initramfs: cannot mount root"; poweroff -f; }
mkdir -p /newroot/opt/aenv 2>/dev/null
mount -t ext4 -o ro,noload "$tools" /newroot/opt/aenv || { echo "aenv-initramfs: cannot mount tools"; poweroff -f; }
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /opt/aenv/init
