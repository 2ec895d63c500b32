"""``aenv upload`` / ``aenv download``: files and directory trees between here and a
sandbox, over envd's ``/files`` (streamed, never whole in memory) and its Filesystem
RPCs (``Stat``, ``ListDir``, ``MakeDir``, ``Move``, ``Remove``), with a progress bar on
a terminal.

Where things land follows ``cp -r``: a destination ending in ``/`` or naming an
existing directory receives the source under its own name; otherwise the source takes
the destination's name. Nothing half-written is ever under its final name: each file
goes to a hidden temporary name beside it and is renamed once complete, and an
interrupted or failed transfer removes its temporary file. Symlinks and special files
are refused before anything moves (a link's meaning does not survive the copy).
Downloads never replace a local file without ``--force``; directories merge."""
from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from envd_client import EnvdClient, EnvdError
from envd_client.answers import EntryInfo

from . import errors, output
from .api import check, client, segment
from .config import Config
from .errors import CliError

LIST_DEPTH = 100  # levels of a remote tree listed in one ListDir
STREAM_IDLE = 60.0  # seconds without a byte before a transfer counts as stalled


def sandbox_envd(config: Config, sandbox_id: str) -> EnvdClient:
    with client(config) as api:
        token = check(api.get(f"/sandboxes/{segment(sandbox_id)}")).json().get("envdAccessToken")
    return EnvdClient.through_proxy(config.sandbox_url, sandbox_id, token, stream_idle_timeout=STREAM_IDLE,
                                    timeout=STREAM_IDLE)


def _stat_or_none(envd: EnvdClient, path: str, user: str | None) -> EntryInfo | None:
    try:
        return envd.stat(path, user=user)
    except EnvdError as exc:
        if exc.code == "not_found":
            return None
        raise


def _hidden_twin(path: str, kind: str) -> str:
    """A temporary name beside ``path`` (same directory, so the final rename is atomic)."""
    head, name = posixpath.split(path)
    return posixpath.join(head, f".{name}.aenv-{kind}-{secrets.token_hex(4)}")


# --------------------------------------------------------------------------- upload


@dataclass(frozen=True)
class LocalTree:
    dirs: list[Path]    # relative, parents first
    files: list[Path]   # relative
    size: int


def local_tree(root: Path) -> LocalTree:
    """The directories and files under ``root``; CliError at the first symlink or special file."""
    dirs, files, total = [], [], 0
    for current, subdirs, names in os.walk(root, followlinks=False):
        subdirs.sort()
        here = Path(current)
        for name in sorted(subdirs + names):
            path = here / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise CliError(f"symbolic links are not supported: {path}", errors.USAGE)
            if stat.S_ISDIR(mode):
                dirs.append(path.relative_to(root))
            elif stat.S_ISREG(mode):
                files.append(path.relative_to(root))
                total += os.lstat(path).st_size
            else:
                raise CliError(f"special files are not supported: {path}", errors.USAGE)
    return LocalTree(dirs, sorted(files), total)


def upload_one(envd: EnvdClient, source: Path, dest: str, user: str | None, progress: output.Progress) -> str:
    """Sends ``source`` to ``dest`` by way of a hidden twin; the final absolute path."""
    twin = _hidden_twin(dest, "upload")
    progress.describe(source.name)
    try:
        envd.upload_file(twin, source, user=user, on_chunk=progress.advance)
        return envd.move(twin, dest, user=user).path
    except BaseException:
        with contextlib.suppress(Exception):
            envd.remove(twin, user=user)
        raise


def _make_dir(envd: EnvdClient, path: str, user: str | None) -> str:
    try:
        return envd.make_dir(path, user=user).path
    except EnvdError as exc:
        if exc.code != "already_exists":
            raise
    entry = envd.stat(path, user=user)
    if entry.type != "dir" or entry.is_symlink:
        raise CliError(f"remote path exists and is not a directory: {path}", errors.CONFLICT)
    return entry.path


def local_source_mode(source: Path) -> int:
    """The mode of a local file or directory to send: a missing path, a symlink or anything
    else is refused (the sandbox upload's and the volume put's one rule)."""
    try:
        mode = os.lstat(source).st_mode
    except FileNotFoundError:
        raise CliError(f"no such file or directory: {source}", errors.NOT_FOUND) from None
    if stat.S_ISLNK(mode):
        raise CliError(f"symbolic links are not supported: {source}", errors.USAGE)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise CliError(f"not a regular file or directory: {source}", errors.USAGE)
    return mode


def upload_destination(remote: str, name: str, *, into: bool, exists: bool, tree: bool) -> str:
    """Where an upload of ``name`` lands (the sandbox upload's and the volume put's one rule):
    under its own name ``into`` a directory, else at ``remote`` itself; a tree never replaces
    an existing non-directory."""
    if into:
        return posixpath.join(remote, name)
    if exists and tree:
        raise CliError(f"remote destination exists and is not a directory: {remote}", errors.CONFLICT)
    return remote


