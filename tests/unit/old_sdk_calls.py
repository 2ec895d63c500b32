"""Runs under e2b==2.45.1 in its own venv (tests/unit/test_old_sdk_calls.py starts it; no VM):
that generation's Secret, Volume, and create (v1 ``POST /sandboxes``) with network rules and
volume mounts, update_network and get_info. Prints one JSON line; the test judges it."""
import json
from importlib.metadata import version

from e2b import ALL_TRAFFIC, Sandbox, Secret, Volume
from e2b.exceptions import SecretNotFoundException, VolumePathNotFoundException

out = {"version": version("e2b")}

made = Secret.create("old-sdk", "old-value-never-shown", metadata={"gen": "2.45"})
out["secret"] = [made.name, made.version, Secret.update("old-sdk", "v2").version, Secret.exists("OLD-SDK")]
out["secret_listed"] = [s.name for s in Secret.list().next_items()]
out["fill"] = Secret.fill("old-sdk")
out["secret_destroyed"] = [Secret.destroy("old-sdk"), Secret.destroy("old-sdk")]
try:
    Secret.get_info("old-sdk")
except SecretNotFoundException:
    out["secret_gone"] = True

vol = Volume.create("old-sdk-vol")
vol.write_file("/dir/f.txt", "from 2.45", mode=0o640)
out["volume"] = [vol.read_file("/dir/f.txt"), vol.exists("/dir/f.txt"), vol.get_info("/dir/f.txt").mode,
                 sorted(e.path for e in vol.list("/", depth=2)), Volume.connect(vol.volume_id).name,
                 [v.name for v in Volume.list()]]
vol.remove("/dir")
try:
    vol.get_info("/dir")
except VolumePathNotFoundException:
    out["volume_path_gone"] = True

rules = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer " + Secret.fill("tok")}}}]}
sbx = Sandbox.create(network={"allow_out": lambda ctx: list(ctx.rules), "deny_out": [ALL_TRAFFIC], "rules": rules,
                              "allow_public_traffic": False, "mask_request_host": "${PORT}-old.example"},
                     volume_mounts={"/home/user/v": vol}, allow_internet_access=True)
info = sbx.get_info()
out["created"] = {"network": info.network, "volume_mounts": info.volume_mounts,
                  "allow_internet_access": info.allow_internet_access, "traffic_token": bool(sbx.traffic_access_token)}
sbx.update_network({"deny_out": ["8.8.8.8"]})
Sandbox.update_network(sbx.sandbox_id, {"allow_out": ["1.1.1.1"], "allow_internet_access": False})
out["updated"] = Sandbox.get_info(sbx.sandbox_id).network
out["killed"] = sbx.kill()
out["volume_destroyed"] = Volume.destroy(vol.volume_id)
print(json.dumps(out))
