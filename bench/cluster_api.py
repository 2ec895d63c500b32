"""The E2B API calls bench/cluster.py times, with plain httpx: a create that reports its
status instead of raising (a 503 from admission is a result here, not an error), pause,
connect, kill; a burst of creates from many concurrent clients; and the bookkeeping that
kills whatever a part made, whatever happened."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from bench.create_kill import parse_server_timing

CREATE_TIMEOUT_S = 900  # client side: a create queued behind dozens on two emulated cores is slow, not lost
SANDBOX_TTL_S = 3600  # long enough for any part; every sandbox is killed at its end anyway


@dataclass
class Answer:
    status: int
    ms: float
    body: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    error: str = ""  # the API's message for a non-2xx, or the client's exception
    at_s: float = 0.0  # in a burst: when it answered, seconds after the release

    @property
    def sandbox_id(self) -> str:
        return self.body.get("sandboxID", "")


def _answer(resp: httpx.Response, t0: float) -> Answer:
    ms = (time.perf_counter() - t0) * 1e3
    try:
        body = resp.json() if resp.content else {}
    except ValueError:
        body = {"raw": resp.text[:300]}
    body = body if isinstance(body, dict) else {"list": body}
    error = "" if resp.status_code < 300 else str(body.get("message") or body)[:300]
    return Answer(resp.status_code, ms, body, parse_server_timing(resp.headers.get("server-timing", "")), error)


def create_body(template: str, tag: str) -> dict:
    return {"templateID": template, "timeout": SANDBOX_TTL_S, "metadata": {"bench": "cluster", "part": tag}}


class Api:
    """One team's view of an API (a stack or a cluster); remembers every sandbox it made,
    so ``kill_all`` leaves nothing running."""

    def __init__(self, api_url: str, key: str, admin_token: str = ""):
        self.url, self.headers = api_url.rstrip("/"), {"X-API-Key": key}
        # GET /nodes shows placement's figures to operators only (AENV_ADMIN_TOKEN)
        self.admin_headers = {"X-Admin-Token": admin_token} if admin_token else {}
        self.client = httpx.Client(trust_env=False, headers=self.headers)  # no HTTP(S)_PROXY detour
        self.live: set[str] = set()

    def create(self, template: str = "base", tag: str = "") -> Answer:
        t0 = time.perf_counter()
        a = _answer(self.client.post(f"{self.url}/v2/sandboxes", json=create_body(template, tag),
                                     timeout=CREATE_TIMEOUT_S), t0)
        if a.status == 201:
            self.live.add(a.sandbox_id)
        return a

    def call(self, method: str, path: str, expect: int, **kw) -> Answer:
        """A lifecycle call that must succeed (pause, connect): RuntimeError otherwise."""
        t0 = time.perf_counter()
        a = _answer(self.client.request(method, f"{self.url}{path}", timeout=600, **kw), t0)
        if a.status != expect:
            raise RuntimeError(f"{method} {path}: {a.status} {a.error}")
        return a

    def pause(self, sid: str) -> Answer:
        return self.call("POST", f"/sandboxes/{sid}/pause", 204, json={})

    def connect(self, sid: str) -> Answer:
        """Resumes a paused sandbox (201) through E2B's connect."""
        return self.call("POST", f"/sandboxes/{sid}/connect", 201, json={"timeout": SANDBOX_TTL_S})

    def kill(self, sid: str) -> None:
        resp = self.client.delete(f"{self.url}/sandboxes/{sid}", timeout=300)
        if resp.status_code not in (204, 404):
            raise RuntimeError(f"kill {sid}: {resp.status_code} {resp.text[:300]}")
        self.live.discard(sid)

    def adopt(self, ids) -> None:
        """Sandboxes made elsewhere (the burst's clients) that this one must kill."""
        self.live.update(i for i in ids if i)

    def kill_all(self, workers: int = 8) -> list[str]:
        """Kills every sandbox still alive, a few at a time; the failures, as messages."""
        failures = []

        def one(sid: str) -> None:
            try:
                self.kill(sid)
            except Exception as exc:  # noqa: BLE001 - reported; the stack's teardown follows
                failures.append(f"{sid}: {exc}")

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, sorted(self.live)))
        return failures

    def close(self) -> None:
        self.client.close()


def create_burst(api_url: str, key: str, creates: int, clients: int, template: str = "base") -> dict:
    """``creates`` creates from ``clients`` concurrent httpx clients (each its own connection,
    taking the next create as soon as its previous one answered), all released at once.
    Returns every answer (status, latency, Server-Timing, sandbox id or the API's message)
    and the wall time from the release to the last answer."""

    async def run() -> dict:
        left = list(range(creates))
        answers: list[Answer] = []
        start = asyncio.Event()
        released = [0.0]

        async def client() -> None:
            async with httpx.AsyncClient(trust_env=False, headers={"X-API-Key": key}, timeout=CREATE_TIMEOUT_S,
                                         limits=httpx.Limits(max_connections=1)) as http:
                await start.wait()
                while left:
                    left.pop()
                    t0 = time.perf_counter()
                    try:
                        resp = await http.post(f"{api_url}/v2/sandboxes", json=create_body(template, "burst"))
                        a = _answer(resp, t0)
                    except httpx.HTTPError as exc:
                        a = Answer(0, (time.perf_counter() - t0) * 1e3, error=f"{type(exc).__name__}: {exc}"[:300])
                    a.at_s = time.perf_counter() - released[0]
                    answers.append(a)

        tasks = [asyncio.create_task(client()) for _ in range(min(clients, creates))]
        await asyncio.sleep(0.5)  # every client made before the release
        released[0] = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
        return {"answers": answers, "wall_s": time.perf_counter() - released[0],
                "last_created_s": max((a.at_s for a in answers if a.status == 201), default=0.0)}

    return asyncio.run(run())
