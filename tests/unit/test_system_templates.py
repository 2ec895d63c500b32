"""System templates (template_builds.system): a recipe's COPY trees and digest, and
``ensure`` registering a global template whose build belongs to the system team, started
through the ordinary placement (the node side mocked, a test double of the builder),
idempotent per recipe, visible to every team; the code-interpreter recipe's steps."""
import tarfile
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async

from sandboxes.models import Template
from template_builds import files, resolve
from template_builds.models import TemplateBuild, TemplateFile
from template_builds.names import check_tag
from template_builds.system import code_interpreter
from template_builds.system.ensure import SYSTEM_TEAM_ID, SystemTemplateError, ensure
from template_builds.system.recipes import Recipe, Tree, copy_step, run_step, tree_archive, tree_hash
from tests.unit.template_builder_double import FakeBuilder, fail_at_last_step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr("template_builds.system.ensure.POLL_SECONDS", 0.05)


@pytest.fixture
def home(settings, tmp_path):
    settings.AENV_HOME = tmp_path / "home"
    return settings.AENV_HOME


@pytest.fixture
def builder(nodes_mock, home, base_template):
    fake = FakeBuilder(nodes_mock.node.id)
    nodes_mock.client.build_template = fake
    yield fake
    fake.join()


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "tree"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"junk")
    (root / "top.txt").write_text("top\n")
    return Tree(root, "stuff")


def make_recipe(tree: Tree, start_cmd: str = "serve") -> Recipe:
    return Recipe(alias="sys-tpl", steps=[copy_step(tree, "/opt/stuff"), run_step("echo built")],
                  start_cmd=start_cmd, ready_cmd="true", trees={tree.name: tree})


def test_tree_hash_follows_content_not_caches(tree):
    before = tree_hash(tree.root, "stuff")
    (tree.root / "pkg" / "__pycache__" / "other.pyc").write_bytes(b"more junk")
    assert tree_hash(tree.root, "stuff") == before
    (tree.root / "pkg" / "mod.py").write_text("x = 2\n")
    assert tree_hash(tree.root, "stuff") != before
    assert tree_hash(tree.root, "other-name") != tree_hash(tree.root, "stuff")


def test_tree_archive_is_what_copy_reads(tree, tmp_path):
    archive = tree_archive(tree.root, "stuff", tmp_path / "t.tar.gz")
    assert files.check_archive(archive, 1 << 20) is True
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    assert names == ["stuff", "stuff/pkg", "stuff/pkg/mod.py", "stuff/top.txt"]


def test_recipe_body_and_digest(tree):
    recipe = make_recipe(tree)
    body = recipe.body()
    assert body["from_template"] == "base"
    assert body["steps"][0] == {"type": "COPY", "args": ["stuff/", "/opt/stuff", "root", ""], "force": False,
                                "filesHash": tree.files_hash}
    assert body["steps"][1] == {"type": "RUN", "args": ["echo built", "root"], "force": False}
    assert check_tag(recipe.tag) == recipe.tag
    assert make_recipe(tree).digest() == recipe.digest()
    assert make_recipe(tree, start_cmd="serve --other").digest() != recipe.digest()


async def test_ensure_builds_a_global_template_once_per_recipe(builder, nodes_mock, tree, home, other_team):
    recipe = make_recipe(tree)
    said: list = []
    build = await ensure(recipe, say=said.append, timeout=60)
    assert build.status == "ready"
    template = await Template.objects.select_related("team").aget(pk="sys-tpl")
    assert (template.team_id, template.alias, template.public) == (None, "sys-tpl", True)
    [call] = builder.calls
    assert call["spec"]["team_id"] == str(SYSTEM_TEAM_ID)
    assert call["spec"]["from_template"]["ref"] == "base" and call["spec"]["start_cmd"] == "serve"
    assert [s["files_hash"] for s in call["spec"]["steps"] if s["type"] == "COPY"] == [tree.files_hash]
    stored = await TemplateFile.objects.aget(team_id=SYSTEM_TEAM_ID, hash=tree.files_hash)
    assert stored.gzip and files.get_file_store().exists(SYSTEM_TEAM_ID, tree.files_hash)
    assert any("[builder 1/2] COPY" in line for line in said)

    again = await ensure(make_recipe(tree), say=said.append)  # unchanged: nothing to do
    assert again.pk == build.pk and len(builder.calls) == 1 and "up to date" in said[-1]

    source = await resolve.resolve_source(other_team, "sys-tpl")
    assert source.template.pk == "sys-tpl" and source.build.pk == build.pk  # every team resolves it

    (tree.root / "top.txt").write_text("changed\n")
    changed = await ensure(make_recipe(Tree(tree.root, "stuff")), say=said.append, timeout=60)
    assert changed.pk != build.pk and len(builder.calls) == 2
    newest = await resolve.resolve_source(other_team, "sys-tpl")
    assert newest.build.pk == changed.pk


