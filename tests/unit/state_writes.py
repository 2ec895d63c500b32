"""Finds the code that writes a model's state field, for the tests that check only the one
writer of a state machine does (``test_snapshot_states``, ``test_build_states``; the
sandbox one in ``test_states`` scans the same way).

A write is a queryset call that sets the field (``….update(status=…)``, ``aupdate``,
``update_or_create`` with it in ``defaults`` counts too) on a receiver that names the
model or its related manager, or an assignment ``<something named like the model>.field = …``
(followed by a ``save()``)."""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = (".venv", "var", "tests", "bench", "node_modules", "vendor", "static", "staticfiles")
UPDATES = ("update", "aupdate", "update_or_create", "aupdate_or_create", "bulk_update", "abulk_update")


def _sets_field(call: ast.Call, field: str) -> bool:
    for k in call.keywords:
        if k.arg == field:
            return True
        if k.arg == "defaults" and field in ast.unparse(k.value):
            return True
        if k.arg == "fields" and field in ast.unparse(k.value):  # bulk_update(objs, fields=[…])
            return True
    return any(isinstance(a, (ast.List, ast.Tuple)) and f"'{field}'" in ast.unparse(a) for a in call.args[1:])


def writes(path: Path, field: str, receivers: tuple[str, ...], names: tuple[str, ...]) -> list[int]:
    """Line numbers in ``path`` that write ``field``: updates on a receiver whose source
    contains one of ``receivers``, assignments to ``X.field`` where ``X`` contains one of
    ``names`` (case-insensitive)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in UPDATES
                and _sets_field(node, field) and any(r in ast.unparse(node.func.value) for r in receivers)):
            found.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr == field
                    and any(n in ast.unparse(target.value).lower() for n in names)):
                found.append(node.lineno)
    return sorted(found)


def _sources() -> list[Path]:
    """The repository's own ``.py`` files (no virtualenv, data, tests or migrations)."""
    found = []
    for top, dirs, files in os.walk(ROOT):
        here = Path(top)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("migrations", "__pycache__")
                         and not (here == ROOT and d in SKIPPED))
        found += [here / f for f in sorted(files) if f.endswith(".py")]
    return found


def writers(field: str, receivers: tuple[str, ...], names: tuple[str, ...], writer: str) -> tuple[list[str], list[int]]:
    """(every ``path:line`` outside ``writer`` that writes the field, the writer's own lines)."""
    outside, own = [], []
    for path in _sources():
        rel = path.relative_to(ROOT)
        lines = writes(path, field, receivers, names)
        if rel == Path(writer):
            own = lines
        else:
            outside += [f"{rel}:{line}" for line in lines]
    return outside, own
