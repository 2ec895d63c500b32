"""Placement: only alive, non-draining nodes with room; least loaded first."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from nodes.models import Node
from nodes.placement import NoNodeAvailable, place
from sandboxes.models import Sandbox, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_async_orm_connections():
    """The async ORM runs on asgiref's shared thread; close its connection after each
    test, as Django's request cycle would, so PostgreSQL can drop the test database."""
    yield
    await sync_to_async(connections.close_all)()


def make_node(node_id, *, vcpus=8, memory=4096, age_s=0, draining=False, heartbeat=True):
    return Node.objects.create(
        id=node_id, address="127.0.0.1", vcpu_capacity=vcpus, memory_mb_capacity=memory, draining=draining,
        last_heartbeat_at=(timezone.now() - timedelta(seconds=age_s)) if heartbeat else None,
    )


def add_sandbox(node, *, cpu=2, mem=512, state="running"):
    team, _ = Team.objects.get_or_create(slug="t", defaults={"name": "t"})
    tpl, _ = Template.objects.get_or_create(id="base")
    return Sandbox.objects.create(team=team, template=tpl, node=node, state=state, cpu_count=cpu,
                                  memory_mb=mem, end_at=timezone.now() + timedelta(minutes=5))


async def test_no_nodes_raises():
    with pytest.raises(NoNodeAvailable):
        await place(2, 512)


async def test_dead_draining_and_never_seen_nodes_are_skipped():
    await sync_to_async(make_node)("dead", age_s=3600)
    await sync_to_async(make_node)("drain", draining=True)
    await sync_to_async(make_node)("never", heartbeat=False)
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)
    await sync_to_async(make_node)("alive")
    assert (await place(1, 128)).id == "alive"


async def test_capacity_counts_reserving_sandboxes_only():
    node = await sync_to_async(make_node)("n1", vcpus=4, memory=2048)
    await sync_to_async(add_sandbox)(node, cpu=2, mem=1024, state="running")
    await sync_to_async(add_sandbox)(node, cpu=2, mem=512, state="creating")
    # paused and killed sandboxes hold nothing
    await sync_to_async(add_sandbox)(node, cpu=4, mem=2048, state="paused")
    await sync_to_async(add_sandbox)(node, cpu=4, mem=2048, state="killed")
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)  # 4/4 vCPU reserved
    await sync_to_async(Sandbox.objects.filter(state="creating").update)(state="error")
    assert (await place(2, 512)).id == "n1"
    with pytest.raises(NoNodeAvailable):
        await place(2, 1024 + 1)  # memory: 1024 reserved of 2048


async def test_least_loaded_first():
    busy = await sync_to_async(make_node)("a-busy", vcpus=8, memory=8192)
    await sync_to_async(make_node)("b-idle", vcpus=8, memory=8192)
    await sync_to_async(add_sandbox)(busy, cpu=4, mem=1024)
    assert (await place(2, 512)).id == "b-idle"
    # a node too small for the request is skipped even if idle
    await sync_to_async(Node.objects.filter(pk="b-idle").update)(vcpu_capacity=1)
    assert (await place(2, 512)).id == "a-busy"


async def test_on_a_given_node_it_or_nothing():
    """A fork lands on its parent's node: that node when it fits, else a reason, never another."""
    busy = await sync_to_async(make_node)("a-busy", vcpus=4)
    await sync_to_async(make_node)("b-idle", vcpus=64)
    await sync_to_async(add_sandbox)(busy, cpu=2)
    assert (await place(2, 512, on=busy)).id == "a-busy"
    with pytest.raises(NoNodeAvailable, match="node a-busy has no room for 4 vCPU"):
        await place(4, 512, on=busy)
    gone = await sync_to_async(make_node)("c-gone", age_s=3600)
    with pytest.raises(NoNodeAvailable, match="node c-gone is not available"):
        await place(1, 128, on=gone)


async def test_prefer_a_node_then_anywhere():
    """A restore any node can fetch prefers the snapshot's node (no download), else the
    least loaded that fits."""
    await sync_to_async(make_node)("own", vcpus=4)
    await sync_to_async(make_node)("other", vcpus=64)
    assert (await place(2, 512, prefer={"own"})).id == "own"
    assert (await place(8, 512, prefer={"own"})).id == "other"
    await sync_to_async(make_node)("drain", draining=True)
    assert (await place(1, 128, prefer={"drain"})).id != "drain"


async def test_locality_comes_before_the_policy():
    """Of the preferred nodes (those with the files) the policy picks among themselves —
    here the least loaded — even when a node without the files is emptier."""
    a = await sync_to_async(make_node)("has-a", vcpus=64)
    b = await sync_to_async(make_node)("has-b", vcpus=64)
    await sync_to_async(make_node)("empty", vcpus=64)
    await sync_to_async(add_sandbox)(a, cpu=8, mem=2048)
    await sync_to_async(add_sandbox)(b, cpu=4, mem=1024)
    assert (await place(2, 512, prefer={"has-a", "has-b"})).id == "has-b"
    assert (await place(2, 512)).id == "empty"