async def test_no_node_leaves_the_build_waiting_and_the_next_run_starts_it(builder, nodes_mock, tree, home):
    placed = nodes_mock.placement.place.side_effect
    nodes_mock.placement.place.side_effect = nodes_mock.placement.NoNodeAvailable("no node has room")
    with pytest.raises(SystemTemplateError, match="could not start"):
        await ensure(make_recipe(tree), say=lambda m: None)
    [waiting] = [b async for b in TemplateBuild.objects.filter(template_id="sys-tpl")]
    assert waiting.status == "waiting"
    nodes_mock.placement.place.side_effect = placed
    build = await ensure(make_recipe(tree), say=lambda m: None, timeout=60)
    assert build.pk == waiting.pk and build.status == "ready"


async def test_a_failed_build_is_reported_and_retried_as_a_new_build(builder, nodes_mock, tree, home):
    builder.script = fail_at_last_step
    with pytest.raises(SystemTemplateError, match="failed at step 2"):
        await ensure(make_recipe(tree), say=lambda m: None, timeout=60)
    builder.script = FakeBuilder(nodes_mock.node.id).script
    build = await ensure(make_recipe(tree), say=lambda m: None, timeout=60)
    assert build.status == "ready" and len(builder.calls) == 2


async def test_an_alias_taken_by_a_team_template_is_refused(builder, team, tree, home):
    await sync_to_async(Template.objects.create)(id="sys-tpl", team=team, alias="sys-tpl", public=False)
    with pytest.raises(SystemTemplateError, match="taken"):
        await ensure(make_recipe(tree), say=lambda m: None)


def test_code_interpreter_recipe(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("numpy\n")
    monkeypatch.setattr(code_interpreter, "wheels", lambda cache=None, progress=print: Tree(wheels, "wheels"))
    recipe = code_interpreter.recipe()
    assert recipe.alias == "code-interpreter-v1"
    kinds = [(s["type"], s["args"][1] if s["type"] == "COPY" else s["args"][1]) for s in recipe.steps]
    assert kinds == [("COPY", "/opt/code-interpreter/wheels"), ("RUN", "root"),
                     ("COPY", "/opt/code-interpreter/lib/code_interpreter"), ("RUN", "root")]
    assert "--no-index" in recipe.steps[1]["args"][0]  # offline in the guest
    assert recipe.trees["code_interpreter"].root == Path(code_interpreter.SERVER)
    assert "python -m code_interpreter" in recipe.start_cmd and "49999/health" in recipe.ready_cmd
    assert (code_interpreter.SERVER / "guest-requirements.txt").is_file()


def test_the_command_starts_the_code_interpreter_build_and_is_idempotent(builder, tmp_path, monkeypatch):
    from django.core.management import call_command

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("numpy\n")
    monkeypatch.setattr(code_interpreter, "wheels", lambda cache=None, progress=print: Tree(wheels, "wheels"))
    out = __import__("io").StringIO()
    call_command("ensure_system_templates", "--download-only", stdout=out)
    assert "packages ready" in out.getvalue() and not builder.calls
    call_command("ensure_system_templates", "--timeout", "60", stdout=out)
    [call] = builder.calls
    assert call["template_id"] == "code-interpreter-v1" and call["cpu_count"] == 2 and call["memory_mb"] == 1024
    assert TemplateBuild.objects.get(template_id="code-interpreter-v1").status == "ready"
    call_command("ensure_system_templates", "--no-wait", stdout=out)
    assert len(builder.calls) == 1 and "up to date" in out.getvalue().splitlines()[-1]
