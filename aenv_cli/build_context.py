"""The files a COPY step sends (spec e2b-templates.md §2): which files of the build
context a source names (``.dockerignore`` honoured), their cache key (``filesHash``) and
the gzipped tar the server stores for it.

The hash is a client-chosen opaque key (the server never recomputes it): SHA-256 over
``COPY <src> <dest>`` and, for every matched entry in path order, its path relative to
the context, its mode, its size (not for directories) and its bytes (a symlink: its
target). uid, gid and mtimes are left out, so an unchanged tree gives the same key on
every machine and its upload is skipped.

The archive's member names are relative to the context, directories are their own
entries, symlinks stay symlinks, owners are not recorded (the builder sets them)."""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GLOB_CHARS = re.compile(r"[*?\[]")


class ContextError(ValueError):
    """A COPY source the context cannot satisfy, or a bad ``.dockerignore``."""


@dataclass(frozen=True)
class Entry:
    """One file, directory or symlink of the context: its path relative to the context
    (``/``-separated) and its ``lstat``."""

    relpath: str
    path: Path
    st: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


def _pattern_regex(pattern: str) -> re.Pattern:
    """A ``.dockerignore`` pattern as a regex over context-relative paths: ``*`` and
    ``?`` within one path element, ``[...]`` a class, ``**`` any number of elements,
    the escape ``\\`` the next character literally."""
    out, i, n = ["^"], 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out.append("(?:.*/)?")
            else:
                out.append(".*")
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = pattern.find("]", i + 2 if pattern.startswith(("[!", "[^"), i) else i + 1)
            if end < 0:
                raise ContextError(f".dockerignore: bad pattern {pattern!r} (an unclosed '[')")
            body = pattern[i + 1:end]
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end
        elif ch == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    return re.compile("".join(out))


class DockerIgnore:
    """``.dockerignore`` rules, anchored at the context root: a pattern that matches a
    directory excludes what is under it, ``!`` includes again, the last match wins; the
    context itself is never excluded."""

    def __init__(self, patterns: list[str]):
        self.rules: list[tuple[bool, re.Pattern]] = []
        for raw in patterns:
            pattern = raw.strip()
            negated = pattern.startswith("!")
            pattern = pattern[1:].strip() if negated else pattern
            pattern = posixpath.normpath(pattern.lstrip("/")) if pattern.lstrip("/") else ""
            if pattern and pattern != ".":
                self.rules.append((negated, _pattern_regex(pattern)))
        self.has_exceptions = any(negated for negated, _ in self.rules)

    @classmethod
    def of(cls, context: Path) -> "DockerIgnore":
        path = context / ".dockerignore"
        if not path.is_file():
            return cls([])
        lines = path.read_text(encoding="utf-8-sig").splitlines()
        return cls([line for line in lines if line.strip() and not line.lstrip().startswith("#")])

    def excluded(self, relpath: str) -> bool:
        if relpath in ("", "."):
            return False
        parts = relpath.split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for negated, regex in self.rules:
            if any(regex.match(p) for p in prefixes):
                result = not negated
        return result


class BuildContext:
    """The directory COPY sources are relative to, with its ignore rules."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ContextError(f"the build context {root} is not a directory")
        self.ignore = DockerIgnore.of(self.root)

    def _relative(self, path: Path) -> str:
        rel = path.relative_to(self.root).as_posix()
        return "" if rel == "." else rel

    def sources(self, src: str) -> list[Path]:
        """The paths ``src`` names: itself, or what its glob matches (``**`` and
        dot-files too); ignored paths left out; ContextError when nothing is left."""
        clean = posixpath.normpath(src)
        if posixpath.isabs(clean) or clean.split("/")[0] == "..":
            raise ContextError(f"COPY source {src!r} is outside the build context")
        if GLOB_CHARS.search(clean):
            found = sorted(p for p in self.root.glob(clean))
        else:
            path = self.root / clean
            found = [path] if path.exists() or path.is_symlink() else []
        kept = [p for p in found if not self.ignore.excluded(self._relative(p))]
        if not kept:
            why = " (all of it is in .dockerignore)" if found else ""
            raise ContextError(f"COPY {src}: no such file or directory in {self.root}{why}")
        return kept

    def entries(self, src: str) -> list[Entry]:
        """Every file, directory and symlink ``src`` sends, in path order (directories
        walked without following symlinks; sockets and devices skipped)."""
        seen: dict[str, Entry] = {}

        def add(path: Path) -> None:
            rel = self._relative(path)
            st = path.lstat()
            if rel and not self.ignore.excluded(rel) and (
                    stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                seen[rel] = Entry(rel, path, st)

        for top in self.sources(src):
            add(top)
            if top.is_symlink() or not top.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(top):
                here = Path(dirpath)
                keep = []
                for name in sorted(dirnames):
                    child = here / name
                    add(child)
                    # an excluded directory is still walked when a '!' rule may bring parts back
                    if not child.is_symlink() and (self.ignore.has_exceptions
                                                   or not self.ignore.excluded(self._relative(child))):
                        keep.append(name)
                dirnames[:] = keep
                for name in filenames:
                    add(here / name)
        return [seen[k] for k in sorted(seen)]


def files_hash(src: str, dest: str, entries: list[Entry]) -> str:
    """The COPY step's ``filesHash`` (see the module docstring)."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for e in entries:
        h.update(b"\0" + e.relpath.encode() + b"\0" + str(e.st.st_mode).encode())
        if e.is_dir:
            continue
        h.update(b"\0" + str(e.st.st_size).encode() + b"\0")
        if stat.S_ISLNK(e.st.st_mode):
            h.update(os.readlink(e.path).encode())
        else:
            with open(e.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_archive(entries: list[Entry], out: BinaryIO) -> None:
    """The gzipped tar of ``entries`` into ``out``."""
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for e in entries:
            tar.add(e.path, arcname=e.relpath, recursive=False, filter=_anonymous)
