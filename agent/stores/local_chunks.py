"""Chunks this node already has on disk, by digest, so a download from the S3 store reads
them locally instead of fetching them.

Why: a pause image or snapshot is self-contained (its template's base disk, layers and
RAM travel with it), which is what lets any node restore it; but the node that restores it
usually has most of those bytes already: the same image build (an OCI image's disk is
byte-reproducible, so equal content means equal chunks), the same template snapshot, an
earlier download. Every file under the given roots is cut at the store's chunk offsets and
hashed once (a guest RAM file at the RAM chunk size, as the store cuts it); the index is kept
per file under ``index_dir`` and trusted only while the file's size, mtime and chunk size are
unchanged. A chunk read from disk is hashed again before it is used, so a file that changed
since cannot put wrong bytes into a download.

The same index tells the node's chunkfs daemon which chunks it may give peer nodes from these
files (``files``: peer fetch, ``chunkfs.own_files``)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from agent.stores.chunks import CHUNK_SIZE, RAM_CHUNK_SIZE, chunk_size_for, chunk_spans, digest, read_chunk

log = logging.getLogger(__name__)

# what snapshots are made of: disks (qcow2 layers, raw drives) and guest RAM
SOURCE_SUFFIXES = (".qcow2", ".img", ".ram")
SKIP_DIRS = {"stages"}  # image build intermediates (whole root filesystem trees)


def content_digest(size: int, chunk_size: int, chunks: list[list]) -> str:
    """A file's identity from its chunk list (zero chunks are holes, so the size counts too)."""
    return hashlib.sha256(json.dumps([size, chunk_size, chunks]).encode()).hexdigest()


