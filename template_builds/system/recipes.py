"""What a system template is built from: E2B build steps over ``base``, the directory trees
its COPY steps take (archived and stored like an SDK's upload), the start and ready
commands and the shape. ``Recipe.digest`` names all of it: an unchanged digest means an
unchanged template."""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

SKIP = {"__pycache__", ".pytest_cache"}


def tree_files(root: Path, keep_caches: bool = False) -> list[Path]:
    """The regular files and symlinks under ``root``, sorted, without caches (unless
    ``keep_caches``: a tree whose byte-compiled files are part of it)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        out.extend(here / d for d in dirnames if (here / d).is_symlink())  # not walked into
        dirnames[:] = sorted(d for d in dirnames if keep_caches or d not in SKIP)
        out.extend(here / f for f in sorted(filenames) if keep_caches or not f.endswith(".pyc"))
    return sorted(out)


def tree_hash(root: Path, name: str, keep_caches: bool = False) -> str:
    """A content hash of the tree as it will be unpacked under ``name/`` (paths, modes,
    bytes, a symlink's target): the COPY step's ``filesHash``."""
    h = hashlib.sha256(f"aenv-system-tree;{name}".encode())
    for path in tree_files(root, keep_caches):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            h.update(f"\0{rel}\0link\0{os.readlink(path)}\0".encode())
            continue
        h.update(f"\0{rel}\0{path.stat().st_mode & 0o777:o}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _whole_seconds(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """mtimes in whole seconds, as a .pyc records its source's: a fraction would be rounded
    in the tar header (a second later for half the files) and the .pyc seen as stale."""
    info.mtime = int(info.mtime)
    return info


def tree_archive(root: Path, name: str, dest: Path, keep_caches: bool = False, compresslevel: int = 9) -> Path:
    """The tree as a gzipped tar with everything under ``name/`` (what COPY ``name/`` reads)."""
    with tarfile.open(dest, "w:gz", compresslevel=compresslevel) as tar:
        tar.add(root, arcname=name, recursive=False, filter=_whole_seconds)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if keep_caches or d not in SKIP)
            here = Path(dirpath)
            rel = here.relative_to(root)
            for entry in [*dirnames, *sorted(f for f in filenames if keep_caches or not f.endswith(".pyc"))]:
                tar.add(here / entry, arcname=f"{name}/{(rel / entry).as_posix()}", recursive=False,
                        filter=_whole_seconds)
    return dest


@dataclass
class Tree:
    """A directory of the host copied into the guest by a COPY step."""

    root: Path
    name: str  # the top directory inside the archive (the COPY source)
    keep_caches: bool = False  # its __pycache__ directories and .pyc files are copied too
    archive: Path | None = None  # its tree_archive, made ahead (else made when stored)
    known_hash: str = ""  # its files_hash, computed ahead

    @property
    def files_hash(self) -> str:
        if not self.known_hash:
            self.known_hash = tree_hash(self.root, self.name, self.keep_caches)
        return self.known_hash


@dataclass
class Recipe:
    alias: str
    steps: list[dict]  # the start body's steps (type, args, and ``tree`` for COPY)
    start_cmd: str
    ready_cmd: str
    cpu_count: int = 2
    memory_mb: int = 1024
    from_template: str = "base"
    trees: dict[str, Tree] = field(default_factory=dict)  # tree name -> Tree

    def body(self) -> dict:
        """The build's start body (``serializers.BuildStartSerializer``'s snake_case form)."""
        steps = []
        for step in self.steps:
            item = {"type": step["type"], "args": list(step["args"]), "force": False}
            if step.get("tree"):
                item["filesHash"] = self.trees[step["tree"]].files_hash
            steps.append(item)
        return {"from_template": self.from_template, "steps": steps, "start_cmd": self.start_cmd,
                "ready_cmd": self.ready_cmd, "force": False}

    def digest(self) -> str:
        doc = {"alias": self.alias, "body": self.body(), "cpu": self.cpu_count, "memory": self.memory_mb}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def tag(self) -> str:
        """The tag of a build of exactly this recipe."""
        return f"recipe-{self.digest()[:16]}"


def copy_step(tree: Tree, dest: str, owner: str = "root") -> dict:
    return {"type": "COPY", "args": [f"{tree.name}/", dest, owner, ""], "tree": tree.name}


def run_step(command: str, user: str = "root") -> dict:
    return {"type": "RUN", "args": [command, user]}

