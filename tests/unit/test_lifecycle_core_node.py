"""A sandbox read for an operation brings its node along (lifecycle.sandboxes.core.visible),
so ``node_of`` answers without a query of its own; a sandbox read elsewhere still gets its
node from the database, and a sandbox without one is Unavailable."""
from unittest import mock

import pytest

from lifecycle.sandboxes import core
from sandboxes.errors import Unavailable
from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


async def test_node_of_a_visible_sandbox_needs_no_query(create, team, node):
    sid = (await create())["sandboxID"]
    sandbox = await core.visible(team, sid)
    with mock.patch.object(core, "Node", side_effect=AssertionError("a query for the node")) as model:
        got = await core.node_of(sandbox)
    assert got.pk == node.pk and not model.mock_calls


async def test_node_of_a_sandbox_read_without_it_asks_the_database(create, node):
    sid = (await create())["sandboxID"]
    sandbox = await Sandbox.objects.aget(pk=sid)
    with mock.patch.object(core, "Node", wraps=core.Node) as model:
        assert (await core.node_of(sandbox)).pk == node.pk
    assert model.objects.filter.called or model.mock_calls
    await Sandbox.objects.filter(pk=sid).aupdate(node=None)
    with pytest.raises(Unavailable):
        await core.node_of(await Sandbox.objects.aget(pk=sid))