class LocalChunks:
    def __init__(self, roots: list[Path], index_dir: Path, chunk_size: int = CHUNK_SIZE,
                 ram_chunk_size: int | None = None, indexed_roots=None):
        """``indexed_roots``: a callable giving more directories each time the index is built,
        whose files count only once their writer saved their chunk list (``remember``; the
        node's snapshot captures, which a commit hashes anyway): never hashed here, so a capture
        nobody committed costs a lookup nothing."""
        self.roots = [Path(r) for r in roots]
        self.indexed_roots = indexed_roots
        self.index_dir = Path(index_dir)
        self.chunk_size = chunk_size
        self.ram_chunk_size = ram_chunk_size or min(RAM_CHUNK_SIZE, chunk_size)
        self._where: dict[str, tuple[Path, int, int]] | None = None
        self._by_file: dict[str, list[list]] = {}
        self._lock = threading.Lock()

    def _files(self):
        """(path, may it be hashed here) of every file the index covers."""
        indexed = [Path(r) for r in self.indexed_roots()] if self.indexed_roots is not None else []
        for path in self._walk(self.roots):
            yield path, True
        for path in self._walk(indexed, every_file=True):
            yield path, False

    def _walk(self, roots: list[Path], every_file: bool = False):
        """Files under ``roots`` that snapshots are made of (``every_file``: all of them, a
        device state too: nothing is hashed for them here)."""
        for root in roots:
            if not root.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
                for name in filenames:
                    path = Path(dirpath) / name
                    if name.startswith(".") or path.is_symlink() or not (every_file or name.endswith(SOURCE_SUFFIXES)):
                        continue
                    try:
                        if every_file or path.stat().st_size >= self.chunk_size_for(path):
                            yield path
                    except OSError:
                        continue

    def chunk_size_for(self, path: Path) -> int:
        """The chunk size the store cuts this file at (guest RAM smaller)."""
        return chunk_size_for(Path(path).name, self.chunk_size, self.ram_chunk_size)

    def file_chunks(self, path: Path) -> list[list]:
        """``[[offset, length, digest], ...]`` of the file's non-zero chunks, in order, from
        its saved index while the file is unchanged (same size and mtime), else hashed now."""
        path = Path(path)
        chunks = self._saved_chunks(path)
        if chunks is not None:
            return chunks
        st = path.stat()
        chunk_size = self.chunk_size_for(path)
        stamp = self._stamp(path, st, chunk_size)
        saved = self._saved(path)
        chunks = []
        for chunk in chunk_spans(path, chunk_size):
            data = read_chunk(path, chunk)
            if data is not None:
                chunks.append([chunk.offset, chunk.length, digest(data)])
        self._save(saved, stamp, chunks)
        return chunks

    def _saved_chunks(self, path: Path) -> list[list] | None:
        """The file's saved chunk list while the file is as it was then, else None."""
        stamp = self._stamp(path, path.stat(), self.chunk_size_for(path))
        try:
            doc = json.loads(self._saved(path).read_text())
        except (OSError, ValueError):
            return None
        if isinstance(doc, dict) and {k: doc.get(k) for k in stamp} == stamp and isinstance(doc.get("chunks"), list):
            return doc["chunks"]
        return None

    def remember(self, path: Path, chunks: list[list], st: os.stat_result) -> None:
        """Saves a file's chunk list that its writer just computed (a commit hashes every
        chunk of a capture it uploads), so indexing it never reads it again. ``st``: the
        file's stat from before it was read: a file that changed since is hashed anew."""
        path = Path(path)
        self._save(self._saved(path), self._stamp(path, st, self.chunk_size_for(path)), chunks)

    def forget(self, directory: Path) -> None:
        """Drops the saved chunk lists of the files in ``directory`` (about to be deleted)."""
        try:
            names = [p for p in Path(directory).iterdir() if p.is_file()]
        except OSError:
            return
        for path in names:
            self._saved(path).unlink(missing_ok=True)

    @staticmethod
    def _stamp(path: Path, st: os.stat_result, chunk_size: int) -> dict:
        return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "chunk_size": chunk_size}

    def _saved(self, path: Path) -> Path:
        return self.index_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")

    def _save(self, saved: Path, stamp: dict, chunks: list[list]) -> None:
        self.index_dir.mkdir(parents=True, exist_ok=True)
        tmp = saved.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({**stamp, "chunks": chunks}))
        os.replace(tmp, saved)

    def file_digest(self, path: Path) -> tuple[str, int, list[list]]:
        """The file's content identity: (digest of its size and chunk list, size, chunks).
        Two files with equal bytes have equal digests, whatever their paths or dates."""
        chunks = self.file_chunks(path)
        size = Path(path).stat().st_size
        return content_digest(size, self.chunk_size_for(path), chunks), size, chunks

    def _build(self) -> dict[str, tuple[Path, int, int]]:
        where: dict[str, tuple[Path, int, int]] = {}
        by_file: dict[str, list[list]] = {}
        for path, hash_here in self._files():
            try:
                chunks = self.file_chunks(path) if hash_here else self._saved_chunks(path)
            except OSError as exc:  # gone or unreadable meanwhile: just not a source
                log.debug("local chunks: skipping %s: %s", path, exc)
                continue
            if chunks is None:  # changed since its writer indexed it, or never indexed
                continue
            by_file[str(path)] = chunks
            for offset, length, sha in chunks:
                where.setdefault(sha, (path, offset, length))
        self._by_file = by_file
        return where

    def files(self) -> dict[str, list[list]]:
        """``{path: [[offset, length, sha], ...]}`` of every indexed file, the index built
        afresh (files came and went): what the node may give peers from its own files."""
        with self._lock:
            self._where = self._build()
            return dict(self._by_file)

    def refresh(self) -> None:
        """Forget the index (files were added or removed); it is rebuilt on the next lookup."""
        with self._lock:
            self._where = None

    def locate(self, chunks) -> dict[str, list]:
        """``{sha: [path, offset]}`` of those of ``chunks`` (``[offset, length, sha]`` entries)
        that a local file holds, unverified: for a reader that checks digests itself (chunkfs)."""
        with self._lock:
            if self._where is None:
                self._where = self._build()
            where = self._where
        found = {}
        for _, length, sha in chunks:
            hit = where.get(sha)
            if hit is not None and hit[2] == length:
                found[sha] = [str(hit[0]), int(hit[1])]
        return found

    def read(self, sha: str, length: int) -> bytes | None:
        """The chunk's bytes from a local file, verified, or None when no local file has it."""
        with self._lock:
            if self._where is None:
                self._where = self._build()
            found = self._where.get(sha)
        if found is None:
            return None
        path, offset, size = found
        if size != length:
            return None
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        except OSError:
            return None
        return data if len(data) == length and digest(data) == sha else None
