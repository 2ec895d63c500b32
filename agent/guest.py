"""What the node tells a guest's envd after (re)starting its VM, through the one envd
client (``envd_client``): ``/init`` (env vars, a fresh clock and entropy, the sandbox's
token) and, for a VM started from another sandbox's memory, the token handoff.

Why here: the boot, resume, restore and fork tasks and the reconcile of an interrupted
pause all send exactly this, and a failure must read the same everywhere."""
from __future__ import annotations

from envd_client import EnvdClient, EnvdError

ENVD_INIT_TIMEOUT = 10.0


class EnvdInitFailed(Exception):
    """envd in the fresh VM refused or did not answer POST /init."""


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
