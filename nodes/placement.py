"""Placement: which node gets a new sandbox (created, restored or forked) or a template
build.

Room is computed from the database (capacity minus what the node's live sandboxes and
running template builds reserve), not from the node's heartbeat. A placement is a
*claim*: in one transaction that holds the candidate nodes' row locks it chooses with
fresh reservations and writes the reservation itself (the caller's ``claim``: the sandbox
rows' node, the build's node; ``Node.placements`` counts them), so racing placements are
serialized — on PostgreSQL by the row locks, on SQLite by its write lock — and never
over-commit a node.
"""
import math
import random
from collections.abc import Callable, Iterable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import router, transaction
from django.db.models import F, IntegerField, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce

from nodes import join
from nodes.models import Node, alive_q, heartbeat_cutoff
from sandboxes.prepared import PreparedQuery, PreparedUpdate
from sandboxes.states import RESERVING
from template_builds.models import BuildStatus, TemplateBuild


class NoNodeAvailable(Exception):
    """No alive, non-draining, non-revoked node has room for the requested resources."""


def _building(field: str) -> Subquery:
    """What the template builds running on the outer node reserve (their build VMs)."""
    builds = (TemplateBuild.objects.filter(node=OuterRef("pk"), status=BuildStatus.BUILDING)
              .order_by().values("node").annotate(total=Sum(field)).values("total"))
    return Coalesce(Subquery(builds, output_field=IntegerField()), 0)


def with_reservations(nodes):
    """``nodes`` (a Node queryset) annotated with what placement counts as reserved on
    each: ``cpu_reserved`` (vCPUs) and ``memory_reserved`` (MiB) of its live sandboxes (a
    row's ``reserved_*`` where set, else its shape) and running template builds. Public for
    the nodes API, the dashboard and Prometheus, which show the same figures."""
    live = Q(sandboxes__state__in=RESERVING)
    cpu = Coalesce("sandboxes__reserved_vcpus", "sandboxes__cpu_count")
    memory = Coalesce("sandboxes__reserved_memory_mb", "sandboxes__memory_mb")
    return nodes.annotate(
        cpu_reserved=Coalesce(Sum(cpu, filter=live), 0) + _building("cpu_count"),
        memory_reserved=Coalesce(Sum(memory, filter=live), 0) + _building("memory_mb"),
    )


# with_reservations' rows over N given nodes, per number of nodes (sandboxes.prepared).
_PREPARED: dict[int, PreparedQuery] = {}


def reserved_on(ids: list[str]) -> list[Node]:
    """``with_reservations(Node.objects.filter(pk__in=ids))``'s rows, its SQL built once per
    database and number of nodes and run with these ids. Why: Django building that query
    (the aggregate, its filter, the builds' subqueries, the grouping) cost ~3 ms of CPU a
    placement, running it ~0.1 ms (issue 26: create and resume place every time). The SQL
    is the ORM's own, so it is exactly what the queryset would run; the rows are built as
    the queryset builds them (``sandboxes.prepared.PreparedQuery``)."""
    if not ids:
        return []
    prepared = _PREPARED.get(len(ids))
    if prepared is None:
        names = [f"node{i}" for i in range(len(ids))]
        prepared = _PREPARED.setdefault(len(ids), PreparedQuery(
            lambda **marks: with_reservations(Node.objects.filter(pk__in=[marks[n] for n in names])),
            **{name: Node._meta.pk for name in names}))
    return prepared.rows(router.db_for_read(Node), **{f"node{i}": pk for i, pk in enumerate(ids)})


def fork_child_charge(cpu_count: int, memory_mb: int) -> tuple[int, int]:
    """(vCPUs, MiB) placement reserves for one fork child of a ``cpu_count`` / ``memory_mb``
    parent while it shares the parent's memory copy-on-write: ``AENV_FORK_CHILD_MEMORY_MB``
    (at most its shape) and its vCPUs over ``AENV_FORK_VCPU_OVERCOMMIT``, rounded up. Why
    not the whole shape: a child's guest RAM is the parent's pages until it writes them
    (measured: docs/benchmarks.md, lifecycle table), so N children cost far less than N new VMs. Its
    first resume reserves the whole shape again (its memory is then its own)."""
    vcpus = max(1, math.ceil(cpu_count / float(settings.AENV_FORK_VCPU_OVERCOMMIT)))
    return min(cpu_count, vcpus), min(memory_mb, int(settings.AENV_FORK_CHILD_MEMORY_MB))


def _alive(cutoff=None):
    return join.usable(Node.objects.filter(alive_q(cutoff=cutoff), draining=False))


