"""The module import graph has no cycles (issue 9).

Why a test: a cycle means two modules can only be understood (and changed) together, and
a lazy ``import`` inside a function hides one from Python but not from a reader. The
graph counts every import statement, top-level or inside a function, except those under
``if TYPE_CHECKING:``. ``import_graph()`` and ``cycles()`` take any set of top-level
packages, so the check can grow from ``vmm`` to the whole repository.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, ...]]:
    """What each import statement in ``tree`` names, as candidates, best first
    (``from a import b`` gives ``("a.b", "a")``: the caller keeps the first that is a
    module of the graph)."""
    out: list[tuple[str, ...]] = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            for child in node.orelse:  # only the else branch runs
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name,) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.extend((f"{target}.{alias.name}", target) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph(packages: list[str], root: Path = ROOT,
                 exclude: tuple[str, ...] = ("tests", "migrations")) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (directly), for every ``.py`` file
    under those top-level packages (dirs named in ``exclude`` skipped). An import of a
    name from a package counts as an import of the submodule if there is one, else of the
    package (its ``__init__``)."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if set(path.relative_to(root).parts[:-1]) & set(exclude):
                continue
            files[_module_name(path, root)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for candidates in _imports(tree, module, path.name == "__init__.py"):
            for name in candidates:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name:
                    if name != module:
                        edges.add(name)
                    break
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected component with more than one module
    (sorted), found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def test_cycle_finder_finds_cycles_through_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c  # lazy\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from pkg import d\n")
    (pkg / "d.py").write_text("from pkg.sub.c import x\n")
    (pkg / "tests").mkdir()
    (pkg / "tests" / "t.py").write_text("import pkg.a\n")
    graph = import_graph(["pkg"], root=tmp_path)
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert "pkg.tests.t" not in graph
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]  # d -> c only: not a cycle


def test_vmm_has_no_import_cycles():
    assert cycles(import_graph(["vmm"])) == []


# The layers, top to bottom (docs/architecture.md draws them). A package imports only
# packages of the layers below its own; packages sharing a layer never import each other.
LAYERS: list[tuple[str, ...]] = [
    ("tests",),
    ("bench",),
    ("harness",),  # the local stack the tests and benchmarks start
    ("cluster",),  # many nodes on one machine (a launcher, no Django)
    ("config",),  # settings, URLs, the two ASGI entry points, the middleware stack
    ("dashboard", "dataplane", "agent"),  # edges: browser pages, sandbox traffic, the node process
    ("api",),  # the E2B REST edge: auth, errors -> HTTP, serializers, views
    ("lifecycle",),  # operations across the domain apps: create, pause, snapshot, fork, build
    ("events",),  # lifecycle events as E2B serves them, webhooks and their deliveries
    ("nodes",),  # Node, placement, the Celery gateway to node workers
    ("template_builds",),
    ("snapshots",),
    ("volumes",),  # team volumes, their mounts and their files (volumes.content: no Django)
    ("team_secrets",),  # a team's sealed secrets and who may resolve them (above Team, Sandbox)
    ("sandboxes",),  # Team, ApiKey, Template, Sandbox; the sandbox states and their writer
    ("code_interpreter", "aenv_cli"),
    ("vmm",),
    ("chunkfs",),  # lazily filled files over the node's chunk cache (no Django; vmm's RAM copies use it)
    ("envd_client",),
    ("envd",),
]
PACKAGES = [package for layer in LAYERS for package in layer]


def _layer_of() -> dict[str, int]:
    return {package: depth for depth, layer in enumerate(LAYERS) for package in layer}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package from its own layer or one above it (an edge that points up)."""
    depth = _layer_of()
    found = []
    for module, deps in sorted(graph.items()):
        here = module.split(".")[0]
        for dep in sorted(deps):
            there = dep.split(".")[0]
            if there != here and depth[there] <= depth[here]:
                found.append(f"{module} -> {dep}")
    return found


def test_every_top_level_package_is_in_a_layer():
    on_disk = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert sorted(PACKAGES) == on_disk


def test_imports_point_down_the_layers_only():
    """Function-level imports count too: a lazy import hides a cycle from Python only."""
    assert layer_violations(import_graph(PACKAGES, exclude=("migrations",))) == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    for package, source in (("low", "import high.mod\n"), ("high", "")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "mod.py").write_text(source)
    graph = import_graph(["low", "high"], root=tmp_path)
    global LAYERS
    saved, LAYERS = LAYERS, [("high",), ("low",)]
    try:
        assert layer_violations(graph) == ["low.mod -> high.mod"]
    finally:
        LAYERS = saved


def test_the_repository_has_no_import_cycles():
    assert cycles(import_graph(PACKAGES, exclude=("migrations",))) == []


def test_control_plane_and_node_agent_meet_only_at_the_protocol():
    """The control plane sends tasks by name (nodes.protocol) and never imports the node
    agent (only the run_node command starts it); the agent never imports the API edge."""
    graph = import_graph(PACKAGES)
    control = ("sandboxes", "snapshots", "template_builds", "nodes", "lifecycle", "api", "dataplane", "dashboard",
               "config")
    into_agent = sorted((m, d) for m, deps in graph.items() for d in deps
                        if m.split(".")[0] in control and d.split(".")[0] == "agent")
    assert into_agent == []
    edge = ("api.sandboxes.views", "api.sandboxes.serializers", "api.errors", "lifecycle.sandboxes", "api.snapshots.views",
            "lifecycle.snapshots", "api.templates.views", "api.templates.serializers",
            "lifecycle.templates", "lifecycle.resolve", "dashboard", "nodes.client", "nodes.placement")
    into_edge = sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == "agent" for d in deps
                       if any(d == e or d.startswith(e + ".") for e in edge))
    assert into_edge == []
    assert not [d for m, deps in graph.items() if m.split(".")[0] == "vmm" for d in deps
                if d.split(".")[0] not in ("vmm", "chunkfs", "envd", "envd_client")], "vmm must stay Django-free"


def test_the_standalone_cli_needs_only_what_cli_pyproject_packages():
    """packaging/aenv-cli/hatch_build.py ships aenv_cli, envd_client and, of envd, only its package
    __init__ and the wire module: the CLI's imports of the repository stay inside those."""
    shipped = {"envd", "envd.wire"}
    graph = import_graph(PACKAGES)
    reach, todo = set(), [m for m in graph if m.split(".")[0] in ("aenv_cli", "envd_client")]
    while todo:
        module = todo.pop()
        if module not in reach:
            reach.add(module)
            todo.extend(graph.get(module, ()))
    outside = sorted(m for m in reach if m.split(".")[0] not in ("aenv_cli", "envd_client") and m not in shipped)
    assert outside == []
