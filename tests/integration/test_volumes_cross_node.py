"""A volume is one store for every node of a cluster (docs/volumes.md#where-the-files-live): a
sandbox on node A and a sandbox on node B (a second node worker beside the session's stack, with
a home, images and network of its own and the stack's AENV_VOLUMES_DIR, as every machine of a
cluster mounts the shared store) mount the same volume through their own nodes' servers and see
each other's closed files — a new file and an append to an existing one, both ways — as does
the content API. The volume has a size limit (its own filesystem, mounted once on the machine
both nodes share)."""
from __future__ import annotations

import uuid

import pytest
from e2b import Sandbox, Volume

from harness.second_node import SecondNode, short_root  # noqa: F401 - a fixture

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def run(sbx, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout.strip()


def _drain(stack, node_id: str, draining: bool) -> None:
    stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{node_id}').update(draining={draining})")


def _node_of(stack, sandbox_id: str) -> str:
    return stack.db(f"from sandboxes.models import Sandbox as S; print(S.objects.get(pk='{sandbox_id}').node_id)").strip()


def test_a_volume_written_on_one_node_is_read_on_another(stack, sdk_env, short_root, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", stack.api_url)
    node_b = SecondNode(stack, short_root, extra_env={"AENV_VOLUMES_DIR": str(stack.home / "volumes")})
    vol = Volume.create(f"xnode-{uuid.uuid4().hex[:8]}")
    vol.write_file("/notes.txt", "from the content API\n")
    on_a = on_b = None
    try:
        _drain(stack, node_b.id, True)
        on_a = Sandbox.create(volume_mounts={"/mnt/v": vol}, timeout=600)
        _drain(stack, node_b.id, False)
        _drain(stack, stack.node_id, True)
        on_b = Sandbox.create(volume_mounts={"/mnt/v": vol}, timeout=600)
        _drain(stack, stack.node_id, False)
        assert (_node_of(stack, on_a.sandbox_id), _node_of(stack, on_b.sandbox_id)) == (stack.node_id, node_b.id)
        assert (stack.home / "volume-servers" / on_a.sandbox_id).is_dir()  # each node serves its own guest
        assert (node_b.home / "volume-servers" / on_b.sandbox_id).is_dir()

        run(on_a, "echo written on node A > /mnt/v/a.txt; echo appended on A >> /mnt/v/notes.txt")
        assert run(on_b, "cat /mnt/v/a.txt") == "written on node A"
        assert run(on_b, "cat /mnt/v/notes.txt") == "from the content API\nappended on A"
        run(on_b, "echo appended on B >> /mnt/v/a.txt")
        assert run(on_a, "cat /mnt/v/a.txt") == "written on node A\nappended on B"
        assert vol.read_file("/a.txt") == "written on node A\nappended on B\n"
    finally:
        _drain(stack, node_b.id, False)
        _drain(stack, stack.node_id, False)
        for sbx in (on_a, on_b):
            if sbx is not None:
                sbx.kill()
        node_b.stop()
    # a worker that stopped cleanly leaves placement at once (the next test must not be placed there)
    assert stack.db(f"from nodes.models import Node; print(Node.objects.get(pk='{node_b.id}').stopped_at is not None)"
                    ).strip() == "True"
    assert Volume.destroy(vol.volume_id) is True
