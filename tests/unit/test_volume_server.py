"""``vmm.net.volume_server``'s pure parts: the ganesha configuration (NFSv3 over TCP only on the
slot's loopback, no locks, only the given exports as the server's root shows them, guest root
squashed), the launch script (a valid shell script that drops ganesha to six capabilities
and runs the guard as nobody), the guest's mount script (its paths quoted for the shell) and
the slot rules that open the guard's ports to the guest only. The real server against a
hostile guest: test_volume_server_confinement.py."""
import shlex
import subprocess

from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP, GUEST_IP


def test_config_exports_only_the_given_volumes_v3_tcp():
    conf = vs.config([vs.Export(1, "/srv/v/a", "/a"), vs.Export(2, "/srv/v/b", "/b")], 1000, 1001)
    assert conf.count("EXPORT {") == 2
    assert 'Path = "/exports/1";' in conf and 'Path = "/exports/2";' in conf and 'Pseudo = "/b";' in conf
    assert "/srv" not in conf  # the server's root shows the volumes under /exports only
    assert "Bind_addr = 127.0.0.1;" in conf  # only the guard reaches ganesha
    assert "Protocols = 3;" in conf and "Enable_NLM = false;" in conf and "Enable_UDP = false;" in conf
    assert "Mount_Path_Pseudo = true;" in conf  # the guest never learns the node's paths
    assert conf.count("Squash = Root_Squash;") == 2
    assert "Anonymous_Uid = 1000;" in conf and "Anonymous_Gid = 1001;" in conf
    assert f"NFS_Port = {vs.SERVER_NFS_PORT};" in conf and f"MNT_Port = {vs.SERVER_MOUNT_PORT};" in conf


def test_the_launch_script_confines_ganesha_and_the_guard():
    script = vs.launch_script()
    done = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "pivot_root . old" in script and "umount -l /old" in script
    assert "ln -s ../run var/run" in script  # rpcbind's socket where ganesha looks for it
    assert "mount -t overlay -o ro,nosuid,nodev,lowerdir=/usr:" in script  # a filesystem of its own for /usr
    ganesha = script[script.index("ganesha=$!") - 300:script.index("ganesha=$!")]
    assert "--no-new-privs" in ganesha and "--bounding-set=-all,+dac_read_search,+dac_override,+fowner,+chown,+setuid,+setgid" in ganesha
    assert '"$python" -I -S /fence.py --no-ipv6 \\\n  ganesha.nfsd -F' in ganesha  # seccomp, IPv4 only
    assert "</dev/null >>/log/ganesha.log 2>&1 &" in ganesha  # no fd of the node's disk in ganesha
    guard = script[script.index("setpriv --reuid"):script.index("exec 3<&-")]
    assert "--reuid=65534" in guard and "--bounding-set=-all" in guard and "--no-new-privs" in guard
    assert '"$python" -I -S /fence.py "$python" -I -S /guard.py' in guard
    assert f"--listen {GATEWAY_IP} --nfs {vs.NFS_PORT}:{vs.SERVER_NFS_PORT}" in guard

def test_mount_script_quotes_paths_for_the_guest_shell():
    script = vs.mount_script([("/v1", "/home/user/it's data"), ("/v2", "/mnt/x;reboot")])
    lines = script.splitlines()
    assert lines[0] == "set -e"
    mkdirs = [shlex.split(line) for line in lines if line.startswith("mkdir")]
    assert mkdirs == [["mkdir", "-p", "/home/user/it's data"], ["mkdir", "-p", "/mnt/x;reboot"]]
    mounts = [shlex.split(line) for line in lines if line.startswith("mount")]
    assert [m[-2:] for m in mounts] == [[f"{GATEWAY_IP}:/v1", "/home/user/it's data"],
                                        [f"{GATEWAY_IP}:/v2", "/mnt/x;reboot"]]
    assert all(m[:4] == ["mount", "-i", "-t", "nfs"] and "vers=3" in m[5] and "nolock" in m[5] for m in mounts)
    done = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_ports_open_to_the_guest_only_and_on_the_gateway_only():
    rules = vs.open_ports_script().splitlines()
    assert len(rules) == 2
    for rule in rules:
        assert 'iifname "tap0"' in rule and f"ip daddr {GATEWAY_IP}" in rule
        assert f"tcp dport {{ {vs.NFS_PORT}, {vs.MOUNT_PORT} }} accept" in rule
    assert f"ip saddr {GUEST_IP}" in rules[0]
