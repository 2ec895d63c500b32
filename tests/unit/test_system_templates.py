"""System templates (template_builds.system): a recipe's COPY trees and digest, and
``ensure`` registering a global template whose build belongs to the system team, started
through the ordinary placement (the node side mocked, a test double of the builder),
idempotent per recipe, visible to every team; the code-interpreter recipe's steps."""
import json
import os
import tarfile
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async

from sandboxes.models import Template
from template_builds import files
from lifecycle import resolve
from template_builds.models import TemplateBuild, TemplateFile
from template_builds.names import check_tag
from template_builds.system import code_interpreter, host_venv
from lifecycle.templates.system import SYSTEM_TEAM_ID, SystemTemplateError, ensure, store_trees, system_team
from template_builds.system.recipes import Recipe, Tree, copy_step, run_step, tree_archive, tree_hash
from tests.unit.template_builder_double import FakeBuilder, fail_at_last_step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr("lifecycle.templates.system.POLL_SECONDS", 0.05)


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


def test_a_tree_with_caches_keeps_them_and_hashes_links_not_their_targets(tree, tmp_path):
    (tree.root / "link").symlink_to(tmp_path / "outside")
    (tree.root / "dirlink").symlink_to("pkg")
    without = tree_hash(tree.root, "stuff")
    with_caches = tree_hash(tree.root, "stuff", keep_caches=True)
    assert with_caches != without
    (tmp_path / "outside").write_text("the host's file, not the tree's")
    assert tree_hash(tree.root, "stuff", keep_caches=True) == with_caches  # a link is its target's name
    (tree.root / "dirlink").unlink()
    (tree.root / "dirlink").symlink_to("elsewhere")
    assert tree_hash(tree.root, "stuff", keep_caches=True) != with_caches
    archive = tree_archive(tree.root, "stuff", tmp_path / "c.tar.gz", keep_caches=True)
    with tarfile.open(archive) as tar:
        assert "stuff/pkg/__pycache__/mod.cpython-311.pyc" in tar.getnames()
        assert tar.getmember("stuff/link").issym() and tar.getmember("stuff/dirlink").linkname == "elsewhere"


