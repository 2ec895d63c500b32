"""Peer fetch on a node (agent.chunk_peers): the deployment's token, who the peers are (the
database's live nodes that advertise a chunkPeerPort), the refresh that hands them to the
chunkfs daemon, the switch (off: a daemon left serving by an earlier start is turned off),
and, with a real daemon, LazyRestores telling it its peers and the figures the heartbeat and
/metrics carry."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import override_settings
from django.utils import timezone

from agent import chunk_peers
from agent.chunk_peers import ChunkPeers, live_peers, peer_token, start_chunk_peers
from agent.prometheus import NodeCollector
from agent.stores.lazy import LazyRestores, cache_figures
from chunkfs.client import ChunkfsClient, ChunkfsError
from nodes.models import Node
from tests.unit.test_lazy_restore import _committed, _ram, _store, short_tmp  # noqa: F401 - fixtures
from tests.unit.test_snapshot_store_s3 import BUCKET, s3, s3_endpoint  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "p" * 64


def test_the_token_is_derived_from_the_secret_key_under_its_own_label():
    token = peer_token("a-deployment-secret")
    assert len(token) == 64 and int(token, 16) >= 0
    assert token == peer_token("a-deployment-secret") != peer_token("another-deployment")
    assert "a-deployment-secret" not in token
    from nodes.sealed import _INFO  # noqa: PLC0415 - the task-sealing key is another derivation

    assert chunk_peers._INFO != _INFO
    with pytest.raises(ValueError):
        peer_token("")


@pytest.mark.django_db
def test_peers_are_the_other_live_nodes_that_serve_their_chunks():
    now = timezone.now()
    stale = now - timedelta(seconds=300)

    def node(pk, address, port, seen=now, **kw):
        Node.objects.create(id=pk, address=address, last_heartbeat_at=seen,
                            host={} if port is None else {"chunkPeerPort": port}, **kw)

    node("me", "10.0.0.1", 9465)
    node("b", "10.0.0.2", 9465)
    node("c", "fd00::3", 9470)
    node("off", "10.0.0.4", None)  # peer fetch off there
    node("dead", "10.0.0.5", 9465, seen=stale)
    node("revoked", "10.0.0.6", 9465, revoked_at=now)
    node("odd", "10.0.0.7", "9465")  # not a port
    node("bool", "10.0.0.8", True)
    assert live_peers("me") == ["10.0.0.2:9465", "[fd00::3]:9470"]
    assert live_peers("b") == ["10.0.0.1:9465", "[fd00::3]:9470"]


class FakeLazy:
    def __init__(self, listen="10.0.0.1:9465", fail=False):
        self.calls, self.listen, self.fail = [], listen, fail
        self.requests = []

    def set_peers(self, listen, token, peers, start=True):
        self.calls.append((listen, token, peers))
        if self.fail:
            raise ChunkfsError("not_started", "no daemon")
        return self.listen

    def running_client(self):
        lazy = self

        class Client:
            def request(self, payload):
                lazy.requests.append(payload)
                return {"listen": "", "peers": 0}

        return Client()


@pytest.mark.django_db
def test_a_round_hands_the_daemon_its_peers_and_learns_its_port():
    Node.objects.create(id="b", address="10.0.0.2", last_heartbeat_at=timezone.now(), host={"chunkPeerPort": 9465})
    lazy = FakeLazy()
    peers = ChunkPeers("me", lazy, "10.0.0.1", 9465, TOKEN)
    assert peers.port is None
    peers.round()
    assert lazy.calls == [("10.0.0.1:9465", TOKEN, ["10.0.0.2:9465"])] and peers.port == 9465
    lazy.fail = True
    peers.round()  # logged (once), tried again next round
    assert peers.port is None  # the heartbeat stops advertising a port nobody serves
    lazy.fail = False
    peers.round()
    assert peers.port == 9465


@pytest.mark.django_db
def test_the_switch(caplog):
    class Store:
        lazy = FakeLazy()

    with override_settings(AENV_CHUNK_PEER_FETCH=False):
        assert start_chunk_peers("me", Store()) is None
    assert Store.lazy.requests == [{"op": "peers"}]  # a daemon an earlier start left serving: off
    with override_settings(AENV_CHUNK_PEER_FETCH=True):
        assert start_chunk_peers("me", object()) is None  # posix_fs: no chunk cache to share
        assert "no chunk cache to share" in caplog.text
        with override_settings(AENV_NODE_ADDRESS="127.0.0.1", AENV_CHUNK_PEER_PORT=9999, SECRET_KEY="k" * 50):
            started = start_chunk_peers("me", Store())
    try:
        assert started.listen == "127.0.0.1:9999" and started.token == peer_token("k" * 50)
        deadline = time.monotonic() + 10
        while not Store.lazy.calls:  # the first round runs at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        started.stop()


@pytest.fixture
def lazy_home():
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("chunkfs needs /dev/fuse and fusermount3 (the fuse3 package; scripts/setup.sh)")
    home = ROOT / "var" / "test-runs" / f"cp-{uuid.uuid4().hex[:6]}"  # unix socket paths stay short
    home.mkdir(parents=True)
    yield home
    control = home / "chunkfs" / "control.sock"
    try:
        pid = ChunkfsClient(control, timeout=2).ping()["pid"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and \
                Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.05)
    except ChunkfsError:
        pass
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.xdist_group("chunkfs")
def test_lazy_restores_tell_their_daemon_its_peers_and_report_the_figures(lazy_home):
    lazy = LazyRestores(lazy_home, limit_mb=16, files_in_use=lambda: [],
                        daemon_env={"AENV_S3_BUCKET": "b", "AENV_S3_ENDPOINT": "http://127.0.0.1:9",
                                    "AENV_S3_REGION": "us-east-1",  # credentials of its own: not the
                                    "AWS_ACCESS_KEY_ID": "test",  # ones another test left (or not)
                                    "AWS_SECRET_ACCESS_KEY": "test"})
    assert lazy.running_client() is None
    assert lazy.set_peers("", "", [], start=False) == ""  # no daemon: nothing started to turn off
    assert lazy.running_client() is None
    listen = lazy.set_peers("127.0.0.1:0", TOKEN, ["10.255.255.1:9465"])  # starts the daemon
    assert listen.startswith("127.0.0.1:") and not listen.endswith(":0")
    stats = lazy.cache_stats()
    assert stats["peers"] == 1 and stats["served_chunks"] == 0 and stats["store_chunks"] == 0
    assert stats["peer_listen"] == listen and "hits" in stats
    figures = cache_figures(stats)
    assert {"peerChunks", "peerBytes", "storeChunks", "storeBytes", "servedChunks", "servedRefused"} <= set(figures)
    names = {m.name for m in NodeCollector("n1", lambda: 0, dict, chunk_cache=lambda: figures).collect()}
    assert {"aenv_node_chunk_cache_peer_bytes", "aenv_node_chunk_cache_store_bytes",
            "aenv_node_chunk_cache_served_bytes"} <= names
    # a restarted daemon gets its peers with the next client() (the first restore after it)
    ChunkfsClient(lazy.control).request({"op": "peers"})
    assert lazy.cache_stats()["peers"] == 0
    lazy.client()
    assert lazy.cache_stats()["peers"] == 1 and lazy.cache_stats()["peer_listen"].startswith("127.0.0.1:")


@pytest.mark.xdist_group("chunkfs")
def test_a_second_nodes_lazy_restore_reads_the_first_nodes_cache_not_the_store(s3, short_tmp):
    """Three nodes on a real S3 API (moto): node 1 commits a snapshot, node 2 restores it lazily
    and reads its memory; then the store loses those chunks, and node 3's lazy restore of the
    same snapshot still reads every byte, from node 2's cache (a wrong token would get none)."""
    ram = _ram(23)
    images, _ = _committed(s3, short_tmp, "pf-a", ram)
    n2, n3 = _store(s3, short_tmp / "n2", images), _store(s3, short_tmp / "n3", images)
    assert (n2.local_dir("pf-a") / "memory.ram").read_bytes() == ram
    client, prefix = s3
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/pf-a/manifest.json")["Body"].read())
    memory = doc["files"]["memory.ram"]["chunks"]
    for _, _, sha in memory:  # only node 2's cache has them now
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{sha}")
    listen2 = n2.lazy.set_peers("127.0.0.1:0", TOKEN, [])
    n3.lazy.set_peers("127.0.0.1:0", TOKEN, [listen2])
    path = n3.local_dir("pf-a")
    assert (path / "memory.ram").read_bytes() == ram
    f2, f3 = n2.chunk_cache_figures(), n3.chunk_cache_figures()
    assert f3["peerChunks"] >= len(memory) and f3["peerBytes"] >= sum(c[1] for c in memory)
    assert f2["servedChunks"] == f3["peerChunks"] and f3["peerErrors"] == f3["peerCorrupt"] == 0
    print(f"\nnode 3: {f3['peerChunks']} chunks ({f3['peerBytes']} bytes) from node 2, {f3['storeChunks']} from the store")