def cmd_upload(args, config: Config) -> int:
    source = Path(args.local_path)
    mode = local_source_mode(source)
    remote = args.remote_path
    if not remote:
        raise CliError("the remote destination is empty", errors.USAGE)
    name = source.resolve().name
    tree = local_tree(source) if stat.S_ISDIR(mode) else None
    with sandbox_envd(config, args.sandbox_id) as envd:
        existing = None if remote.endswith("/") else _stat_or_none(envd, remote, args.user)
        dest = upload_destination(remote, name, into=remote.endswith("/") or getattr(existing, "type", "") == "dir",
                                  exists=existing is not None, tree=tree is not None)
        if tree is None:
            with output.Progress(os.path.getsize(source), "Uploading", quiet=args.quiet) as progress:
                final = upload_one(envd, source, dest, args.user, progress)
            print(f"Uploaded {source} to {args.sandbox_id}:{final}", flush=True)
            return 0
        root = _make_dir(envd, dest, args.user)
        for rel in tree.dirs:
            _make_dir(envd, posixpath.join(root, rel.as_posix()), args.user)
        with output.Progress(tree.size, "Uploading", quiet=args.quiet) as progress:
            for rel in tree.files:
                upload_one(envd, source / rel, posixpath.join(root, rel.as_posix()), args.user, progress)
    print(f"Uploaded directory {source} to {args.sandbox_id}:{root} ({len(tree.files)} files, "
          f"{output.size(tree.size)})", flush=True)
    return 0


# --------------------------------------------------------------------------- download


def download_one(envd: EnvdClient, entry: EntryInfo, dest: Path, *, force: bool, user: str | None,
                 progress: output.Progress) -> None:
    """Fetches ``entry`` into ``dest`` (``land_file``)."""
    progress.describe(entry.name)
    land_file(dest, lambda sink: envd.download_file(entry.path, sink, user=user, on_chunk=progress.advance),
              force=force, mode=entry.mode)


def land_file(dest: Path, fetch, *, force: bool, mode: int | None = None) -> None:
    """Writes what ``fetch(sink)`` writes into a hidden twin of ``dest``, then gives it
    ``dest``'s name (never over an existing file unless ``force``); also ``aenv volume get``'s."""
    fd, twin = tempfile.mkstemp(prefix=f".{dest.name}.aenv-download-", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as sink:
            fetch(sink)
        if mode:
            os.chmod(twin, mode & 0o777)
        if force:
            os.replace(twin, dest)
        else:
            try:
                os.link(twin, dest)  # fails if something appeared there meanwhile
            except FileExistsError:
                raise CliError(f"local file exists: {dest}; --force replaces it", errors.CONFLICT) from None
            os.unlink(twin)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(twin)
        raise


def local_destination(local: str, name: str) -> Path:
    dest = Path(local)
    if local.endswith(("/", os.sep)) or dest.is_dir():
        dest = dest / name
    if dest.is_symlink():
        raise CliError(f"the local destination is a symbolic link: {dest}", errors.USAGE)
    if not dest.parent.is_dir():
        raise CliError(f"the local directory does not exist: {dest.parent}", errors.NOT_FOUND)
    return dest


def check_file_target(dest: Path, force: bool) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_file()):
        raise CliError(f"local path exists and is not a regular file: {dest}", errors.CONFLICT)
    if dest.exists() and not force:
        raise CliError(f"local file exists: {dest}; --force replaces it", errors.CONFLICT)


def prepare_tree(dest: Path, dirs: list[str], files: list[str], force: bool) -> None:
    """Checks that nothing local is in the way of a tree of relative ``dirs`` and ``files``
    landing at ``dest`` (CliError before anything moves), then makes its directories."""
    if dest.exists() and (dest.is_symlink() or not dest.is_dir()):
        raise CliError(f"local path exists and is not a directory: {dest}", errors.CONFLICT)
    for rel in dirs:
        target = dest / rel
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise CliError(f"local path exists and is not a directory: {target}", errors.CONFLICT)
    for rel in files:
        check_file_target(dest / rel, force)
    dest.mkdir(exist_ok=True)
    for rel in dirs:
        (dest / rel).mkdir(parents=True, exist_ok=True)


def remote_tree(envd: EnvdClient, root: EntryInfo, user: str | None) -> tuple[list[str], list[EntryInfo]]:
    """(directories, files) under ``root``, relative dirs and file entries; CliError at
    a symlink or special file."""
    dirs, files = [], []
    for entry in envd.list_dir(root.path, LIST_DEPTH, user=user):
        rel = posixpath.relpath(entry.path, root.path)
        if entry.is_symlink:
            raise CliError(f"symbolic links are not supported: {entry.path}", errors.USAGE)
        if entry.type == "dir":
            dirs.append(rel)
        elif entry.type == "file":
            files.append(entry)
        else:
            raise CliError(f"special files are not supported: {entry.path}", errors.USAGE)
    return dirs, files


def cmd_download(args, config: Config) -> int:
    with sandbox_envd(config, args.sandbox_id) as envd:
        entry = _stat_or_none(envd, args.remote_path, args.user)
        if entry is None:
            raise CliError(f"remote path does not exist: {args.remote_path}", errors.NOT_FOUND)
        name = posixpath.basename(entry.path.rstrip("/")) or "root"
        dest = local_destination(args.local_path, name)
        if entry.type == "file":
            check_file_target(dest, args.force)
            with output.Progress(entry.size, "Downloading", quiet=args.quiet) as progress:
                download_one(envd, entry, dest, force=args.force, user=args.user, progress=progress)
            print(f"Downloaded {args.sandbox_id}:{entry.path} to {dest}", flush=True)
            return 0
        if entry.type != "dir":
            raise CliError(f"not a regular file or directory: {entry.path}", errors.USAGE)
        dirs, files = remote_tree(envd, entry, args.user)
        prepare_tree(dest, dirs, [posixpath.relpath(file.path, entry.path) for file in files], args.force)
        total = sum(f.size for f in files)
        with output.Progress(total, "Downloading", quiet=args.quiet) as progress:
            for file in files:
                download_one(envd, file, dest / posixpath.relpath(file.path, entry.path), force=args.force,
                             user=args.user, progress=progress)
    print(f"Downloaded directory {args.sandbox_id}:{entry.path} to {dest} ({len(files)} files, "
          f"{output.size(total)})", flush=True)
    return 0