# The ids of the nodes that may take work, in id order (locked: their rows locked for the
# placement's transaction), per AENV_NODE_JOIN_REQUIRED; and a node's placement count. Their
# SQL compiled once (sandboxes.prepared; issue 26: compiling cost more than running them, on
# every create and resume).
_ALIVE_IDS: dict[tuple, PreparedQuery] = {}
_count_placement = PreparedUpdate(lambda pk: (Node.objects.filter(pk=pk), {"placements": F("placements") + 1}),
                                  pk=Node._meta.pk)


def alive_ids(locked: bool = False) -> list[str]:
    """``_alive()``'s ids in id order (``select_for_update`` when ``locked``)."""
    key = (bool(settings.AENV_NODE_JOIN_REQUIRED), locked)
    prepared = _ALIVE_IDS.get(key)
    if prepared is None:
        def make(cutoff, locked=locked):
            nodes = _alive(cutoff)
            return (nodes.select_for_update() if locked else nodes).order_by("pk").values_list("pk", flat=True)
        prepared = _ALIVE_IDS.setdefault(key, PreparedQuery(make, cutoff=Node._meta.get_field("last_heartbeat_at")))
    db = router.db_for_write(Node) if locked else router.db_for_read(Node)
    return prepared.rows(db, cutoff=heartbeat_cutoff())


def _candidates():
    return with_reservations(_alive())


def _load(node: Node) -> float:
    cpu = node.cpu_reserved / node.vcpu_capacity if node.vcpu_capacity else 1.0
    mem = node.memory_reserved / node.memory_mb_capacity if node.memory_mb_capacity else 1.0
    return max(cpu, mem)


def _fits(node: Node, cpu_count: int, memory_mb: int) -> bool:
    return (node.cpu_reserved + cpu_count <= node.vcpu_capacity
            and node.memory_reserved + memory_mb <= node.memory_mb_capacity)


def _choose(nodes: dict, cpu_count: int, memory_mb: int, on_id: str | None, prefer_ids: Iterable[str]) -> Node:
    """The node among ``nodes`` (id → Node with its reservations) that gets the request, or
    NoNodeAvailable saying why none can."""
    if on_id is not None:
        node = nodes.get(on_id)
        if node is None:
            raise NoNodeAvailable(f"node {on_id} is not available (not alive, draining or revoked)")
        if not _fits(node, cpu_count, memory_mb):
            raise NoNodeAvailable(f"node {on_id} has no room for {cpu_count} vCPU / {memory_mb} MiB")
        return node
    fitting = [n for n in nodes.values() if _fits(n, cpu_count, memory_mb)]
    if not fitting:
        raise NoNodeAvailable(f"no node has room for {cpu_count} vCPU / {memory_mb} MiB")
    preferred, order = set(prefer_ids), _order()
    return min(fitting, key=lambda n: (n.pk not in preferred, order(n)))


def place_sync(cpu_count: int, memory_mb: int, on_id: str | None = None, prefer_ids: Iterable[str] = (),
               claim: Callable | None = None) -> Node:
    """The choice and the claim in one transaction that holds every candidate node's row
    lock (PostgreSQL: ``SELECT … FOR UPDATE`` in id order; SQLite: its immediate write
    transaction), so racing placements are serialized, each sees the others' reservations,
    and none over-commits a node or herds onto the node they all saw as least loaded.

    Admission is looked at first without the lock: what does not fit even in the committed
    reservations of a moment ago is refused at once. Why: under load most requests to a full
    cluster are refusals, and each queued on the node rows behind every other placement (issue
    27's load run: 4 of 4.6 busy database sessions waiting on that lock, refusals taking 1-4 s,
    the admitted creates' scheduling as long). A refusal so decided is one a placement a moment
    earlier would have made; a request that may fit still takes the lock and is decided there."""
    ids = alive_ids()
    _choose({n.pk: n for n in reserved_on(ids)}, cpu_count, memory_mb, on_id, prefer_ids)
    with transaction.atomic():
        locked = alive_ids(locked=True)
        node = _choose({n.pk: n for n in reserved_on(locked)}, cpu_count, memory_mb, on_id, prefer_ids)
        _count_placement(pk=node.pk)
        if claim is not None:
            claim(node)
        return node


