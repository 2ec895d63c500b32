"""The sandbox-wide env vars (the ``envs`` of the create call, and the template's), asked
from envd's ``GET /envs`` on the guest (spec e2b-code-interpreter.md §3.4).

Why ask envd: the kernels were started when the template was built, before any sandbox
existed, so they cannot have inherited a sandbox's variables; envd has them (``/init``).
No envd (the server run on a host, in tests): no variables, never an error."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

ENVD_URL = os.environ.get("AENV_CI_ENVD_URL", "http://127.0.0.1:49983")
TIMEOUT = 5.0


def _fetch(url: str, access_token: str | None) -> dict:
    request = urllib.request.Request(f"{url}/envs", headers={"X-Access-Token": access_token} if access_token else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            data = json.loads(response.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.info("no sandbox env vars from envd at %s: %s", url, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


async def sandbox_env(access_token: str | None = None, url: str | None = None) -> dict:
    return await asyncio.to_thread(_fetch, url or ENVD_URL, access_token)
