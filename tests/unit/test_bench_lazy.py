"""bench/lazy.py's pure parts, without VMs: the chunkfs stats it reads (bytes from the store,
deltas, the cache watcher's summary), a snapshot's size from its manifests, the shaped store
link's commands (addresses, tc on both ends) and the report's verdicts."""
import io
import json

import pytest

from bench import lazy_report, lazy_stats
from harness.shaped_link import INSIDE, ShapedLink, parse_rate, tbf


def _stats(fetched=0, store=None, evictions=0, size=0, limit=100, peer=None):
    s = {"cache": {"hits": 1, "misses": 2, "evictions": evictions, "fetched_bytes": fetched, "corrupt": 0,
                   "size_bytes": size, "limit_bytes": limit}, "mounts": {}}
    if store is not None:
        s["fetches"] = {"store_bytes": store, "store_chunks": 1, "peer_listen": "", **(peer or {})}
    return s


def test_store_bytes_prefers_the_store_sources_own_count():
    assert lazy_stats.store_bytes(None) == 0
    assert lazy_stats.store_bytes(_stats(fetched=500)) == 500  # an older daemon: all the cache fetched
    assert lazy_stats.store_bytes(_stats(fetched=500, store=300)) == 300  # the rest came from peers / own files


def test_delta_of_two_stats_and_a_daemon_not_yet_running():
    d = lazy_stats.delta(None, _stats(fetched=10, store=8, evictions=2, peer={"peer_bytes": 2}))
    assert d["store_bytes"] == 8 and d["fetched_bytes"] == 10 and d["evictions"] == 2
    assert d["fetches.peer_bytes"] == 2 and "fetches.peer_listen" not in d  # numbers only
    d = lazy_stats.delta(_stats(fetched=10, store=8), _stats(fetched=25, store=20, evictions=1))
    assert (d["store_bytes"], d["fetched_bytes"], d["evictions"], d["misses"]) == (12, 15, 1, 0)


def test_mount_figures_leave_out_the_recorded_order():
    s = _stats()
    s["mounts"]["snap"] = {"fetched_bytes": 7, "recorded": [["memory", 0]], "prefetch": {"queued": 0}}
    assert lazy_stats.mount_figures(s, "snap") == {"fetched_bytes": 7, "prefetch": {"queued": 0}}
    assert lazy_stats.mount_figures(s, "other") == {} == lazy_stats.mount_figures(None, "snap")


def _sample(size, limit=100, evictions=0, pinned=0):
    return {"t": 0, "size_bytes": size, "limit_bytes": limit, "evictions": evictions, "pinned_bytes": pinned,
            "entries": 1}


def test_watch_summary_finds_the_largest_size_and_a_broken_bound():
    ok = lazy_stats.summarize_watch([_sample(10, evictions=3), _sample(100, evictions=5), _sample(40, evictions=9)])
    assert ok["max_size_bytes"] == 100 and ok["limit_bytes"] == 100 and ok["over_bound"] is False
    assert ok["evictions"] == 6 and ok["final_size_bytes"] == 40 and ok["samples"] == 3
    bad = lazy_stats.summarize_watch([_sample(10), _sample(101), _sample(102)], unreachable=2)
    assert bad["over_bound"] is True and bad["samples_over_bound"] == 2 and bad["unreachable_polls"] == 2
    assert lazy_stats.summarize_watch([], 4) == {"samples": 0, "unreachable_polls": 4}


class _S3:
    def __init__(self, objects):
        self.objects = objects
        self.asked = []

    def get_object(self, Bucket, Key):  # noqa: N803 - boto3's names
        self.asked.append((Bucket, Key))
        return {"Body": io.BytesIO(json.dumps(self.objects[Key]).encode())}


