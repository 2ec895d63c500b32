"""A sandbox's route — where its envd and guest ports are reached, with the tokens and
team that guard it — as the database has it at the moment of asking.

Why a module of its own: every request the data plane serves reads its sandbox's route
afresh (a pause, resume or kill changes the VM process behind it; ``dataplane.proxy``),
and the checks (``dataplane.access``), the answers (``dataplane.answers``) and the
headers sent upstream (``dataplane.headers``) all judge by it. It is also where the data
plane reads the database: the team of a platform API key, and closing the connections
its executor threads leave behind (``close_unusable``).
"""
import asyncio
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import connections

from envd import ENVD_PORT

from sandboxes.states import ROUTABLE


@dataclass(frozen=True)
class Route:
    """A sandbox's route as the database has it now.

    ``host:port`` is envd (``envd_host:envd_port``); ``guest_host`` reaches every other
    guest TCP port ("" when only envd's port is forwarded: the slirp fallback);
    ``traffic_token`` is E2B's trafficAccessToken ("" = public); ``mask_host`` the
    sandbox's ``network.maskRequestHost`` ("" = forward the client's Host); ``team_id``
    whose sandbox it is (a platform API key of another team finds nothing)."""

    sandbox_id: str
    state: str
    host: str
    port: int | None
    secure: bool
    token: str
    generation: int = 0
    guest_host: str = ""
    traffic_token: str = ""
    mask_host: str = ""
    team_id: str = ""

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE and bool(self.host) and bool(self.port)

    @property
    def upstream(self) -> tuple:
        """What identifies the VM process behind the route (and so its connections)."""
        return self.generation, self.host, self.port, self.guest_host

    def address(self, port: int) -> tuple[str, int] | None:
        """Where guest port ``port`` is reached from here; None if it cannot be."""
        if port == ENVD_PORT:
            return self.host, self.port
        return (self.guest_host, port) if self.guest_host else None


def _mask_host(network) -> str:
    value = network.get("maskRequestHost") if isinstance(network, dict) else None
    return value if isinstance(value, str) else ""


ROUTE_FIELDS = ("id", "state", "envd_host", "envd_port", "secure", "envd_access_token", "vm_generation",
                "guest_host", "traffic_access_token", "network", "team_id")


def _route_of(row) -> Route:
    sandbox_id, state, host, port, secure, token, generation, guest_host, traffic_token, network, team_id = row
    return Route(sandbox_id, state, host or "", port, bool(secure), token or "", generation or 0,
                 guest_host or "", traffic_token or "", _mask_host(network), str(team_id or ""))


def _lookup_sync(sandbox_ids: list[str]) -> dict[str, Route]:
    from sandboxes.models import Sandbox

    try:
        rows = list(Sandbox.objects.filter(pk__in=sandbox_ids).values_list(*ROUTE_FIELDS))
    finally:
        # This runs on executor threads outside Django's request cycle: nothing else
        # would close (or drop a broken) connection.
        close_unusable()
    return {row[0]: _route_of(row) for row in rows}


class RouteTable:
    """The current route of a sandbox, read from the database each time it is asked.

    Concurrent asks share queries: every ``get`` waits for the next query to *start* (one
    query for all sandboxes asked meanwhile), so its answer is never older than the ask,
    yet 64 clients cost one or two queries in flight rather than 64 (each a trip to an
    executor thread and the database: most of the data plane's per-request cost)."""

    def __init__(self):
        self._asked: dict[str, list[asyncio.Future]] = {}
        self._querying: asyncio.Task | None = None

    async def get(self, sandbox_id: str) -> Route | None:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._asked.setdefault(sandbox_id, []).append(answer)
        if self._querying is None or self._querying.done() or self._querying.get_loop() is not loop:
            self._querying = loop.create_task(self._answer_asked())
        return await answer

    async def _answer_asked(self) -> None:
        """Queries for everything asked so far, then for what was asked during that query."""
        while self._asked:
            asked, self._asked = self._asked, {}
            try:
                routes = await self.get_many(list(asked))
            except asyncio.CancelledError:  # the loop is shutting down: so are the askers
                for answer in (a for answers in (*asked.values(), *self._asked.values()) for a in answers):
                    answer.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each asker gets it, as from its own query
                routes, failure = None, exc
            for sandbox_id, answers in asked.items():
                for answer in answers:
                    if answer.done():  # its asker went away
                        continue
                    if routes is None:
                        answer.set_exception(failure)
                    else:
                        answer.set_result(routes.get(sandbox_id))

    async def get_many(self, sandbox_ids: list[str]) -> dict[str, Route]:
        """The routes of those of ``sandbox_ids`` that exist, in one query."""
        return await sync_to_async(_lookup_sync, thread_sensitive=False)(list(sandbox_ids))

    async def key_team(self, raw_key: bytes) -> str | None:
        """The team whose live API key ``raw_key`` is, or None: not one of ours."""
        return await sync_to_async(_key_team_sync, thread_sensitive=False)(raw_key.decode("latin-1").strip())


def _key_team_sync(raw_key: str) -> str | None:
    from sandboxes.models import ApiKey, hash_api_key

    try:
        team_id = (ApiKey.objects.filter(key_hash=hash_api_key(raw_key), revoked_at__isnull=True)
                   .values_list("team_id", flat=True).first())
    finally:
        close_unusable()
    return str(team_id) if team_id else None


def close_unusable() -> None:
    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()

