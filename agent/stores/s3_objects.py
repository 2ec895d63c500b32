"""The S3 store's bucket: its object names, small reads and writes, and the release
half of the chunk reference scheme.

``S3Store`` (s3.py) decides what to upload and download; this is the layer under it
that knows where each object lives under ``AENV_S3_PREFIX`` and how a snapshot lets
go of its chunks and image files (a marker per user; the object goes with the last
marker). Apart so the store reads as the upload/download logic alone."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from chunkfs.compression import ZSTD, encode

from .base import SnapshotStoreError


def make_client(endpoint: str = "", region: str = "", concurrency: int = 8):
    """A boto3 S3 client; credentials come from the standard AWS sources."""
    import boto3  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415

    config = Config(max_pool_connections=max(10, concurrency), retries={"max_attempts": 5, "mode": "standard"},
                    s3={"addressing_style": "path"} if endpoint else None)
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region or None, config=config)


def is_missing(exc: Exception) -> bool:
    """``exc`` (from boto3) says the object does not exist."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3Objects:
    """One bucket and prefix, through ``self.s3`` (a boto3 client, replaceable). Chunks are
    uploaded compressed with ``chunk_compression`` (``chunkfs.compression``: ``zstd``, or None)."""

    def __init__(self, *, bucket: str, client=None, endpoint: str = "", region: str = "", prefix: str = "",
                 concurrency: int = 8, chunk_compression: str | None = ZSTD):
        if not bucket:
            raise SnapshotStoreError("the s3 snapshot store needs a bucket (AENV_S3_BUCKET)")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.concurrency = max(1, int(concurrency))
        self.chunk_compression = chunk_compression
        self.s3 = client or make_client(endpoint, region, self.concurrency)

    # ------------------------------------------------------------------ keys

    def manifest_key(self, snapshot_id: str) -> str:
        return f"{self.prefix}snapshots/{snapshot_id}/manifest.json"

    def pending_key(self, snapshot_id: str) -> str:
        """A capture's manifest handed to other nodes before its upload ended (``S3Store.index``)."""
        return f"{self.prefix}snapshots/{snapshot_id}/pending.json"

    def prefetch_key(self, snapshot_id: str) -> str:
        """The chunks a lazy restore of the snapshot read first, in order (agent.stores.lazy)."""
        return f"{self.prefix}snapshots/{snapshot_id}/prefetch.json"

    def prefetch_pieces_dir(self, snapshot_id: str) -> str:
        """Where a template's prefetch pieces are, under the prefix (the chunkfs daemon adds
        the prefix itself)."""
        return f"snapshots/{snapshot_id}/prefetch/"

    def prefetch_piece_key(self, snapshot_id: str, n: int) -> str:
        return f"{self.prefetch_pieces_dir(snapshot_id)}{int(n)}"

    def chunk_key(self, sha: str) -> str:
        return f"{self.prefix}chunks/{sha}"

    def ref_key(self, sha: str, snapshot_id: str) -> str:
        return f"{self.prefix}refs/{sha}/{snapshot_id}"

    def image_key(self, file_digest: str) -> str:
        return f"{self.prefix}images/{file_digest}.json"

    def image_user_key(self, file_digest: str, snapshot_id: str) -> str:
        return f"{self.prefix}image-users/{file_digest}/{snapshot_id}"

    def trash_key(self, snapshot_id: str) -> str:
        return f"{self.prefix}trash/{snapshot_id}.json"

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    # ------------------------------------------------------------------ small S3 helpers

    def _exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as exc:
            if is_missing(exc):
                return False
            raise

    def _get_json(self, key: str) -> dict | None:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:
            if is_missing(exc):
                return None
            raise
        return json.loads(body)

    def _put_json(self, key: str, doc: dict) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=json.dumps(doc, indent=1).encode(),
                           ContentType="application/json")

    def _put_chunk(self, sha: str, data: bytes) -> int:
        """Stores a chunk (compressed when that pays: ``chunkfs.compression``, which readers
        undo); returns the bytes sent."""
        body, metadata = encode(data, self.chunk_compression)
        self.s3.put_object(Bucket=self.bucket, Key=self.chunk_key(sha), Body=body, Metadata=metadata)
        return len(body)

    def _pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="aenv-s3")

    # ------------------------------------------------------------------ releasing

    def _delete_remote(self, snapshot_id: str) -> bool:
        """Removes a snapshot's manifest (kept at ``trash/<id>.json`` until its chunks and
        image files are released, so a repeated delete finishes an interrupted one), and a
        hand-off's pending manifest (``S3Store.index``)."""
        doc = self._get_json(self.manifest_key(snapshot_id))
        if doc is not None:
            self._put_json(self.trash_key(snapshot_id), doc)
            self.s3.delete_object(Bucket=self.bucket, Key=self.manifest_key(snapshot_id))
        else:
            doc = self._get_json(self.trash_key(snapshot_id))  # an interrupted delete
            if doc is None:  # a hand-off whose upload never finished: its image files' marks go
                doc = self._get_json(self.pending_key(snapshot_id))
                if doc is None:
                    return False
                self._put_json(self.trash_key(snapshot_id), doc)
        self.s3.delete_object(Bucket=self.bucket, Key=self.pending_key(snapshot_id))
        self._delete_prefetch(snapshot_id)
        shas = sorted({c[2] for f in doc.get("files", {}).values() for c in f.get("chunks", [])})
        with self._pool() as pool:
            list(pool.map(lambda sha: self._release(sha, snapshot_id), shas))
        for file_digest in sorted({i["digest"] for i in (doc.get("image_files") or {}).values()}):
            self._release_image(file_digest, snapshot_id)
        self.s3.delete_object(Bucket=self.bucket, Key=self.trash_key(snapshot_id))
        return True

    def _delete_prefetch(self, snapshot_id: str) -> None:
        """The prefetch list and its pieces (absent ones: no error)."""
        self.s3.delete_object(Bucket=self.bucket, Key=self.prefetch_key(snapshot_id))
        pieces = self.prefix + self.prefetch_pieces_dir(snapshot_id)
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=pieces):
            for item in page.get("Contents", []):
                self.s3.delete_object(Bucket=self.bucket, Key=item["Key"])

    def _release_image(self, file_digest: str, snapshot_id: str) -> None:
        """Drops this snapshot's use of an image file; with its last user the image goes:
        its index first (so no new snapshot relies on chunks about to go), then its chunks'
        markers, and each chunk nothing else marks."""
        self.s3.delete_object(Bucket=self.bucket, Key=self.image_user_key(file_digest, snapshot_id))
        left = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}image-users/{file_digest}/",
                                       MaxKeys=1)
        if left.get("KeyCount"):
            return
        image = self._get_json(self.image_key(file_digest))
        if image is None:
            return
        self.s3.delete_object(Bucket=self.bucket, Key=self.image_key(file_digest))
        owner = f"image-{file_digest[:32]}"
        with self._pool() as pool:
            list(pool.map(lambda sha: self._release(sha, owner), sorted({c[2] for c in image["chunks"]})))

    def _release(self, sha: str, snapshot_id: str) -> None:
        """Drops this snapshot's marker; the chunk goes when no marker is left."""
        self.s3.delete_object(Bucket=self.bucket, Key=self.ref_key(sha, snapshot_id))
        left = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}refs/{sha}/", MaxKeys=1)
        if not left.get("KeyCount"):
            self.s3.delete_object(Bucket=self.bucket, Key=self.chunk_key(sha))