async def place(cpu_count: int, memory_mb: int, *, on: Node | None = None, prefer: Iterable[str] = (),
                claim: Callable[[Node], None] | None = None) -> Node:
    """The one placement decision, for anything that needs room on a node: a create or a
    template build (the least loaded alive node that fits), a fork that fits on its parent's node
    (``on`` it; ``place_fork`` spreads a larger one), a restore (``on`` the snapshot's node when only it has the files; ``prefer``
    the nodes that have them, own or cached, when any node can fetch them: locality first,
    then the policy among those), a resume (``on`` its node, else anywhere if it can move).
    ``claim(node)`` (sync, in the placement's transaction) writes the reservation;
    without one the answer is only advice. Raises NoNodeAvailable saying why; what
    ``claim`` raises propagates, and nothing of the placement stays."""
    return await sync_to_async(place_sync)(cpu_count, memory_mb, on.pk if on is not None else None,
                                           frozenset(prefer), claim)


def _room(node: Node, cpu_count: int, memory_mb: int, per_node: int) -> int:
    """How many more units of ``cpu_count`` / ``memory_mb`` fit on ``node``, at most ``per_node``."""
    fits = [per_node]
    if cpu_count > 0:
        fits.append((node.vcpu_capacity - node.cpu_reserved) // cpu_count)
    if memory_mb > 0:
        fits.append((node.memory_mb_capacity - node.memory_reserved) // memory_mb)
    return max(0, min(fits))


def place_fork_sync(cpu_count: int, memory_mb: int, count: int, home_id: str, *, per_node: int,
                    spill: bool = False, claim: Callable | None = None) -> list[tuple[Node, int]]:
    """``count`` fork children of ``cpu_count`` / ``memory_mb`` each (a fork child's charge),
    at most ``per_node`` on any node, in one claim like ``place_sync``'s. They go to the parent's
    node ``home_id`` (no upload: they share its capture) as far as it has room; with ``spill``
    the rest go one at a time to the other nodes in the policy's order (``spread``: each to the
    least loaded that fits, so they even out; ``pack``: the most loaded first). Returns
    ``[(node, n)]``, the parent's node first (``n`` may be 0 there). ``claim(allotment)`` writes
    the reservation. Raises NoNodeAvailable when they do not all fit (nothing is reserved)."""
    with transaction.atomic():
        locked = alive_ids(locked=True)
        nodes = {n.pk: n for n in reserved_on(locked)}
        home = nodes.get(home_id)
        if home is None:
            raise NoNodeAvailable(f"node {home_id} is not available (not alive, draining or revoked)")
        at_home = min(count, _room(home, cpu_count, memory_mb, per_node))
        allotted = {home.pk: at_home}
        left = count - at_home
        if left and not spill:
            raise NoNodeAvailable(f"node {home_id} has no room for {count} (room for {at_home}; at most {per_node} "
                                  f"a node, {cpu_count} vCPU / {memory_mb} MiB each)")
        others = [n for n in nodes.values() if n.pk != home.pk]
        order = _order()
        while left:
            fitting = [n for n in others if allotted.get(n.pk, 0) < per_node and _fits(n, cpu_count, memory_mb)]
            if not fitting:
                placed = count - left
                raise NoNodeAvailable(f"no room in the cluster for {count} (room for {placed}, {at_home} of them on "
                                      f"node {home_id}; at most {per_node} a node, {cpu_count} vCPU / {memory_mb} "
                                      "MiB each)")
            node = min(fitting, key=order)
            node.cpu_reserved += cpu_count
            node.memory_reserved += memory_mb
            allotted[node.pk] = allotted.get(node.pk, 0) + 1
            left -= 1
        allotment = [(home, at_home)] + [(n, allotted[n.pk]) for n in sorted(others, key=lambda n: n.pk)
                                         if allotted.get(n.pk)]
        Node.objects.filter(pk__in=[n.pk for n, k in allotment if k]).update(placements=F("placements") + 1)
        if claim is not None:
            claim(allotment)
        return allotment


async def place_fork(cpu_count: int, memory_mb: int, count: int, *, home: Node, per_node: int, spill: bool = False,
                     claim: Callable[[list], None] | None = None) -> list[tuple[Node, int]]:
    """``place_fork_sync`` for the async lifecycle: where a fork's children go."""
    return await sync_to_async(place_fork_sync)(cpu_count, memory_mb, count, home.pk, per_node=per_node,
                                                spill=spill, claim=claim)


def _order():
    """``AENV_PLACEMENT``: ``spread`` (default) takes the least loaded node, ``pack`` the most
    loaded one that fits (fewer nodes busy, the others free for big sandboxes); equally
    loaded ones in a random order."""
    tie = {}

    def jitter(n: Node) -> float:
        return tie.setdefault(n.pk, random.random())

    if settings.AENV_PLACEMENT == "pack":
        return lambda n: (-_load(n), jitter(n))
    return lambda n: (_load(n), jitter(n))
