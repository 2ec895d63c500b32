"""What the node tells a guest's envd after (re)starting its VM, through the one envd
client (``envd_client``): ``/init`` (env vars, a fresh clock and entropy, the sandbox's
token) and, for a VM started from another sandbox's memory, the token handoff; and
whether its envd answers at all (asked before a pause).

Why here: the boot, resume, restore and fork tasks and the reconcile of an interrupted
pause all send exactly this, and a failure must read the same everywhere."""
from __future__ import annotations

from envd_client import EnvdClient, EnvdError

ENVD_INIT_TIMEOUT = 10.0
# How long the node waits for a guest agent's /health before a pause, and how many times
# it asks: a guest busy under TCG may miss one short window, a stopped agent misses both.
GUEST_PROBE_TIMEOUT = 2.0
GUEST_PROBE_ATTEMPTS = 2


class EnvdInitFailed(Exception):
    """envd in the fresh VM refused or did not answer POST /init."""


class GuestUnresponsive(Exception):
    """The guest agent (envd) did not answer, and the operation needs it to (a strict or a
    filesystem-only pause); nothing was done to the VM."""


def guest_responds(host: str, port: int) -> bool:
    """Whether envd answers ``GET /health`` within GUEST_PROBE_TIMEOUT, asked up to
    GUEST_PROBE_ATTEMPTS times (E2B's pause checks its guest agent before it snapshots)."""
    timeout = GUEST_PROBE_TIMEOUT
    with EnvdClient.at(host, port, timeout=timeout, connect_timeout=timeout) as envd:
        return any(envd.health(timeout) for _ in range(GUEST_PROBE_ATTEMPTS))


def init_envd(host: str, port: int, env_vars: dict, access_token: str | None) -> None:
    """``/init`` with the env vars, the host's clock, a fresh 64-byte entropy seed and the
    sandbox's token (shown too: a re-init after a resume reaches an envd that requires it)."""
    try:
        with EnvdClient.at(host, port, access_token) as envd:
            envd.init(env_vars or {}, access_token=access_token, timeout=ENVD_INIT_TIMEOUT)
    except EnvdError as exc:
        raise EnvdInitFailed(f"envd /init at {host}:{port} failed: {exc}") from None


def handoff_token(host: str, port: int, source_token: str, access_token: str) -> None:
    """A restored or forked envd still requires its source's token: present it once to
    install the new sandbox's own token."""
    try:
        with EnvdClient.at(host, port, source_token) as envd:
            envd.handoff_token(access_token, timeout=ENVD_INIT_TIMEOUT)
    except EnvdError as exc:
        raise EnvdInitFailed(f"envd token handoff at {host}:{port} failed: {exc}") from None
