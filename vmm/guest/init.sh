#!/opt/aenv/bin/busybox sh
# shellcheck shell=dash  # busybox's ash: shellcheck checks it as the closest shell it knows
# aenv guest init (PID 1 after switch_root), shipped on the read-only tools drive so it works
# whatever the template contains: mounts, network (from aenv.net=), envd, zombie reaping.
B=/opt/aenv/bin/busybox
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
$B mkdir -p /dev/pts /dev/shm /run /tmp
[ -e /proc/self ] || $B mount -t proc proc /proc
[ -e /sys/kernel ] || $B mount -t sysfs sys /sys
[ -e /dev/null ] || $B mount -t devtmpfs dev /dev
$B mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
$B mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm
$B mount -t tmpfs -o mode=755,nosuid,nodev run /run
$B mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
$B ln -sf /proc/self/fd /dev/fd
$B ln -sf /proc/self/fd/0 /dev/stdin
$B ln -sf /proc/self/fd/1 /dev/stdout
$B ln -sf /proc/self/fd/2 /dev/stderr
$B chmod 1777 /tmp
$B mkdir -p /run/lock /run/user && $B chmod 1777 /run/lock
$B hostname "$($B cat /etc/hostname 2>/dev/null || echo aenv)"
# The driver asks to grow the root filesystem online when the sandbox disk is larger than the template's.
# The drive's resize2fs runs in any image (the host's e2fsprogs, which made the filesystem, on the
# drive's loader); the image's own, if it has one, is only the fallback.
if $B grep -q aenv.resize /proc/cmdline; then
    ROOT_DEV="$($B findfs LABEL=aenv-root)"
    /opt/aenv/bin/resize2fs "$ROOT_DEV" >/dev/null 2>&1 ||
        { command -v resize2fs >/dev/null 2>&1 && resize2fs "$ROOT_DEV" >/dev/null 2>&1; } ||
        echo "aenv-init: could not grow the root filesystem on $ROOT_DEV"
fi
# The network the driver gave this VM (kernel argument aenv.net=): a netns slot has the same
# addresses in every slot (restored and forked guests keep them); restricted slirp has QEMU's.
$B ip link set lo up
case " $($B cat /proc/cmdline) " in
    *" aenv.net=netns "*) NET_ADDR=169.254.0.21/30 NET_GW=169.254.0.22 NET_DNS=8.8.8.8 ;;
    *) NET_ADDR=10.0.2.15/24 NET_GW=10.0.2.2 NET_DNS=10.0.2.3 ;;
esac
$B ip addr add "$NET_ADDR" dev eth0
$B ip link set eth0 up
$B ip route add default via "$NET_GW"
[ -L /etc/resolv.conf ] && $B rm -f /etc/resolv.conf
echo "nameserver $NET_DNS" > /etc/resolv.conf
[ -d /sys/module/virtio_balloon ] || $B modprobe virtio_balloon 2>/dev/null
echo "aenv-init: starting envd (uptime $($B cut -d" " -f1 /proc/uptime)s)"
(
    while true; do
        /opt/aenv/envd.sh --host 0.0.0.0 --port 49983 </dev/null
        echo "aenv-init: envd exited with $?, restarting"
        $B sleep 1
    done
) &
# PID 1 must reap orphans: ash's wait blocks on waitpid(-1) while the envd loop job runs.
while true; do
    wait
    $B sleep 1
done
