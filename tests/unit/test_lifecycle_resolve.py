"""What a create's templateID resolves to when it is read in one query (issue 26): the
same answers as the lookups one by one — a snapshot by id before one by name, the newest
ready one of a name, a Conflict for one still being captured, templates in their order
(the team's alias, a global alias, an id)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from lifecycle import resolve, sources
from sandboxes.errors import Conflict
from sandboxes.models import Template
from snapshots.models import Snapshot, SnapshotState as SS
from template_builds.names import parse

pytestmark = pytest.mark.django_db(transaction=True)


def _snap(team, template, *, name="", state=SS.READY, age=0, **fields):
    return Snapshot.objects.create(team=team, template=template, name=name, state=state,
                                   created_at=timezone.now() - timedelta(seconds=age), **fields)


async def _both(team, ref):
    """(one query's answer, the exact lookups' answer): a snapshot id, None or 'conflict'."""
    answers = []
    for resolve_it in (sources.resolve_snapshot, sources._resolve_exactly):
        try:
            found = await resolve_it(team, ref)
            answers.append(found.pk if found is not None else None)
        except Conflict:
            answers.append("conflict")
    return answers


async def test_snapshot_answers_match_the_exact_lookups(team, other_team, base_template):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    make = sync_to_async(_snap)
    old = await make(team, base_template, name="tagged", age=60)
    new = await make(team, base_template, name="tagged", age=10)
    capturing = await make(team, base_template, name="pending", state=SS.CREATING)
    by_id_ready = await make(team, base_template, name="")
    named_like_an_id = await make(team, base_template, name=by_id_ready.pk, age=5)
    await make(team, base_template, name="built", build_result=True)
    await make(team, base_template, name="forked", fork_capture=True)
    await make(team, base_template, name="failed", state=SS.ERROR)
    await make(other_team, base_template, name="theirs")
    cases = {
        "tagged": new.pk, f"{team.slug}/tagged": new.pk, "tagged:v2": new.pk, old.pk: old.pk,
        "pending": "conflict", capturing.pk: "conflict",
        by_id_ready.pk: by_id_ready.pk,  # the id wins over another snapshot's name
        "built": None, "forked": None, "failed": None, "theirs": None, "base": None, "": None,
    }
    for ref, expected in cases.items():
        assert await _both(team, ref) == [expected, expected], ref
    # a ready one of the name beats one being captured under the same name
    await make(team, base_template, name="pending", age=30)
    assert (await _both(team, "pending"))[0] == (await _both(team, "pending"))[1] != "conflict"
    assert named_like_an_id.pk != by_id_ready.pk


async def test_many_of_one_name_fall_back_to_the_exact_lookups(team, base_template):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    make = sync_to_async(_snap)
    for age in range(sources.CANDIDATES + 3):
        await make(team, base_template, name="busy", state=SS.CREATING, age=age + 10)
    ready = await make(team, base_template, name="busy", age=100)  # older than all the captures
    assert await _both(team, "busy") == [ready.pk, ready.pk]


async def test_template_order_in_one_query(team, other_team, base_template):
    mine = await Template.objects.acreate(id="tmine", team=team, alias="base", image="x")
    assert (await resolve.find_template(team, parse("base"))).pk == mine.pk  # the team's alias first
    assert (await resolve.find_template(other_team, parse("base"))).pk == base_template.pk  # then a global one
    theirs = await Template.objects.acreate(id="tothers", team=other_team, alias="tools", image="x")
    assert (await resolve.find_template(team, parse("tools"))) is None
    assert (await resolve.find_template(team, parse("tothers"))).pk == theirs.pk  # by id (visibility is checked later)
    await Template.objects.acreate(id="tmine2", team=team, alias="tothers", image="x")
    assert (await resolve.find_template(team, parse("tothers"))).pk == "tmine2"  # an alias beats an id
    mine.deleted_at = timezone.now()
    await mine.asave()
    assert (await resolve.find_template(team, parse("base"))).pk == base_template.pk


def _ready_build_by_orm(template, tag):
    """ready_build as the ORM read it before its SQL was prepared (issue 26)."""
    from template_builds.models import BuildStatus as B, TemplateBuild, TemplateTag  # noqa: PLC0415

    assignment = (TemplateTag.objects.filter(template=template, tag=tag or "default", build__status=B.READY)
                  .order_by("-created_at", "-id").values_list("build_id", flat=True).first())
    if not assignment:
        return None
    return (TemplateBuild.objects.select_related("snapshot", "snapshot__node", "snapshot__template")
            .filter(pk=assignment).first())


def test_ready_build_and_pick_as_the_orm(team, base_template, node):
    """The newest ready assignment of a tag wins (a failed or pending rebuild leaves the one
    before in service), with its snapshot, the snapshot's node and template read along; a
    template without builds boots its image; other templates' tags do not count."""
    from sandboxes.errors import NotFound  # noqa: PLC0415
    from template_builds.models import BuildStatus as B, TemplateBuild, TemplateTag  # noqa: PLC0415

    tmpl = Template.objects.create(id="tbuilt", team=team, alias="built", image="img")
    other = Template.objects.create(id="tother", team=team, alias="other", image="img")
    assert resolve.pick_build_sync(tmpl, None, "built") is None  # no builds: its image
    snap = _snap(team, tmpl, build_result=True, node=node)
    first = TemplateBuild.objects.create(template=tmpl, status=B.READY, snapshot=snap)
    TemplateTag.objects.create(template=tmpl, tag="default", build=first, created_at=timezone.now() - timedelta(60))
    failed = TemplateBuild.objects.create(template=tmpl, status=B.ERROR)
    TemplateTag.objects.create(template=tmpl, tag="default", build=failed)
    v2 = TemplateBuild.objects.create(template=tmpl, status=B.READY, image="img2")
    TemplateTag.objects.create(template=tmpl, tag="v2", build=v2)
    theirs = TemplateBuild.objects.create(template=other, status=B.READY)
    TemplateTag.objects.create(template=other, tag="v3", build=theirs)

    def fields(obj):
        return None if obj is None else {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}

    for tag in (None, "default", "v2", "v3", "nope"):
        got, orm = resolve.ready_build_sync(tmpl, tag), _ready_build_by_orm(tmpl, tag)
        assert fields(got) == fields(orm), tag
    got = resolve.ready_build_sync(tmpl, None)
    assert got.pk == first.pk and fields(got.snapshot) == fields(snap) and got.snapshot.node.pk == node.pk
    assert got.snapshot.template.pk == tmpl.pk
    assert resolve.ready_build_sync(tmpl, "v2").snapshot is None
    with pytest.raises(NotFound):
        resolve.pick_build_sync(tmpl, "v3", "built:v3")
    with pytest.raises(NotFound):  # builds, none tagged default: not its image
        resolve.pick_build_sync(other, None, "other")
