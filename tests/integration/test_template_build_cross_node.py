"""A template built on one node starts on another through the S3 store (issue 11): node A
builds it (the image pulled only there), node B — its own home, its own images dir with
nothing but the base image's kernel, initrd and tools drive, its own network instance,
the same database and broker — restores the template snapshot from the bucket (a moto
server) because A is drained: the sandbox has the built files and the start command's
server running. Nothing depends on the two nodes' paths being equal. The build recorded the
template snapshot's prefetch list (issue 24), and node B's first create prefetches it. The two
nodes and the store are the package's shared S3 two-node stack (conftest.s3_two_nodes)."""
from __future__ import annotations

import json
import time
import uuid

import pytest
from e2b import Sandbox, Template, wait_for_port

from chunkfs.client import ChunkfsClient
from harness.moto_s3 import client
from .conftest import S3_TWO_NODES_BUCKET as BUCKET

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]


def test_a_template_built_on_node_a_starts_on_node_b_through_s3(s3_two_nodes, app_image):
    stack = s3_two_nodes
    node_b = stack.node_b
    name = f"xnode-{uuid.uuid4().hex[:6]}"
    template = (Template().from_image(app_image.ref)
                .run_cmd("echo built-on-a > /home/user/where.txt")
                .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000)))
    # node A builds it: node B drains meanwhile (placement would otherwise take the emptier one)
    stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{node_b.id}').update(draining=True)")
    try:
        Template.build(template, name)
    finally:
        stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{node_b.id}').update(draining=False)")
    built_on = stack.db(f"from template_builds.models import TemplateBuild as B; "
                        f"print(B.objects.get(template__alias='{name}', status='ready').node_id)").strip()
    assert built_on == stack.node_id

    def node_of(sbx) -> str:
        return stack.db(f"from sandboxes.models import Sandbox as S; print(S.objects.get(pk='{sbx.sandbox_id}')"
                        ".node_id)").strip()

    try:
        # Locality: both creates restore on A, which has the template snapshot, although after the
        # first one the spread policy alone would send the second to the emptier node B.
        local = [Sandbox.create(name, timeout=120) for _ in range(2)]
        try:
            assert [node_of(s) for s in local] == [stack.node_id, stack.node_id]
        finally:
            for s in local:
                s.kill()
        stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{stack.node_id}').update(draining=True)")
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert node_of(sbx) == node_b.id
            assert sbx.commands.run("cat /home/user/where.txt").stdout.strip() == "built-on-a"
            assert sbx.commands.run(f"cat /srv/app/hello.txt").stdout.strip() == app_image.token
            assert "http.server" in sbx.commands.run("ps -eo args").stdout
            # node B never pulled the image: the snapshot carried its disk
            assert not (node_b.images / "oci").exists()
            snap = stack.db(f"from template_builds.models import TemplateBuild as B; "
                            f"print(B.objects.get(template__alias='{name}', status='ready').snapshot_id)").strip()
            # ...nor downloaded the snapshot: it runs from lazily filled files (AENV_LAZY_RESTORE)
            assert (node_b.home / "lazy" / "snapshots" / snap / "manifest.json").is_file()
            assert not (node_b.home / "cache" / "snapshots").exists() or not list(
                (node_b.home / "cache" / "snapshots").glob("*/manifest.json"))
            # ...and its heartbeat now tells placement that it has the template snapshot too
            # the build recorded what a restore reads first, and this first create here fetched it ahead
            url, prefix = stack.s3
            listed = json.loads(client(url).get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/{snap}/prefetch.json")
                                ["Body"].read())
            order = listed["order"]
            daemon = ChunkfsClient(node_b.home / "chunkfs" / "control.sock")
            mount = daemon.stats(snap)["mounts"][snap]
            names = next(m["files"] for m in daemon.list() if m["mount_id"] == snap)
            result = json.loads(stack.db(f"import json; from template_builds.models import TemplateBuild as B; "
                                         f"print(json.dumps(B.objects.get(template__alias='{name}', "
                                         f"status='ready').result))"))
            print(f"prefetch list: {len(order)} chunks, recorded at the build in "
                  f"{result['timings'].get('prefetch_s')} s; node B's mount: {mount['prefetch']}")
            assert result["prefetch_chunks"] == len(order)  # the build's own recording, not a restore's
            assert mount["recorded"] is None  # replayed, not recorded again
            assert mount["prefetch"]["queued"] == sum(1 for n, _ in order if n in names) > 0
            # ...most of it by the build's prefetch pieces, a GET per piece (chunkfs.pieces)
            fetches = daemon.stats()["fetches"]
            packed = sum(len(p["chunks"]) for p in listed["pieces"])
            print(f"prefetch pieces: {len(listed['pieces'])} holding {packed} chunks; node B: {fetches}")
            assert listed["pieces"] and 0 < fetches["piece_gets"] <= len(listed["pieces"])
            assert fetches["piece_chunks"] > fetches["piece_gets"]
            deadline = time.monotonic() + 30
            while snap not in stack.db(f"from nodes.models import Node; print(Node.objects.get(pk='{node_b.id}')"
                                       ".snapshots_here)"):
                assert time.monotonic() < deadline, "node B's heartbeat never listed the cached snapshot"
                time.sleep(1)
        finally:
            sbx.kill()
    finally:
        stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{stack.node_id}').update(draining=False)")
