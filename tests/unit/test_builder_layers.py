"""The node's template layer cache (``agent.builder.layers``): finished entries only,
concurrent writers of one key, crashed leftovers, pins, and LRU eviction that takes an
entry with everything stacked on it and never what a VM uses."""
import os
import time

from agent.builder.layers import LayerCache


def _entry(cache, key, chain_below, size=4096, layer=True):
    slot = cache.slot(key)
    assert slot.cached
    chain = list(chain_below)
    if layer:
        slot.layer_path.write_bytes(b"x" * size)
        chain.append(str(slot.layer_path))
    return slot.commit({"ctx": {"user": "user"}, "chain": chain, "layer": layer})


def test_only_finished_entries_with_their_whole_chain_are_hits(tmp_path):
    cache = LayerCache(tmp_path / "layers")
    base = tmp_path / "rootfs.qcow2"
    base.write_bytes(b"base")
    assert cache.get("k1") is None
    slot = cache.slot("k1")
    slot.layer_path.write_bytes(b"half")
    assert cache.get("k1") is None  # no meta yet: unfinished
    e1 = slot.commit({"chain": [str(base), str(slot.layer_path)], "layer": True, "ctx": {}})
    assert cache.get("k1").chain == e1.chain and cache.get("k1").layer == slot.layer_path
    base.unlink()
    assert cache.get("k1") is None  # its base went: a miss, not a broken boot


def test_a_key_being_written_elsewhere_gets_a_private_slot(tmp_path):
    cache = LayerCache(tmp_path / "layers")
    first = cache.slot("k")
    second = cache.slot("k")  # the first's lock is held
    assert first.cached and not second.cached and second.dir != first.dir
    first.commit({"chain": [], "layer": False, "ctx": {}})
    third = cache.slot("k")  # finished meanwhile: a forced rebuild writes privately too
    assert not third.cached
    cache.remove_private(second)
    assert not second.dir.exists()


def test_gc_removes_what_a_crashed_build_left(tmp_path):
    cache = LayerCache(tmp_path / "layers")
    _entry(cache, "done", [])
    crashed = cache.slot("crashed")
    crashed.layer_path.write_bytes(b"partial")
    crashed.release()  # the process died: its lock is gone
    writing = cache.slot("writing")  # still held by a live build
    private = cache.slot("done")
    assert cache.gc() == 1
    assert not (tmp_path / "layers" / "crashed").exists() and (tmp_path / "layers" / "writing").exists()
    assert cache.get("done") is not None and not private.dir.exists()
    writing.release()


def test_eviction_is_lru_takes_dependents_and_spares_used_and_pinned(tmp_path):
    cache = LayerCache(tmp_path / "layers")
    a = _entry(cache, "a", [])
    b = _entry(cache, "b", a.chain)  # stacked on a
    c = _entry(cache, "c", [])
    d = _entry(cache, "d", [])
    now = time.time()
    for age, e in ((400, a), (300, b), (200, c), (100, d)):
        os.utime(e.dir / "meta.json", (now - age, now - age))
    # a is the oldest, but b (stacked on it) is in use by a VM: neither goes; c is next
    assert cache.evict(1, in_use={str(b.layer)}) == ["c"]
    with cache.pinned([d]):
        assert cache.evict(1, in_use={str(b.layer)}) == []  # d pinned by a running build
    assert sorted(cache.evict(1, in_use=set())) == ["a", "b"]  # a goes with b
    assert cache.get("d") is not None and cache.size_bytes() == d.size_bytes > 0
