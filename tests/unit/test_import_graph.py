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


PACKAGES = ["aenv_site", "sandboxes", "snapshots", "template_builds", "nodes", "agent", "dashboard", "vmm", "envd",
            "envd_client", "aenv_cli"]


def test_the_repository_has_no_import_cycles():
    assert cycles(import_graph(PACKAGES)) == []


def test_control_plane_and_node_agent_meet_only_at_the_protocol():
    """The control plane sends tasks by name (nodes.protocol) and never imports the node
    agent (only the run_node command starts it); the agent never imports the API edge."""
    graph = import_graph(PACKAGES)
    control = ("sandboxes", "snapshots", "template_builds", "nodes", "dashboard", "aenv_site")
    into_agent = sorted((m, d) for m, deps in graph.items() for d in deps
                        if m.split(".")[0] in control and d.split(".")[0] == "agent")
    assert into_agent == [("nodes.management.commands.run_node", "agent.worker")]
    edge = ("sandboxes.views", "sandboxes.serializers", "sandboxes.errors", "sandboxes.lifecycle", "snapshots.views",
            "snapshots.lifecycle", "template_builds.views", "template_builds.serializers",
            "template_builds.lifecycle", "template_builds.resolve", "dashboard", "nodes.client", "nodes.placement")
    into_edge = sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == "agent" for d in deps
                       if any(d == e or d.startswith(e + ".") for e in edge))
    assert into_edge == []
    assert not [d for m, deps in graph.items() if m.split(".")[0] == "vmm" for d in deps
                if d.split(".")[0] not in ("vmm", "envd", "envd_client")], "vmm must stay Django-free"


def test_the_standalone_cli_needs_only_what_cli_pyproject_packages():
    """cli/hatch_build.py ships aenv_cli, envd_client and, of envd, only its package
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