async def test_a_restore_prefers_every_node_that_cached_the_snapshot(settings):
    """``lifecycle.sources.restore_node`` on a shared store: the snapshot's own node is gone,
    a node whose heartbeat listed the snapshot among its files gets the restore, not the
    emptier node that would have to download it."""
    from lifecycle import sources  # noqa: PLC0415
    from snapshots.models import Snapshot  # noqa: PLC0415

    settings.AENV_SNAPSHOT_BACKEND = "s3"
    gone = await sync_to_async(make_node)("taker", age_s=3600)
    cached = await sync_to_async(make_node)("cacher", vcpus=64)
    await sync_to_async(make_node)("fresh", vcpus=64)
    await sync_to_async(add_sandbox)(cached, cpu=8, mem=1024)
    team = await Team.objects.acreate(name="loc", slug="loc")
    tpl, _ = await Template.objects.aget_or_create(id="base")
    snap = await Snapshot.objects.acreate(id="snap-loc", team=team, template=tpl, node=gone, state="ready",
                                          cpu_count=2, memory_mb=512)
    assert await sources.holders(snap) == {"taker"}
    assert (await sources.restore_node(snap)).id == "fresh"
    await Node.objects.filter(pk="cacher").aupdate(snapshots_here=["other", "snap-loc"])
    assert await sources.holders(snap) == {"taker", "cacher"}
    assert (await sources.restore_node(snap)).id == "cacher"


