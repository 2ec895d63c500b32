"""The node's pool of network slots on real namespaces: warm slots are handed out and
refilled, a released slot is gone, a restarted node keeps the slots its VMs use and removes
the rest, and closing leaves nothing but the slots in use."""
import subprocess
import time

import pytest

from vmm.net import host_table, slots
from vmm.net.slot_pool import SlotPool

pytestmark = pytest.mark.skipif(not slots.netns_supported(),
                                reason="needs root, nft (Debian nftables) and nsenter to make network namespaces")


@pytest.fixture
def prefix(slot_prefix):
    return slot_prefix


def _wait(cond, seconds=20):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _table(prefix) -> str:
    return subprocess.run(["nft", "list", "table", "inet", host_table.table_name(prefix)],
                          capture_output=True, text=True, check=True).stdout


def test_warm_slots_are_handed_out_refilled_and_released(prefix):
    pool = SlotPool(prefix, warm=2)
    pool.adopt(set())
    pool.start()
    try:
        assert _wait(lambda: pool.ready() == 2)
        a = pool.acquire()
        assert pool.in_use() == {a.index}
        assert _wait(lambda: pool.ready() == 2)  # refilled behind the handover
        b = pool.acquire()
        assert a != b and pool.in_use() == {a.index, b.index}
        assert a.host_veth in _table(prefix) and b.host_veth in _table(prefix)
        forwarding = subprocess.run(["sysctl", "-n", f"net.ipv4.conf.{a.host_veth}.forwarding"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        assert forwarding == "1"
        pool.release(a)  # destroyed by the background thread
        assert pool.settle()
        assert a not in slots.list_slots(prefix) and a.host_veth not in _table(prefix)
        assert pool.in_use() == {b.index}
    finally:
        pool.close()
    assert [s.index for s in slots.list_slots(prefix)] == [b.index]  # only the one in use is left
    pool.release(b)
    assert slots.list_slots(prefix) == []


def test_an_empty_pool_still_hands_out_a_slot(prefix):
    pool = SlotPool(prefix, warm=0)
    pool.adopt(set())
    slot = pool.acquire()
    assert slot in slots.list_slots(prefix) and slot.host_veth in _table(prefix)
    pool.release(slot)


def test_concurrent_acquires_on_an_empty_pool_get_distinct_slots_and_leave_no_zombie(prefix):
    """Creates and fork children take slots on several threads at once: each makes its own
    (nothing warm) and they must not race for one index (the loser's failed netns create left
    a zombie child in the node, ~20 a minute in a soak)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from tests.unit.test_vmm_slots import zombie_children  # noqa: PLC0415

    pool = SlotPool(prefix, warm=0)
    pool.adopt(set())
    before = zombie_children()
    with ThreadPoolExecutor(6) as threads:
        got = list(threads.map(lambda _: pool.acquire(), range(6)))
    try:
        assert len({s.index for s in got}) == 6
        assert zombie_children() == before
    finally:
        for slot in got:
            pool.release(slot)
    assert slots.list_slots(prefix) == []


def test_released_slots_do_not_pile_up_behind_a_busy_background_thread(prefix, monkeypatch):
    """A background thread that cannot keep up (here: never gets to them) holds at most
    DYING_MAX released slots; the releases past that destroy their own."""
    from vmm.net import slot_pool  # noqa: PLC0415

    monkeypatch.setattr(slot_pool, "DYING_MAX", 2)
    pool = SlotPool(prefix, warm=0)
    pool.adopt(set())
    got = [pool.acquire() for _ in range(4)]
    stuck = slot_pool.threading.Event()
    pool._thread = slot_pool.threading.Thread(target=stuck.wait, daemon=True)  # alive, never destroys
    pool._thread.start()
    try:
        for slot in got:
            pool.release(slot)
        assert len(pool._dying) == 2
        assert [s.index for s in slots.list_slots(prefix)] == sorted(s.index for s in got[:2])
    finally:
        stuck.set()
        pool._thread.join()
        for slot in list(pool._dying):
            pool._destroy(slot)
    assert slots.list_slots(prefix) == []


def test_a_restarted_node_keeps_what_its_vms_use(prefix):
    used, spare, claimed = (slots.create(slots.Slot(prefix, i)) for i in (1, 2, 3))
    pool = SlotPool(prefix, warm=0)
    removed = pool.adopt({used.index})
    assert sorted(s.index for s in removed) == [spare.index, claimed.index]
    assert slots.list_slots(prefix) == [used]
    assert used.host_veth in _table(prefix) and pool.in_use() == {used.index}
    fresh = pool.acquire()
    assert fresh.index not in (used.index,)  # never one in use
    pool.release(fresh)
    pool.release(used)
    assert slots.list_slots(prefix) == []


def test_a_released_address_is_not_handed_out_again_at_once(prefix):
    """Indexes rotate: a client still holding a connection to a released slot's address
    must not reach the next sandbox there."""
    pool = SlotPool(prefix, warm=0)
    pool.adopt(set())
    first = pool.acquire()
    pool.release(first)
    second = pool.acquire()
    third = pool.acquire()
    try:
        assert first.index not in (second.index, third.index)
        assert second.address != first.address and third.index > second.index
    finally:
        pool.release(second)
        pool.release(third)
    assert slots.list_slots(prefix) == []
