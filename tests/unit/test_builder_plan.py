"""The template builder's pure rules (``agent.builder.plan``): chain keys and ``force``,
the build context, and E2B's COPY / WORKDIR / ENV semantics (spec §4)."""
import pytest

from agent.builder import plan
from agent.builder.plan import Context, StepError


def _steps(*kinds):
    return [{"type": k, "args": [f"arg-{i}"], "force": False} for i, k in enumerate(kinds)]


def test_keys_chain_every_earlier_step_and_the_team():
    steps = _steps("RUN", "RUN", "RUN")
    a = plan.plan(plan.base_key("team-a", "image:x"), steps, force=False)
    changed = [dict(s) for s in steps]
    changed[1]["args"] = ["other"]
    b = plan.plan(plan.base_key("team-a", "image:x"), changed, force=False)
    assert a[0].key == b[0].key and a[1].key != b[1].key and a[2].key != b[2].key  # a change misses from there on
    other_team = plan.plan(plan.base_key("team-b", "image:x"), steps, force=False)
    assert {p.key for p in other_team}.isdisjoint({p.key for p in a})  # never shared across teams
    with_hash = [{**steps[0], "files_hash": "f" * 64}] + steps[1:]
    assert plan.plan(plan.base_key("team-a", "image:x"), with_hash, force=False)[0].key != a[0].key
    assert [p.number for p in a] == [1, 2, 3] and a[2].label == "[builder 3/3] RUN arg-2"


def test_force_rebuilds_that_step_and_every_later_one():
    steps = _steps("RUN", "RUN", "RUN")
    steps[1]["force"] = True
    assert [p.forced for p in plan.plan("b", steps, force=False)] == [False, True, True]
    assert all(p.forced for p in plan.plan("b", _steps("RUN", "RUN"), force=True))
    assert not any(p.forced for p in plan.plan("b", _steps("RUN", "RUN"), force=False))


def test_aliases_run_as_their_kind():
    planned = plan.plan("b", [{"type": "ADD", "args": ["a", "/b"]}, {"type": "ARG", "args": ["K", "v"]}], False)
    assert [p.kind for p in planned] == ["COPY", "ENV"]


@pytest.mark.parametrize("src, dest, workdir, expected", [
    ("app/", "/app", "", ("app", "/app", False)),
    ("folder/*", "folder", "", ("folder", "/home/user/folder", False)),
    ("a/b.txt", "/srv/", "", ("a/b.txt", "/srv", True)),
    ("*.txt", "out/", "/work", (".", "/work/out", True)),
    ("./x/../y", "../z", "/a/b", ("y", "/a/z", False)),
])
def test_copy_paths(src, dest, workdir, expected):
    cp = plan.copy_plan([src, dest, "", ""], Context(user="user", workdir=workdir))
    assert (cp.source, cp.dest, cp.into) == expected and cp.owner == "user:user" and cp.mode == ""


def test_copy_owner_and_mode():
    ctx = Context(user="user")
    assert plan.copy_plan(["a", "/b", "root", "0755"], ctx).owner == "root:root"
    assert plan.copy_plan(["a", "/b", "app:staff", "755"], ctx).owner == "app:staff"
    for bad in (["a", "/b", "ro ot", ""], ["a", "/b", "", "0999"], ["a", "/b", "", "rwx"], ["../x", "/b"], ["a"]):
        with pytest.raises(StepError):
            plan.copy_plan(bad, ctx)


def test_workdir_joins_the_current_one():
    assert plan.workdir_after(Context(), "app") == "/app"
    assert plan.workdir_after(Context(workdir="/srv"), "app/../x") == "/srv/x"
    assert plan.workdir_after(Context(workdir="/srv"), "/opt") == "/opt"
    with pytest.raises(StepError):
        plan.workdir_after(Context(), " ")


def test_env_expansion_substitutes_variables_and_runs_nothing():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
    assert plan.expand("${PATH}:/my/path", env) == "/usr/bin:/bin:/my/path"
    assert plan.expand("$HOME/x $UNSET.", env) == "/root/x ."
    assert plan.expand("$(whoami) `id` \\$HOME", env) == "$(whoami) `id` $HOME"
    assert plan.env_pairs(["A", "1", "B", "2"]) == [("A", "1"), ("B", "2")]
    for bad in (["A"], ["A", "1", "B"], ["1A", "x"], ["A-B", "x"]):
        with pytest.raises(StepError):
            plan.env_pairs(bad)


def test_a_path_a_step_sets_keeps_the_standard_directories():
    env = plan.command_env(Context(env={"PATH": "/opt/bin:/usr/bin", "A": "1"}))
    assert env["A"] == "1" and env["PATH"].split(":")[:2] == ["/opt/bin", "/usr/bin"]
    assert set(plan.STANDARD_PATH) <= set(env["PATH"].split(":"))
    assert plan.command_env(Context(env={"A": "1"})) == {"A": "1"}


def test_context_round_trips_and_cwd_defaults_to_home():
    ctx = Context(user="app", workdir="", env={"A": "1"})
    assert Context.from_json(ctx.to_json()) == ctx and plan.cwd_of(ctx) == "/home/app"
    assert plan.cwd_of(Context(user="root")) == "/root" and plan.cwd_of(Context(workdir="/x")) == "/x"
    with pytest.raises(StepError):
        plan.check_user("Bad User")