def test_placements_racing_for_the_last_room_never_overcommit_a_node():
    """30 placements at once, each from its own thread and database connection, on a node with
    room for 10: exactly 10 get it (the placement transaction holds the node's lock), the
    rest get NoNodeAvailable, and the node's reservations never exceed its capacity."""
    import threading  # noqa: PLC0415

    from nodes.placement import place_sync  # noqa: PLC0415

    node = make_node("race", vcpus=20, memory=100_000)
    barrier = threading.Barrier(30)
    won, lost, errors = [], [], []

    def one(i: int) -> None:
        try:
            barrier.wait(10)
            place_sync(2, 512, on_id=node.pk, claim=lambda n: add_sandbox(n, cpu=2, mem=512, state="creating"))
            won.append(i)
        except NoNodeAvailable:
            lost.append(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(won) == 10 and len(lost) == 20
    assert Sandbox.objects.filter(node=node).count() == 10
    assert Node.objects.get(pk="race").placements == 10  # a placement that found no room left no trace


def test_a_request_that_cannot_fit_is_refused_without_waiting_for_the_placement_lock():
    """Issue 27: while one placement holds the node rows (its claim blocks here), a request
    that fits nowhere even without the lock is refused at once instead of queueing behind it;
    one that may fit waits for the lock and is decided there."""
    import threading  # noqa: PLC0415

    from nodes.placement import place_sync  # noqa: PLC0415

    from harness.polling import until  # noqa: PLC0415

    node = make_node("held", vcpus=6, memory=100_000)
    add_sandbox(node, cpu=4, mem=512)  # room for 2 vCPUs left
    inside, release, outcomes = threading.Event(), threading.Event(), {}

    def blocking_claim(n) -> None:
        inside.set()
        release.wait(60)

    def run(name: str, cpu: int, claim=None) -> None:
        try:
            place_sync(cpu, 512, claim=claim)
            outcomes[name] = "placed"
        except NoNodeAvailable as exc:
            outcomes[name] = f"refused: {exc}"
        finally:
            connections.close_all()

    holder = threading.Thread(target=run, args=("holder", 2, blocking_claim))
    holder.start()
    try:
        assert inside.wait(30), "the holder never got the placement lock"
        too_big = threading.Thread(target=run, args=("too_big", 4))
        too_big.start()
        until(lambda: "too_big" in outcomes, "the refusal, while the lock is held", deadline=30)
        assert outcomes["too_big"].startswith("refused: no node has room for 4 vCPU") and "holder" not in outcomes
    finally:
        release.set()
        holder.join(60)
    assert outcomes["holder"] == "placed"


async def test_a_claim_that_fails_leaves_no_reservation():
    node = await sync_to_async(make_node)("n-claim", vcpus=4, memory=4096)

    def claim(placed):
        add_sandbox(placed, cpu=2, mem=512, state="creating")
        raise RuntimeError("the caller's object went away")

    with pytest.raises(RuntimeError):
        await place(2, 512, claim=claim)
    assert not await Sandbox.objects.filter(node=node).aexists()


async def test_pack_fills_the_busiest_node_that_fits(settings):
    settings.AENV_PLACEMENT = "pack"
    busy = await sync_to_async(make_node)("busy", vcpus=8, memory=8192)
    await sync_to_async(make_node)("idle", vcpus=8, memory=8192)
    await sync_to_async(add_sandbox)(busy, cpu=4, mem=1024)
    assert (await place(2, 512)).id == "busy"
    await sync_to_async(add_sandbox)(busy, cpu=4, mem=1024)  # now full
    assert (await place(2, 512)).id == "idle"
    settings.AENV_PLACEMENT = "spread"
    assert (await place(2, 512)).id == "idle"


def test_racing_creates_spread_over_the_nodes():
    """30 placements at once on 3 empty nodes, each from its own thread and connection: each
    chooses under the nodes' locks with the others' reservations in view, so they spread
    evenly, not all onto the node every racer saw as the least loaded."""
    import threading  # noqa: PLC0415

    from nodes.placement import place_sync  # noqa: PLC0415

    for i in range(3):
        make_node(f"s{i}", vcpus=64, memory=64_000)
    barrier = threading.Barrier(30)
    errors = []

    def one() -> None:
        try:
            barrier.wait(10)
            place_sync(2, 512, claim=lambda n: add_sandbox(n, cpu=2, mem=512, state="creating"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    counts = sorted(Sandbox.objects.filter(node_id=f"s{i}").count() for i in range(3))
    assert sum(counts) == 30 and counts[-1] - counts[0] <= 2, counts


def test_the_prepared_reservations_query_answers_as_the_queryset():
    """``reserved_on`` (its SQL built once per number of nodes) gives the rows, fields and
    reservations ``with_reservations`` gives, for other ids and other counts of nodes too."""
    from nodes.placement import reserved_on, with_reservations
    from template_builds.models import TemplateBuild

    a, b, c = make_node("a"), make_node("b", vcpus=16), make_node("c", memory=8192)
    add_sandbox(a, cpu=2, mem=512)
    add_sandbox(a, cpu=1, mem=256, state="creating")
    add_sandbox(b, cpu=4, mem=1024, state="killed")  # holds nothing
    add_sandbox(b, cpu=3, mem=768, state="resuming")
    TemplateBuild.objects.create(template=Template.objects.get(id="base"), status="building", node_id="c",
                                 cpu_count=2, memory_mb=1024)
    fields = [f.attname for f in Node._meta.concrete_fields] + ["cpu_reserved", "memory_reserved"]

    def rows(nodes):
        return sorted([getattr(n, f) for f in fields] for n in nodes)

    for ids in (["a"], ["b"], ["a", "b"], ["b", "c"], ["a", "b", "c"], ["c"]):
        assert rows(reserved_on(ids)) == rows(with_reservations(Node.objects.filter(pk__in=ids))), ids
    reserved = {n.pk: (n.cpu_reserved, n.memory_reserved) for n in reserved_on(["a", "b", "c"])}
    assert reserved == {"a": (3, 768), "b": (3, 768), "c": (2, 1024)}
    assert reserved_on([]) == []


def test_the_prepared_alive_ids_answer_as_the_queryset(settings):
    """``alive_ids`` (its SQL built once per join rule and lock) lists the ids ``_alive()``
    lists, in id order, at each call's own cutoff: not a silent, stopped, draining or revoked
    node, nor (with AENV_NODE_JOIN_REQUIRED) one that never joined; and a placement counts."""
    from nodes.placement import _alive, _count_placement, alive_ids
    from django.db import transaction

    now = timezone.now()
    make_node("b"), make_node("a"), make_node("joined")
    Node.objects.filter(pk="joined").update(credential_hash="x")
    make_node("silent")
    Node.objects.filter(pk="silent").update(last_heartbeat_at=now - timedelta(hours=1))
    for name, change in [("stopped", {"stopped_at": now}), ("draining", {"draining": True}),
                         ("revoked", {"revoked_at": now})]:
        make_node(name)
        Node.objects.filter(pk=name).update(**change)

    def orm():
        return list(_alive().order_by("pk").values_list("pk", flat=True))

    for required in (False, True, False):
        settings.AENV_NODE_JOIN_REQUIRED = required
        assert alive_ids() == orm() == (["joined"] if required else ["a", "b", "joined"])
        with transaction.atomic():
            assert alive_ids(locked=True) == orm()
    Node.objects.filter(pk="b").update(last_heartbeat_at=now - timedelta(hours=1))  # went silent since
    assert alive_ids() == orm() == ["a", "joined"]
    before = Node.objects.get(pk="a").placements
    assert _count_placement(pk="a") == 1 and _count_placement(pk="nope") == 0
    assert Node.objects.get(pk="a").placements == before + 1 and Node.objects.get(pk="b").placements == 0
