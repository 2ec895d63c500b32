"""Celery tasks that run on a node worker (queue ``node.<id>``) and drive its VMs.

Exceptions propagate unchanged: with the JSON result serializer Celery stores their
class name and args, which the control plane turns into NodeTaskFailed(kind, message).
"""
import logging
import time
from datetime import datetime, timezone

import httpx
from celery import shared_task

from nodes.driver import get_driver

log = logging.getLogger(__name__)

ENVD_INIT_TIMEOUT = 10.0


class EnvdInitFailed(Exception):
    """envd in the fresh VM refused or did not answer POST /init."""


def _init_envd(host: str, port: int, env_vars: dict, access_token: str | None) -> None:
    import base64  # noqa: PLC0415
    import os  # noqa: PLC0415

    body = {
        "envVars": env_vars or {},
        "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        "defaultUser": "user",
        "defaultWorkdir": "/home/user",
        # Fresh kernel entropy for every (re)start: restored and forked guests share RNG state.
        "entropySeed": base64.b64encode(os.urandom(64)).decode(),
    }
    headers = {}
    if access_token is not None:
        body["accessToken"] = access_token
        # A re-init (after a resume) reaches an envd that already requires the token.
        headers["X-Access-Token"] = access_token
    try:
        resp = httpx.post(f"http://{host}:{port}/init", json=body, headers=headers, timeout=ENVD_INIT_TIMEOUT)
    except httpx.HTTPError as exc:
        raise EnvdInitFailed(f"envd /init at {host}:{port} failed: {exc!r}") from None
    if not resp.is_success:
        raise EnvdInitFailed(f"envd /init at {host}:{port} answered {resp.status_code}: {resp.text[:200]}")


def _round(timings: dict | None) -> dict:
    return {k: round(float(v), 2) for k, v in (timings or {}).items()}


def _init_envd_or_undo(info, env_vars: dict, access_token: str | None, *, undo, what: str) -> None:
    """Initialises a freshly started VM's envd; if that fails, `undo(sandbox_id)` puts
    the VM back in a consistent state (killed after a boot, paused after a resume)."""
    try:
        _init_envd(info.envd_host, info.envd_port, env_vars, access_token)
    except BaseException:
        log.warning("envd init failed for %s; %s", info.sandbox_id, what)
        try:
            undo(info.sandbox_id)
        except Exception:
            log.exception("could not undo %s after a failed init", info.sandbox_id)
        raise


def _envd_result(info, timings: dict) -> dict:
    return {"envd_host": info.envd_host, "envd_port": info.envd_port, "pid": info.pid,
            "accel": info.accel, "timings": timings}


@shared_task(name="nodes.boot_sandbox")
def boot_sandbox(*, sandbox_id: str, image: str, cpu_count: int, memory_mb: int, disk_size_mb: int,
                 env_vars: dict, access_token: str | None) -> dict:
    from vmm.driver import BootSpec

    driver = get_driver()
    spec = BootSpec(sandbox_id=sandbox_id, image=image, cpu_count=cpu_count,
                    memory_mb=memory_mb, disk_size_mb=disk_size_mb)
    info = driver.boot(spec)
    started = time.perf_counter()
    _init_envd_or_undo(info, env_vars, access_token, undo=driver.kill, what="killing its VM")
    timings = _round(info.timings)
    timings["init"] = round((time.perf_counter() - started) * 1000, 2)
    return _envd_result(info, timings)


@shared_task(name="nodes.kill_sandbox")
def kill_sandbox(*, sandbox_id: str) -> dict:
    return {"killed": bool(get_driver().kill(sandbox_id))}


@shared_task(name="nodes.pause_sandbox")
def pause_sandbox(*, sandbox_id: str, to_disk: bool = True) -> dict:
    """Pauses the VM: to disk (device state saved, QEMU process stopped, RAM file kept)
    or in memory (vCPUs frozen, process kept). Returns {"to_disk", "timings"}."""
    driver = get_driver()
    started = time.perf_counter()
    timings = driver.pause_to_disk(sandbox_id) if to_disk else driver.pause(sandbox_id)
    timings = _round(timings)
    timings["total_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return {"to_disk": bool(to_disk), "timings": timings}


@shared_task(name="nodes.resume_sandbox")
def resume_sandbox(*, sandbox_id: str, env_vars: dict, access_token: str | None) -> dict:
    """Resumes a paused VM, then re-inits envd (fresh timestamp: the guest clock stood
    still while paused). If /init fails the VM is paused to disk again, so the sandbox
    stays consistently paused. Returns envd host/port, pid and timings like boot."""
    driver = get_driver()
    started = time.perf_counter()
    info = driver.resume(sandbox_id)
    t_resumed = time.perf_counter()
    _init_envd_or_undo(info, env_vars, access_token, undo=driver.pause_to_disk, what="pausing it again")
    timings = _round(info.timings)
    timings["resume_ms"] = round((t_resumed - started) * 1000, 2)
    timings["init"] = round((time.perf_counter() - t_resumed) * 1000, 2)
    return _envd_result(info, timings)