@pytest.mark.xdist_group("chunkfs")
def test_another_deployments_node_gets_nothing_from_the_peers(s3, short_tmp):
    ram = _ram(29)
    images, _ = _committed(s3, short_tmp, "pf-b", ram)
    n2, n3 = _store(s3, short_tmp / "n2", images), _store(s3, short_tmp / "n3", images)
    assert (n2.local_dir("pf-b") / "memory.ram").read_bytes() == ram
    listen2 = n2.lazy.set_peers("127.0.0.1:0", peer_token("deployment-one"), [])
    n3.lazy.set_peers("127.0.0.1:0", peer_token("deployment-two"), [listen2])
    assert (n3.local_dir("pf-b") / "memory.ram").read_bytes() == ram  # from the store
    f2, f3 = n2.chunk_cache_figures(), n3.chunk_cache_figures()
    # refused, so asked no more: only the requests already in flight then (the mount reads its
    # layers' headers at once) were refused too
    assert f3["peerChunks"] == 0 and f3["storeChunks"] > 0 and 1 <= f3["peerErrors"] < f3["storeChunks"]
    assert f2["servedChunks"] == 0 and f2["servedRefused"] == f3["peerErrors"]


@pytest.mark.django_db
@pytest.mark.xdist_group("chunkfs")
def test_a_snapshot_taken_on_one_node_restores_on_another_from_its_files_without_the_store(s3, short_tmp):
    """Node 1 took and committed a snapshot (e.g. a pause image): it has it as files, nothing of
    it in its chunk cache. The store then loses every chunk of it. Node 1's peer-fetch round
    hands its daemon its own files' chunks (the commit indexed the capture), and node 2's lazy
    restore reads every byte of it from node 1's files; a file changed since is not served."""
    from tests.unit.test_snapshot_store_s3 import _capture, _images  # noqa: PLC0415

    ram = _ram(31)
    images = _images(short_tmp)
    src = _capture(short_tmp / "n1", images, "pf-own", ram)
    n1 = _store(s3, short_tmp / "n1", images)
    n1.commit("pf-own")
    own = n1.own_files()
    assert {str(src / n) for n in ("memory.ram", "device.state", "layer-0.qcow2", "layer-1.qcow2")} <= set(own)
    client, prefix = s3
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/pf-own/manifest.json")["Body"].read())
    lost = {sha for f in doc["files"].values() for _, _, sha in f["chunks"]}
    for sha in lost:
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{sha}")
    rounds = ChunkPeers("n1", n1.lazy, "127.0.0.1", 0, TOKEN, own_files=n1.own_files)
    rounds.round()
    assert rounds.port and n1.lazy.cache_stats()["own_chunks"] >= len(lost)
    assert n1.lazy.offer_own(n1.own_files()) is False  # unchanged: not sent again
    n2 = _store(s3, short_tmp / "n2", images)
    n2.lazy.set_peers("127.0.0.1:0", TOKEN, [f"127.0.0.1:{rounds.port}"])
    path = n2.local_dir("pf-own")
    assert (path / "memory.ram").read_bytes() == ram
    assert (path / "device.state").read_bytes() == (src / "device.state").read_bytes()
    for name in ("layer-0.qcow2", "layer-1.qcow2"):  # every chunk of the disk layers reads (headers re-pointed)
        assert len((path / name).read_bytes()) == (src / name).stat().st_size
    f1, f2 = n1.chunk_cache_figures(), n2.chunk_cache_figures()
    own2 = n2.on_disk.locate([c for f in doc["files"].values() for c in f["chunks"]])  # e.g. qcow2 headers
    assert f2["storeChunks"] == 0 and f2["peerChunks"] == len(lost - set(own2)) > 0 and f2["peerCorrupt"] == 0
    assert f1["servedFileChunks"] == f1["servedChunks"] == f2["peerChunks"] and f1["entries"] == 0
    # a capture file changed after its commit indexed it: no longer offered (and were it still,
    # the daemon's digest check would answer 404: test_chunk_peers), so nobody gets its bytes
    n3 = _store(s3, short_tmp / "n3", images)
    n3.lazy.set_peers("127.0.0.1:0", TOKEN, [f"127.0.0.1:{rounds.port}"])
    with open(src / "memory.ram", "r+b") as f:
        f.write(b"\0" * 16)
    rounds.round()  # the index no longer vouches for the file: not offered at all
    assert str(src / "memory.ram") not in n1.own_files()
    with pytest.raises(OSError):
        (n3.local_dir("pf-own") / "memory.ram").read_bytes()  # EIO: neither node 1 nor the store has it
    assert n3.chunk_cache_figures()["peerCorrupt"] == 0
