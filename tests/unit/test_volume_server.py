"""``vmm.net.volume_server``'s pure parts: the ganesha configuration (NFSv3 over TCP only, no
locks, only the given exports, guest root squashed), the guest's mount script (its paths
quoted for the shell) and the slot rules that open the NFS ports to the guest only."""
import shlex
import subprocess

from vmm.net import volume_server as vs
from vmm.net.slots import GATEWAY_IP, GUEST_IP


def test_config_exports_only_the_given_volumes_v3_tcp():
    conf = vs.config([vs.Export(1, "/srv/v/a", "/a"), vs.Export(2, "/srv/v/b", "/b")], 1000, 1001)
    assert conf.count("EXPORT {") == 2
    assert 'Path = "/srv/v/a";' in conf and 'Pseudo = "/b";' in conf
    assert "Protocols = 3;" in conf and "Enable_NLM = false;" in conf and "Enable_UDP = false;" in conf
    assert "Mount_Path_Pseudo = true;" in conf  # the guest never learns the node's paths
    assert conf.count("Squash = Root_Squash;") == 2
    assert "Anonymous_Uid = 1000;" in conf and "Anonymous_Gid = 1001;" in conf
    assert f"NFS_Port = {vs.NFS_PORT};" in conf and f"MNT_Port = {vs.MOUNT_PORT};" in conf


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