def test_tree_archive_mtimes_are_whole_seconds_as_a_pyc_records_them(tree, tmp_path):
    """A .pyc holds its source's mtime in whole seconds (truncated): the archive's must be
    the same, not rounded up (the guest would see every second .pyc as stale)."""
    os.utime(tree.root / "pkg" / "mod.py", (1700000000.75, 1700000000.75))
    archive = tree_archive(tree.root, "stuff", tmp_path / "t.tar.gz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("stuff/pkg/mod.py")
        assert member.mtime == 1700000000 and "mtime" not in member.pax_headers


def test_a_tree_archived_ahead_is_stored_as_it_is(tree, tmp_path, home):
    archive = tree_archive(tree.root, "stuff", tmp_path / "ahead.tar.gz", keep_caches=True)
    ahead = Tree(tree.root, "stuff", keep_caches=True, archive=archive, known_hash="f" * 64)
    store_trees(system_team(), make_recipe(ahead))
    stored = files.get_file_store().path(SYSTEM_TEAM_ID, "f" * 64)
    assert stored.read_bytes() == archive.read_bytes() and archive.is_file()  # copied, the cache keeps its own


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


@pytest.fixture
def wheel_tree(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("numpy\n")
    tree = Tree(wheels, "wheels")
    monkeypatch.setattr(code_interpreter, "wheels", lambda cache=None, progress=print: tree)
    return tree


def test_code_interpreter_recipe_copies_a_venv_built_on_the_host(tmp_path, monkeypatch, wheel_tree):
    venv_root = tmp_path / "venv-x" / "venv"
    (venv_root / "bin").mkdir(parents=True)
    (venv_root / "bin" / "python3").symlink_to("/usr/bin/python3")
    built = Tree(venv_root, "venv", keep_caches=True)
    monkeypatch.setattr(code_interpreter, "venv", lambda wheels, cache=None, progress=print: built)
    said: list = []
    recipe = code_interpreter.recipe(progress=said.append)
    assert recipe.alias == "code-interpreter-v1"
    kinds = [(s["type"], s["args"][1]) for s in recipe.steps]
    assert kinds == [("COPY", "/opt/code-interpreter/venv"), ("COPY", "/opt/code-interpreter/lib/code_interpreter"),
                     ("RUN", "root")]
    assert set(recipe.trees) == {"venv", "code_interpreter"} and recipe.trees["venv"] is built
    assert "import code_interpreter.app, ipykernel, bash_kernel" in recipe.steps[2]["args"][0]  # still in the guest
    assert recipe.trees["code_interpreter"].root == Path(code_interpreter.SERVER)
    assert "python -m code_interpreter" in recipe.start_cmd and "49999/health" in recipe.ready_cmd
    assert (code_interpreter.SERVER / "guest-requirements.txt").is_file()
    assert not any("build VM" in line for line in said)


def test_code_interpreter_recipe_installs_in_the_guest_where_the_host_cannot(monkeypatch, wheel_tree):
    monkeypatch.setattr(code_interpreter, "venv", lambda wheels, cache=None, progress=print: "not running as root")
    said: list = []
    recipe = code_interpreter.recipe(progress=said.append)
    kinds = [(s["type"], s["args"][1]) for s in recipe.steps]
    assert kinds == [("COPY", "/opt/code-interpreter/wheels"), ("RUN", "root"),
                     ("COPY", "/opt/code-interpreter/lib/code_interpreter"), ("RUN", "root")]
    install = recipe.steps[1]["args"][0]
    assert "--no-index" in install and "compileall" in install  # offline in the guest
    # the build log says why (the step's first output line)
    assert install.startswith("echo 'aenv: installing the venv in the build VM, not on the host: not running as "
                              "root' && ")
    assert set(recipe.trees) == {"wheels", "code_interpreter"}
    assert any("not running as root" in line for line in said)


@pytest.fixture
def guest_image(tmp_path, settings):
    """An images dir whose ``base`` names a debootstrap stage with a python3."""
    images = tmp_path / "images"
    rootfs = images / "stages" / "debootstrap-abc" / "rootfs"
    (rootfs / "usr" / "bin").mkdir(parents=True)
    (rootfs / "usr" / "bin" / "python3").write_text("")
    (images / "base-1").mkdir()
    (images / "base-1" / "image.json").write_text(json.dumps({"stages": {"debootstrap": "abc"}}))
    (images / "base").symlink_to("base-1")
    settings.AENV_IMAGES_DIR = images
    return rootfs


def fake_host_build(calls):
    """host_venv.run's double: a small venv with a .pyc and the guest's interpreter link."""
    def run(rootfs, out, guest_dir, wheels, command, timeout=1800):
        calls.append((rootfs, guest_dir, wheels, command))
        pkg = out / "venv" / "lib" / "python3.11" / "site-packages" / "pkg"
        (pkg / "__pycache__").mkdir(parents=True)
        (pkg / "__init__.py").write_text("x = 1\n")
        (pkg / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"compiled")
        (out / "venv" / "bin").mkdir()
        (out / "venv" / "bin" / "python3").symlink_to("/usr/bin/python3")
        return ""
    return run


def test_the_venv_is_built_on_the_host_once_per_wheels_and_stage(tmp_path, monkeypatch, wheel_tree, guest_image):
    calls: list = []
    monkeypatch.setattr(host_venv, "unavailable", lambda: "")
    monkeypatch.setattr(host_venv, "run", fake_host_build(calls))
    cache = tmp_path / "cache"
    leftover, busy = cache / "code-interpreter" / ".venv-killed", cache / "code-interpreter" / ".venv-busy"
    (leftover / "venv").mkdir(parents=True)
    busy.mkdir()
    os.utime(leftover, (0, 0))  # a killed build's, long ago; ``busy`` another build's, now
    built = code_interpreter.venv(wheel_tree, cache, progress=lambda m: None)
    assert not leftover.exists() and busy.is_dir()
    busy.rmdir()
    assert isinstance(built, Tree) and built.name == "venv" and built.keep_caches
    [(rootfs, guest_dir, wheels, command)] = calls
    assert (rootfs, guest_dir, wheels) == (guest_image, "/opt/code-interpreter", wheel_tree.root)
    assert "--no-index" in command and "compileall" in command and "/tmp/wheels/requirements.txt" in command
    assert built.files_hash == tree_hash(built.root, "venv", keep_caches=True)  # made ahead, and right
    with tarfile.open(built.archive) as tar:  # the COPY archive, byte-compiled files and links included
        names = set(tar.getnames())
        assert tar.getmember("venv/bin/python3").linkname == "/usr/bin/python3"
    assert "venv/lib/python3.11/site-packages/pkg/__pycache__/__init__.cpython-311.pyc" in names
    assert [p.name for p in cache.joinpath("code-interpreter").iterdir()] == [built.root.parent.name]  # no leftovers

    again = code_interpreter.venv(wheel_tree, cache, progress=lambda m: None)
    assert again.root == built.root and len(calls) == 1  # cached
    new_stage = guest_image.parents[1] / "debootstrap-def" / "rootfs"
    (new_stage / "usr" / "bin").mkdir(parents=True)
    (new_stage / "usr" / "bin" / "python3").write_text("")
    (guest_image.parents[2] / "base-1" / "image.json").write_text(json.dumps({"stages": {"debootstrap": "def"}}))
    rebuilt = code_interpreter.venv(wheel_tree, cache, progress=lambda m: None)
    assert rebuilt.root != built.root and len(calls) == 2 and calls[1][0] == new_stage  # a new stage, a new venv


def test_the_venv_falls_back_to_the_guest(tmp_path, monkeypatch, wheel_tree, guest_image, settings):
    calls: list = []
    monkeypatch.setattr(host_venv, "run", fake_host_build(calls))
    monkeypatch.setattr(host_venv, "unavailable", lambda: "not running as root (the build needs its own mount "
                                                          "namespace)")
    assert code_interpreter.venv(wheel_tree, tmp_path / "c", progress=lambda m: None).startswith("not running as root")
    monkeypatch.setattr(host_venv, "unavailable", lambda: "")
    said: list = []

    def failing(*args, **kwargs):
        raise host_venv.BuildFailed("exit status 1: no matching distribution")
    monkeypatch.setattr(host_venv, "run", failing)
    assert code_interpreter.venv(wheel_tree, tmp_path / "c", progress=said.append) == "its host build failed"
    assert any("no matching distribution" in line for line in said)
    assert not [p for p in (tmp_path / "c" / "code-interpreter").iterdir()]  # nothing half-built kept
    settings.AENV_IMAGES_DIR = tmp_path / "no-images"
    assert "no built image 'base'" in code_interpreter.venv(wheel_tree, tmp_path / "c", progress=lambda m: None)
    assert not calls


def test_the_command_starts_the_code_interpreter_build_and_is_idempotent(builder, monkeypatch, wheel_tree):
    from django.core.management import call_command

    monkeypatch.setattr(code_interpreter, "venv", lambda wheels, cache=None, progress=print: "no stage here")
    out = __import__("io").StringIO()
    call_command("ensure_system_templates", "--download-only", stdout=out)
    assert "packages ready" in out.getvalue() and not builder.calls
    call_command("ensure_system_templates", "--timeout", "60", stdout=out)
    [call] = builder.calls
    assert call["template_id"] == "code-interpreter-v1" and call["cpu_count"] == 2 and call["memory_mb"] == 1024
    assert TemplateBuild.objects.get(template_id="code-interpreter-v1").status == "ready"
    call_command("ensure_system_templates", "--no-wait", stdout=out)
    assert len(builder.calls) == 1 and "up to date" in out.getvalue().splitlines()[-1]
