"""Snapshot stores of a node: where the files of the snapshots it takes live, and how a
node that did not take one gets it.

- ``posix_fs`` (``base.PosixFsStore``): under AENV_HOME/snapshots, only on this node;
- ``s3`` (``s3.S3Store``): also uploaded as content-addressed chunks (``chunks``), so any
  node can restore it, downloading into a bounded cache (``cache``) or mounting it from
  lazily filled files (``lazy``, the node's chunkfs daemon).
``get_store()`` is the one the node's settings choose."""
from __future__ import annotations

from pathlib import Path

from agent.stores.base import PosixFsStore, SnapshotStore, SnapshotStoreError

_S3_STORES: dict = {}


def get_store() -> SnapshotStore:
    """The store configured for this process (``AENV_SNAPSHOT_BACKEND``, default posix_fs)."""
    from django.conf import settings  # noqa: PLC0415

    kind = backend_name()
    if kind == "posix_fs":
        return PosixFsStore(Path(settings.AENV_HOME) / "snapshots")
    if kind == "s3":
        from agent.stores.lazy import lazy_enabled  # noqa: PLC0415
        from agent.stores.s3 import S3Store  # noqa: PLC0415  (boto3 only when used)

        config = dict(home=Path(settings.AENV_HOME), images_dir=Path(settings.AENV_IMAGES_DIR),
                      bucket=settings.AENV_S3_BUCKET, endpoint=settings.AENV_S3_ENDPOINT,
                      region=settings.AENV_S3_REGION, prefix=settings.AENV_S3_PREFIX,
                      concurrency=settings.AENV_S3_CONCURRENCY,
                      cache_limit_bytes=settings.AENV_SNAPSHOT_CACHE_MB << 20,
                      lazy=lazy_enabled(settings.AENV_LAZY_RESTORE), chunk_cache_mb=settings.AENV_CHUNK_CACHE_MB,
                      chunk_read_deadline=settings.AENV_CHUNK_READ_DEADLINE,
                      chunk_compression=_compression(settings.AENV_S3_CHUNK_COMPRESSION))
        key = tuple(sorted((k, str(v)) for k, v in config.items()))
        if key not in _S3_STORES:  # a boto3 client is slow to make and thread-safe to share
            _S3_STORES[key] = S3Store(**config)
        return _S3_STORES[key]
    raise SnapshotStoreError(f"unknown snapshot backend {kind!r} (AENV_SNAPSHOT_BACKEND: 'posix_fs' or 's3')")


def _compression(value: str) -> str | None:
    from chunkfs.compression import codec_setting  # noqa: PLC0415

    try:
        return codec_setting(value)
    except ValueError as exc:
        raise SnapshotStoreError(str(exc)) from None


def backend_name() -> str:
    """``posix_fs`` or ``s3``: whether a snapshot can only be restored where it was taken."""
    from django.conf import settings  # noqa: PLC0415

    return getattr(settings, "AENV_SNAPSHOT_BACKEND", None) or "posix_fs"
