"""Runs under e2b==2.45.1 in its own venv (see scripts/test.sh); prints one JSON line."""
import json
from importlib.metadata import version

from e2b import CommandExitException, Sandbox

sbx = Sandbox.create(metadata={"gen": "2.45"})
result = {"version": version("e2b")}
result["stdout"] = sbx.commands.run("echo hello from 2.45").stdout
sbx.files.write("/home/user/old.txt", "hi")
result["read"] = sbx.files.read("/home/user/old.txt")
result["listed"] = "old.txt" in [e.name for e in sbx.files.list("/home/user")]
try:
    sbx.commands.run("exit 3")
    result["exit_code"] = 0
except CommandExitException as exc:
    result["exit_code"] = exc.exit_code
result["killed"] = sbx.kill()
result["running_after_kill"] = sbx.is_running()
print(json.dumps(result))