def test_stored_size_counts_own_files_and_the_image_files_it_runs_on():
    s3 = _S3({"p/snapshots/s1/manifest.json": {
                  "files": {"memory": {"chunks": [[0, 4, "a"], [8, 2, "b"]]}, "disk.qcow2": {"chunks": [[0, 3, "c"]]}},
                  "image_files": {"rootfs": {"digest": "d1"}, "kernel": {"digest": "d2"}}},
              "p/images/d1.json": {"chunks": [[0, 100, "x"], [200, 50, "y"]]},
              "p/images/d2.json": {"chunks": [[0, 7, "z"]]}})
    size = lazy_stats.stored_size(s3, "bkt", "p", "s1")
    assert size["own"] == {"memory": 6, "disk.qcow2": 3} and size["own_bytes"] == 9
    assert size["images"] == {"rootfs": 150, "kernel": 7} and size["image_bytes"] == 157
    assert size["total_bytes"] == 166 and all(b == "bkt" for b, _ in s3.asked)


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("500mbit", 5 * 10**8), ("100mbps", 8 * 10**8),
                                       ("64kbit", 64000), ("2.5Gbit", 25 * 10**8)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "1 tbit", "-1gbit", "100bit"])
def test_parse_rate_refuses_what_tc_would_not_mean(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_tbf_burst_is_two_milliseconds_but_never_under_a_gso_packet():
    cmd = tbf("veth0", 10**9)
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "veth0", "root", "tbf"]
    assert cmd[cmd.index("rate") + 1] == "1000000000bit" and cmd[cmd.index("burst") + 1] == "250000"
    assert tbf("veth0", 10**7)[tbf("veth0", 10**7).index("burst") + 1] == str(128 * 1024)


def test_shaped_link_commands_stay_on_its_own_namespace_and_addresses():
    link = ShapedLink("10.26.0.0/30", rate="1gbit", name="aenvst42")
    assert (link.host_ip, link.inside_ip) == ("10.26.0.1", "10.26.0.2")
    cmds = link.commands()
    assert cmds[0] == ["ip", "netns", "add", "aenvst42"]
    assert ["ip", "addr", "add", "10.26.0.1/30", "dev", "aenvst42"] in cmds
    assert ["ip", "netns", "exec", "aenvst42", "ip", "addr", "add", "10.26.0.2/30", "dev", INSIDE] in cmds
    shaped = [c for c in cmds if "tbf" in c]
    assert shaped == [tbf("aenvst42", 10**9), ["ip", "netns", "exec", "aenvst42", *tbf(INSIDE, 10**9)]]
    for c in cmds:  # every device named is the link's own
        if "dev" in c:
            assert c[c.index("dev") + 1] in ("aenvst42", INSIDE)
    assert not [c for c in ShapedLink("10.26.0.0/30", name="aenvst42").commands() if "tc" in c]


@pytest.mark.parametrize("cidr,name", [("10.26.0.0/29", "aenvst1"), ("fd00::/126", "aenvst1"),
                                       ("10.26.0.0/30", "a-very-long-link-name"), ("10.26.0.0/30", "Bad")])
def test_shaped_link_refuses_a_range_or_name_it_cannot_use(cidr, name):
    with pytest.raises(ValueError):
        ShapedLink(cidr, name=name)


def _run(**parts):
    return {"store": "loopback", **parts}


