"""QEMU command-line assembly: the device set later restores depend on must stay stable."""

from pathlib import Path

import pytest

from vmm.hostinfo import _mhz_from_cpuinfo, lpj
from vmm.net import ENVD_PORT, Attachment
from vmm.qemu.cmdline import IDLE_KERNEL_ARGS, VMPaths, kernel_cmdline, qemu_command


def make(accel="tcg", **kw):
    paths = VMPaths.for_sandbox(Path("/h/sandboxes/sb1"), "sb1")
    args = dict(paths=paths, kernel=Path("/img/vmlinuz"), initrd=Path("/img/initrd.cpio"), tools=Path("/img/tools.img"),
                accel=accel, cpu_count=2, memory_mb=512, tsc_khz=2445406,
                network=Attachment("slirp", "sb1", "127.0.0.1", {ENVD_PORT: 41234}))
    args.update(kw)
    return qemu_command(**args)


def opt(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_memory_is_shared_file_on_dev_shm():
    argv = make()
    assert "memory-backend-file,id=ram0,size=512M,mem-path=/dev/shm/aenv-sb1.ram,share=on" in opt(argv, "-object")
    assert opt(argv, "-M") == ["microvm,memory-backend=ram0"]
    assert opt(argv, "-m") == ["512M"] and opt(argv, "-smp") == ["2"]


def test_tcg_caps_code_buffer_and_kvm_uses_host_cpu():
    assert opt(make(), "-accel") == ["tcg,tb-size=64"] and opt(make(), "-cpu") == ["max"]
    assert opt(make("kvm"), "-accel") == ["kvm"] and opt(make("kvm"), "-cpu") == ["host"]
    with pytest.raises(ValueError):
        make("hvf")


def test_devices_disks_network_and_control():
    argv = make()
    devices = opt(argv, "-device")
    assert "virtio-balloon-device,free-page-reporting=on,id=balloon0" in devices
    assert sum(d.startswith("virtio-blk-device") for d in devices) == 2
    assert "driver=file,node-name=rootfile,filename=/h/sandboxes/sb1/top.qcow2" in opt(argv, "-blockdev")
    assert any("tools.img,read-only=on" in b for b in opt(argv, "-blockdev"))
    # slirp (the fallback) is restricted: the guest reaches neither the host nor beyond it
    assert opt(argv, "-netdev") == [f"user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:41234-:{ENVD_PORT}"]
    more = make(network=Attachment("slirp", "sb1", "127.0.0.1", {ENVD_PORT: 41234, 8080: 41235}))
    assert opt(more, "-netdev") == ["user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:41235-:8080,"
                                    f"hostfwd=tcp:127.0.0.1:41234-:{ENVD_PORT}"]
    assert "virtio-net-device,netdev=net0,id=vnet0,mac=02:fc:00:00:00:05" in devices
    assert "aenv.net=slirp" in opt(argv, "-append")[0].split()
    # netns: the slot's tap0, no vhost, no scripts, the same MAC; the guest is told its mode
    tap = make(network=Attachment("netns", "sb1", "10.12.0.3", {ENVD_PORT: ENVD_PORT}, slot=1))
    assert opt(tap, "-netdev") == ["tap,id=net0,ifname=tap0,script=no,downscript=no"]
    assert "aenv.net=netns" in opt(tap, "-append")[0].split()
    assert [a for a in tap if "hostfwd" in a] == []
    with pytest.raises(ValueError, match="tap"):
        make(network=Attachment("tap", "sb1", "127.0.0.1", {ENVD_PORT: 41234}))
    assert opt(argv, "-qmp") == ["unix:/h/sandboxes/sb1/qmp.sock,server=on,wait=off"]
    assert "-daemonize" in argv and opt(argv, "-pidfile") == ["/h/sandboxes/sb1/qemu.pid"]
    assert "-nographic" not in argv  # incompatible with -daemonize


def test_kernel_cmdline_has_tsc_fix():
    line = kernel_cmdline(2445406)
    assert "tsc_early_khz=2445406" in line and f"lpj={2445406 * 4}" in line
    assert "tsc=reliable" in line.split()  # TSC clocksource with several vCPUs
    assert "aenv.resize" not in line and "aenv.resize=1" in kernel_cmdline(1, resize=True)
    assert lpj(2000000) == 8000000


def test_kernel_cmdline_quietens_an_idle_guest():
    words = kernel_cmdline(2445406, net_mode="netns").split()
    for arg in ("sysctl.vm.compaction_proactiveness=0", "nowatchdog", "psi=0", "sysctl.vm.stat_interval=10"):
        assert arg in words and arg in IDLE_KERNEL_ARGS
    assert "tsc=reliable" in words and "clocksource=jiffies" not in words  # the clock is untouched


def test_cpuinfo_parsing():
    assert _mhz_from_cpuinfo("processor\t: 0\ncpu MHz\t\t: 2445.406\n") == 2445.406
    assert _mhz_from_cpuinfo("nothing") is None


def test_rejects_silly_sizes():
    with pytest.raises(ValueError):
        make(memory_mb=16)
    with pytest.raises(ValueError):
        make(cpu_count=0)


def test_restore_destination_differs_only_in_ram_share_top_port_and_incoming():
    src = make()
    other = VMPaths(state_dir=Path("/h/sandboxes/sb1"), top=Path("/h/sandboxes/sb1/top-1.qcow2"),
                    qmp=Path("/h/sandboxes/sb1/qmp.sock"), console=Path("/h/sandboxes/sb1/console.log"),
                    pidfile=Path("/h/sandboxes/sb1/qemu.pid"), ram=Path("/dev/shm/aenv-sb1.ram"))
    dst = make(paths=other, network=Attachment("slirp", "sb1", "127.0.0.1", {ENVD_PORT: 45000}), ram_share=False,
               incoming=True)
    assert dst[-3:] == ["-S", "-incoming", "defer"] and "-incoming" not in src and "-S" not in src
    changed = [(a, b) for a, b in zip(src, dst[:-3]) if a != b]
    assert len(src) == len(dst) - 3 and len(changed) == 3
    assert "share=off" in changed[0][1] and "top-1.qcow2" in changed[1][1] and "45000" in changed[2][1]
