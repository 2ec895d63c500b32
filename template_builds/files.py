"""Uploaded COPY archives: where they live, how an upload is checked, and the signed URLs
the SDK uploads them to.

Layout: one object per (team, files hash), ``template-files/<team id>/<hash>.tar``
(E2B's layout; the name ends in ``.tar`` whatever the compression), next to the
snapshots of the configured backend (``AENV_SNAPSHOT_BACKEND``):

- ``posix_fs``: under ``AENV_HOME/template-files/`` on the API's machine, which a
  single-machine install shares with its node;
- ``s3``: in ``AENV_S3_BUCKET`` under ``AENV_S3_PREFIX``, so a builder on any node
  fetches it.

The API writes (``save``: a complete, checked file, moved or uploaded whole, so two
concurrent uploads of one hash both succeed and leave one good copy); a node's builder
reads (``fetch``). The control plane never imports the node agent, so this module has
its own small S3 client and no snapshot-store machinery.

The upload URL carries its own authorisation (the SDK's PUT sends no API key): a token
signed with the server's secret naming the team and the hash, valid for
``AENV_TEMPLATE_UPLOAD_URL_TTL`` seconds."""
from __future__ import annotations

import abc
import gzip as gziplib
import os
import re
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core import signing

HASH = re.compile(r"^[0-9a-f]{64}$")
UPLOAD_SALT = "aenv.template_builds.upload"
GZIP_MAGIC = b"\x1f\x8b"


class InvalidArchive(ValueError):
    """An upload that is not a tar (gzipped or plain) aenv will unpack; says why."""


class FileStoreError(Exception):
    """The store cannot keep or return a file."""


def _relative(team_id, files_hash: str) -> str:
    """``<team id>/<hash>.tar``; never anything a path could escape with."""
    if not isinstance(files_hash, str) or not HASH.match(files_hash):
        raise FileStoreError(f"invalid files hash {files_hash!r}")
    return f"{uuid.UUID(str(team_id))}/{files_hash}.tar"


class FileStore(abc.ABC):
    name: str

    @abc.abstractmethod
    def exists(self, team_id, files_hash: str) -> bool:
        """Whether the archive for (team, hash) is stored."""

    @abc.abstractmethod
    def save(self, team_id, files_hash: str, src: Path) -> None:
        """Stores the complete file ``src`` (consumed) as (team, hash), replacing any copy."""

    @abc.abstractmethod
    def fetch(self, team_id, files_hash: str, dest: Path) -> Path:
        """A local copy of the archive at ``dest`` (for a builder); FileStoreError if missing."""

    @abc.abstractmethod
    def delete(self, team_id, files_hash: str) -> bool:
        """Removes the archive; False if there was none."""

    def staging_dir(self) -> Path:
        """Where uploads are written before ``save``."""
        path = Path(settings.AENV_HOME) / "template-files" / ".incoming"
        path.mkdir(parents=True, exist_ok=True)
        return path


