"""Where a snapshot's files live, behind a small interface.

The driver captures into a local directory and restores from one. A store decides
where that directory is and what happens around it; the node tasks never change:

- ``posix_fs`` (default): the files stay node-local under ``AENV_HOME/snapshots/<id>/``;
  only the node that took a snapshot can restore it.
- ``s3`` (``agent.stores.s3.S3Store``, ``AENV_SNAPSHOT_BACKEND=s3``): the same local copy,
  plus ``commit`` uploads it as content-addressed chunks to ``AENV_S3_BUCKET``; on a
  node that lacks the files ``local_dir`` downloads them into a bounded LRU cache
  (``AENV_HOME/cache/snapshots/<id>/``, ``AENV_SNAPSHOT_CACHE_MB``) and re-points
  their paths, so any node with the same image build can restore."""
from __future__ import annotations

import abc
import re
import shutil
from pathlib import Path

from agent.stores.chunks import allocated_bytes

SNAPSHOT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


class SnapshotStoreError(Exception):
    """The store cannot serve this snapshot (bad id, files missing)."""


def _checked(snapshot_id: str) -> str:
    """Ids become directory names: never a slash, dot-dot or anything odd."""
    if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.match(snapshot_id):
        raise SnapshotStoreError(f"invalid snapshot id {snapshot_id!r}")
    return snapshot_id


def complete_ids(root: Path) -> list[str]:
    """Ids of the complete snapshot directories (with their manifest) under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if SNAPSHOT_ID.match(p.name) and (p / "manifest.json").is_file())


class SnapshotStore(abc.ABC):
    """One snapshot repository. Methods run on the node that holds or takes the files."""

    name: str

    @abc.abstractmethod
    def prepare(self, snapshot_id: str) -> Path:
        """A new, empty local directory for the driver to capture into."""

    def commit(self, snapshot_id: str) -> None:
        """Called once the capture in ``prepare``'s directory is complete."""

    @abc.abstractmethod
    def local_dir(self, snapshot_id: str, *, pending_wait: float = 0.0) -> Path:
        """The local directory holding the complete snapshot (for a restore). ``pending_wait``
        (s): it may be a capture handed over before its upload ended (``index``), waited for
        up to that long; a store that never hands captures over (``hands_over``) ignores it."""

    def index(self, snapshot_id: str) -> dict:
        """Hands a capture to other nodes before its upload (a fork's early hand-off); only a
        store that ``hands_over`` can. Returns {"chunks", "bytes"}."""
        raise SnapshotStoreError(f"the {self.name} store cannot hand a capture over before it is stored")

    @abc.abstractmethod
    def size_bytes(self, snapshot_id: str) -> int:
        """Bytes the snapshot really occupies (sparse files count their allocated blocks)."""

    @abc.abstractmethod
    def delete(self, snapshot_id: str) -> bool:
        """Removes every file of the snapshot; False if there was nothing."""

    def local_ids(self) -> list[str]:
        """The snapshots whose complete files are on this node now (its own captures and,
        for a shared store, its cache): the heartbeat reports them so placement can send
        a restore where no download is needed."""
        return []

    def drop_local(self, snapshot_id: str) -> None:
        """Frees this node's copy of a committed snapshot that other nodes fetch from a
        shared store (nothing to do where the node's copy is the only one)."""

    def chunk_cache_figures(self) -> dict | None:
        """The node's chunk cache figures for the heartbeat and /metrics (lazy restores only)."""
        return None

    def restored(self, snapshot_id: str) -> None:
        """Called once a VM restored from the snapshot answers (a lazily restored one
        then records which chunks a restore reads first: agent.stores.lazy)."""

    def hands_over(self) -> bool:
        """Whether a capture here can be handed to other nodes before its upload ends (``index``)
        and this node can restore one so handed (``local_dir(..., pending_wait=)``)."""
        return False

    def take_mount_timings(self, snapshot_id: str) -> dict[str, float]:
        """The steps (ms) of the lazy mount the last ``local_dir`` of ``snapshot_id`` made, once;
        {} where it made none (no lazy restores here)."""
        return {}


class PosixFsStore(SnapshotStore):
    """Snapshots as plain directories on the node's filesystem."""

    name = "posix_fs"

    def __init__(self, root: Path):
        self.root = Path(root).absolute()

    def _dir(self, snapshot_id: str) -> Path:
        return self.root / _checked(snapshot_id)

    def prepare(self, snapshot_id: str) -> Path:
        path = self._dir(snapshot_id)
        self.root.mkdir(parents=True, exist_ok=True)
        path.mkdir()  # FileExistsError: never capture over another snapshot
        return path

    def local_dir(self, snapshot_id: str, *, pending_wait: float = 0.0) -> Path:
        path = self._dir(snapshot_id)
        if not (path / "manifest.json").is_file():
            raise SnapshotStoreError(f"snapshot {snapshot_id} has no files on this node ({path})")
        return path

    def size_bytes(self, snapshot_id: str) -> int:
        return allocated_bytes(self._dir(snapshot_id))

    def local_ids(self) -> list[str]:
        return complete_ids(self.root)

    def delete(self, snapshot_id: str) -> bool:
        path = self._dir(snapshot_id)
        if not path.exists():
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
