"""The sweeper's liveness file (run_lifecycle --heartbeat): touched after every sweep that
reached the database and never after one that failed, so the Kubernetes liveness probe
(deploy/docker/entrypoint.sh health sweeper) restarts a sweeper that no longer sweeps."""
import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from lifecycle import expiry

ENTRYPOINT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "entrypoint.sh"


@pytest.mark.django_db(transaction=True)
async def test_heartbeat_follows_sweeps_that_went_through(monkeypatch):
    beats: list[float] = []
    stop = asyncio.Event()
    loop = asyncio.create_task(expiry.Sweeper().run(0.01, stop, lambda: beats.append(time.monotonic())))
    for _ in range(200):
        if len(beats) >= 3:
            break
        await asyncio.sleep(0.01)
    assert len(beats) >= 3
    # A sweep that fails (the database is gone) is not a heartbeat.
    async def broken(*_args, **_kwargs):
        raise RuntimeError("database unreachable")
    monkeypatch.setattr(expiry.Sweeper, "tick", broken)
    await asyncio.sleep(0.05)
    seen = len(beats)
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert len(beats) == seen


def _health(tmp_path: Path, what: str = "sweeper") -> subprocess.CompletedProcess:
    """entrypoint.sh health sweeper|routes|events against a heartbeat file in tmp_path (a copy of the
    script whose SWEEPER_/ROUTES_HEARTBEAT points there; the check needs nothing of the checkout)."""
    variable = {"sweeper": "SWEEPER_HEARTBEAT=/tmp/aenv-sweeper.alive", "routes": "ROUTES_HEARTBEAT=/tmp/aenv-routes.alive",
                "events": "EVENTS_HEARTBEAT=/tmp/aenv-events.alive"}[what]
    script = ENTRYPOINT.read_text()
    assert script.count(variable + "\n") == 1
    copy = tmp_path / "deploy" / "docker" / "entrypoint.sh"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(script.replace(variable, f"{variable.split('=')[0]}={tmp_path}/alive"))
    return subprocess.run(["bash", str(copy), "health", what], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("what, done", [("sweeper", "the sweeper's last sweep"),
                                        ("routes", "the route syncer's last pass"),
                                        ("events", "the events worker's last broker check")])
def test_health_wants_a_fresh_heartbeat(tmp_path, what, done):
    assert f"{done} has not happened yet" in _health(tmp_path, what).stderr
    alive = tmp_path / "alive"
    alive.touch()
    assert _health(tmp_path, what).returncode == 0
    old = time.time() - 600
    os.utime(alive, (old, old))
    stale = _health(tmp_path, what)
    assert stale.returncode != 0 and re.search(rf"{re.escape(done)} was 6[0-9][0-9] s ago", stale.stderr)