class PosixFileStore(FileStore):
    name = "posix_fs"

    def __init__(self, root: Path):
        self.root = Path(root).absolute()

    def path(self, team_id, files_hash: str) -> Path:
        return self.root / _relative(team_id, files_hash)

    def exists(self, team_id, files_hash: str) -> bool:
        return self.path(team_id, files_hash).is_file()

    def save(self, team_id, files_hash: str, src: Path) -> None:
        dest = self.path(team_id, files_hash)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)  # atomic: a reader sees the old or the new file, never half of one

    def fetch(self, team_id, files_hash: str, dest: Path) -> Path:
        src = self.path(team_id, files_hash)
        if not src.is_file():
            raise FileStoreError(f"no uploaded files for hash {files_hash}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        return dest

    def delete(self, team_id, files_hash: str) -> bool:
        try:
            self.path(team_id, files_hash).unlink()
            return True
        except FileNotFoundError:
            return False

    def staging_dir(self) -> Path:
        path = self.root / ".incoming"
        path.mkdir(parents=True, exist_ok=True)
        return path


class S3FileStore(FileStore):
    name = "s3"

    def __init__(self, bucket: str, prefix: str = "", endpoint: str = "", region: str = ""):
        if not bucket:
            raise FileStoreError("AENV_SNAPSHOT_BACKEND=s3 needs AENV_S3_BUCKET")
        import boto3  # noqa: PLC0415 - only where s3 is used
        from botocore.config import Config  # noqa: PLC0415

        self.bucket, self.prefix = bucket, prefix
        config = Config(retries={"max_attempts": 5, "mode": "standard"},
                        s3={"addressing_style": "path"} if endpoint else None)
        self.client = boto3.client("s3", endpoint_url=endpoint or None, region_name=region or None, config=config)

    def _object(self, team_id, files_hash: str) -> str:
        return f"{self.prefix}template-files/{_relative(team_id, files_hash)}"

    def exists(self, team_id, files_hash: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object(team_id, files_hash))
            return True
        except Exception as exc:  # botocore ClientError
            if str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise FileStoreError(f"cannot reach the file store: {exc}") from exc

    def save(self, team_id, files_hash: str, src: Path) -> None:
        try:
            self.client.upload_file(str(src), self.bucket, self._object(team_id, files_hash))
        except Exception as exc:
            raise FileStoreError(f"cannot store the upload: {exc}") from exc
        finally:
            Path(src).unlink(missing_ok=True)

    def fetch(self, team_id, files_hash: str, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not self.exists(team_id, files_hash):
            raise FileStoreError(f"no uploaded files for hash {files_hash}")
        self.client.download_file(self.bucket, self._object(team_id, files_hash), str(dest))
        return dest

    def delete(self, team_id, files_hash: str) -> bool:
        existed = self.exists(team_id, files_hash)
        self.client.delete_object(Bucket=self.bucket, Key=self._object(team_id, files_hash))
        return existed


_S3: dict = {}


def get_file_store() -> FileStore:
    """The store for this process's settings (``AENV_SNAPSHOT_BACKEND``)."""
    if (getattr(settings, "AENV_SNAPSHOT_BACKEND", "") or "posix_fs") == "s3":
        key = (settings.AENV_S3_BUCKET, settings.AENV_S3_PREFIX, settings.AENV_S3_ENDPOINT, settings.AENV_S3_REGION)
        if key not in _S3:  # a boto3 client is slow to make and thread-safe to share
            _S3[key] = S3FileStore(*key)
        return _S3[key]
    return PosixFileStore(Path(settings.AENV_HOME) / "template-files")


# --------------------------------------------------------------------------- checking


def check_archive(path: Path, max_unpacked: int) -> bool:
    """Reads the whole archive at ``path`` as the builder will: a tar, gzipped (sniffed by
    its magic bytes) or not, whose members are relative paths inside the archive (no
    ``..``), regular files, directories or links, unpacking to at most ``max_unpacked``
    bytes. Returns whether it is gzipped; InvalidArchive says what is wrong."""
    with open(path, "rb") as f:
        compressed = f.read(2) == GZIP_MAGIC
    total = 0
    try:
        with tarfile.open(path, mode="r|gz" if compressed else "r|") as tar:
            for member in tar:
                _check_member(member)
                total += max(member.size, 0)
                if total > max_unpacked:
                    raise InvalidArchive(f"the archive unpacks to more than {max_unpacked} bytes")
    except InvalidArchive:
        raise
    except (tarfile.TarError, EOFError, OSError, gziplib.BadGzipFile, ValueError) as exc:
        raise InvalidArchive(f"not a {'gzipped ' if compressed else ''}tar archive: {exc}") from None
    return compressed


def _check_member(member: tarfile.TarInfo) -> None:
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        raise InvalidArchive(f"archive member {member.name!r} is outside the build context")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise InvalidArchive(f"archive member {member.name!r} is not a file, directory or link")
    if member.islnk():
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or ".." in target.parts:
            raise InvalidArchive(f"hard link {member.name!r} points outside the archive")


def spool(chunks, staging: Path, max_bytes: int) -> tuple[Path, int]:
    """Writes the byte chunks of an upload to a new file in ``staging``; returns (path,
    size). InvalidArchive (and nothing left behind) past ``max_bytes``."""
    fd, name = tempfile.mkstemp(prefix="upload-", suffix=".part", dir=staging)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise InvalidArchive(f"the upload is larger than {max_bytes} bytes")
                out.write(chunk)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name), size


# --------------------------------------------------------------------------- upload URLs


def upload_token(team_id, files_hash: str, template_id: str = "") -> str:
    """A signed, timestamped token for PUTting (team, hash)'s archive (``template_id``: the
    template it was asked for, kept as a note)."""
    return signing.dumps([str(team_id), files_hash, template_id], salt=UPLOAD_SALT, compress=False)


def check_upload_token(token: str, files_hash: str, max_age: int) -> tuple[str, str]:
    """(team id, template id) the token was made for; raises signing.BadSignature
    (SignatureExpired when too old) or ValueError when it names another hash."""
    team_id, signed_hash, template_id = signing.loads(token, salt=UPLOAD_SALT, max_age=max_age)
    if signed_hash != files_hash:
        raise ValueError("the upload token is for another hash")
    return team_id, template_id