def test_headline_verdicts():
    size = {"total_bytes": 1100 << 20, "own_bytes": 300 << 20, "image_bytes": 800 << 20, "own": {}, "images": {}}
    template = {"template": {"name": "t", "size": size}, "runs": 3, "new_node_ms": {"p50": 900.0},
                "builder_ms": {"p50": 500.0}, "new_node_ratio_p50": 1.8, "target_ratio": 1.5,
                "new_node_fetched_bytes_p50": 200 << 20, "new_node_fetched_pct_p50": 18.2,
                "cold_node_ms": {"p50": 700.0}, "cold_node_ratio_p50": 1.4}
    resume = {"runs": 3, "warm_rows": [{"image": size}], "node_b_base_disk": True, "warm_answer_ms": {"p50": 800.0},
              "target_ms": 1000, "warm_fetched_pct_p50": 12.5, "target_pct": 10, "warm_fetched_pct_of_lacked_p50": 40.0,
              "cold_answer_ms": {"p50": 1800.0}, "cold_fetched_pct_p50": 9.5}
    cache = {"cache_mb": 1024, "rows": [{"created": True, "fill_intact": True, "template_mib": 1100}] * 3,
             "watch": {"max_size_bytes": 1000 << 20, "limit_bytes": 1 << 30, "samples": 9, "evictions": 4},
             "all_created": True, "bound_kept": True}
    fork = {"per_node_max": 16, "one_node": {"last_answer_ms": 8000, "status": 201},
            "three_nodes": {"status": 400, "message": "count 32 is over the per-node fork limit"},
            "all_answered": False}
    lines = lazy_report.headline({"runs": [_run(template=template, resume=resume, cache=cache, fork=fork),
                                           _run(template={"error": "RuntimeError: boom"})]})
    rows = {line.split(" | ")[0]: line for line in lines[2:]}
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in lines[2:]]
    # template: warm node 1.8× > 1.5: no, cold node 1.4×: yes; resume: warm 800 ms yes, 12.5 % no, cold 1800 ms
    # no, 9.5 % yes; cache: yes; fork refused: no; the failed part: no
    assert verdicts == ["**no**", "", "yes", "", "yes", "**no**", "**no**", "yes", "yes", "**no**", "**no**"]
    assert "900 ms / 500 ms (1.8×)" in lines[2] and "200 MiB (18.2 % of the template)" in lines[3]
    assert any("refused: 400" in line for line in rows.values())
    assert "failed: RuntimeError: boom" in lines[-1]
    fork_ok = {**fork, "three_nodes": {"status": 201, "last_answer_ms": 11000, "answered": 32, "per_node": {}},
               "ratio": 1.38, "all_answered": True}
    assert lazy_report.fork_rows(fork_ok)[0][3] == "yes"
    assert lazy_report.fork_rows({**fork_ok, "all_answered": False})[0][3] == "**no**"


def test_bytes_fetched_are_judged_on_the_wire_when_the_daemon_counts_them():
    """Chunk objects are stored compressed: the ≤ 10 % target is judged on what crossed the
    wire (``fetches.store_wire_bytes``) when the daemon counts it, else on the plain bytes."""
    assert lazy_stats.wire_pct({"fetches.store_wire_bytes": 55 << 20}, 1100 << 20) == 5.0
    assert lazy_stats.wire_pct({"store_bytes": 5}, 1100 << 20) is None
    assert lazy_stats.wire_pct({"fetches.store_wire_bytes": 5}, 0) is None
    size = {"total_bytes": 1100 << 20}
    resume = {"runs": 3, "warm_rows": [{"image": size}], "node_b_base_disk": True, "warm_answer_ms": {"p50": 800.0},
              "target_ms": 1000, "warm_fetched_pct_p50": 14.0, "warm_wire_pct_p50": 6.0, "target_pct": 10,
              "cold_answer_ms": {"p50": 900.0}, "cold_fetched_pct_p50": 14.0, "cold_wire_pct_p50": 11.0}
    rows = lazy_report.resume_rows(resume)
    assert rows[1][1] == "14.0 % (on the wire, compressed: 6.0 %)" and rows[1][3] == "yes"
    assert rows[3][3] == "**no**"  # 11 % on the wire


def test_settle_waits_until_the_daemon_fetches_nothing(monkeypatch):
    seen = iter([0, 10, 20, 20, 20, 20, 20, 20, 20, 20, 20])
    monkeypatch.setattr(lazy_stats, "daemon_stats", lambda home: _stats(store=next(seen)))
    monkeypatch.setattr(lazy_stats.time, "sleep", lambda s: None)
    clock = iter(range(0, 1000))
    monkeypatch.setattr(lazy_stats.time, "monotonic", lambda: next(clock) * 0.25)
    out = lazy_stats.settle("/nowhere", quiet_s=1.0, timeout_s=30)
    assert out["fetched_bytes"] == 20 and out["waited_s"] < 5
    monkeypatch.setattr(lazy_stats, "daemon_stats", lambda home: None)  # no daemon: quiet at once
    assert lazy_stats.settle("/nowhere", quiet_s=1.0)["fetched_bytes"] == 0
