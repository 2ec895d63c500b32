"""``aenv volume ls | create | rm | mkdir | get | put``: the team's volumes (E2B's ``/volumes``)
and their files without a sandbox, through the volume content API (``/volumecontent/{id}/…``,
served by the API, authorized by the volume's own token that ``GET /volumes/{id}`` gives).

A volume is named by its name or its id. Where files land follows ``aenv upload`` /
``download`` (``aenv_cli.transfer``): a destination ending in ``/`` or naming a directory
receives the source under its own name; a local file appears under its name only once
complete and is never replaced without ``--force``; symlinks and special files are refused.
The server writes each file whole and atomically, so a remote file is never half there."""
from __future__ import annotations

import os
import posixpath
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from envd_client.protocol import tls_for

from . import __version__, errors, output
from .api import API_TIMEOUT, check, client, segment
from .config import Config
from .errors import ApiError, CliError

LIST_COLUMNS = ["NAME", "VOLUME ID"]
FILE_COLUMNS = ["TYPE", "SIZE", "MODE", "OWNER", "MODIFIED", "PATH"]
MAX_DEPTH = 32  # the content API's deepest listing
CHUNK = 1 << 20
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class VolumeRef:
    id: str
    name: str
    token: str


def find(api: httpx.Client, ref: str) -> VolumeRef:
    """The volume named ``ref`` (an id, else a name), with its content token."""
    volume_id = ref
    if not _UUID.match(ref):
        named = [v for v in check(api.get("/volumes")).json() if v.get("name") == ref]
        if not named:
            raise CliError(f"404: volume '{ref}' not found", errors.NOT_FOUND)
        volume_id = named[0]["volumeID"]
    body = check(api.get(f"/volumes/{segment(volume_id)}")).json()
    return VolumeRef(body["volumeID"], body["name"], body["token"])


@contextmanager
def content(config: Config, ref: str, timeout: float = API_TIMEOUT):
    """(volume, an httpx client on its content API): the token, never the API key, is sent."""
    with client(config) as api:
        volume = find(api, ref)
    with httpx.Client(base_url=f"{config.api_url.rstrip('/')}/volumecontent/{segment(volume.id)}",
                      timeout=timeout, verify=tls_for(config.api_url),
                      headers={"Authorization": f"Bearer {volume.token}",
                               "User-Agent": f"aenv-cli/{__version__}"}) as files:
        yield volume, files


def _remote(path: str) -> str:
    """A volume path as the content API takes it: absolute (``data/x`` is ``/data/x``)."""
    return "/" + path.strip("/") if path.strip("/") else "/"


def _stat(files: httpx.Client, path: str) -> dict | None:
    resp = files.get("/path", params={"path": path})
    if resp.status_code == 404:
        return None
    return check(resp).json()


# --------------------------------------------------------------------------- volumes


def cmd_ls(args, config: Config) -> int:
    """The team's volumes; with a VOLUME, the files under PATH (``--depth`` levels)."""
    if args.volume is None:
        with client(config) as api:
            rows = check(api.get("/volumes")).json()
        if output.wants_json(args):
            output.print_json(rows)
        else:
            output.print_table(LIST_COLUMNS, [[r.get("name"), r.get("volumeID")] for r in rows])
        return 0
    with content(config, args.volume) as (_, files):
        entries = check(files.get("/dir", params={"path": _remote(args.path), "depth": args.depth})).json()
    if output.wants_json(args):
        output.print_json(entries)
        return 0
    output.print_table(FILE_COLUMNS, [_file_row(e) for e in entries])
    return 0


def _file_row(e: dict) -> list:
    kind = {"directory": "dir", "symlink": "link"}.get(e.get("type"), e.get("type"))
    path = e.get("path", "") + ("/" if e.get("type") == "directory" else "")
    if e.get("type") == "symlink":
        path += f" -> {e.get('target', '?')}"
    return [kind, output.size(e.get("size")) if e.get("type") == "file" else "", f"{e.get('mode', 0):04o}",
            f"{e.get('uid')}:{e.get('gid')}", output.local_time(e.get("mtime")), path]


def cmd_create(args, config: Config) -> int:
    with client(config) as api:
        made = check(api.post("/volumes", json={"name": args.name})).json()
    if args.output == "json" or args.json:
        output.print_json({k: v for k, v in made.items() if k != "token"})
    else:
        print(made["volumeID"], flush=True)
    return 0


def cmd_rm(args, config: Config) -> int:
    """Deletes volumes by name or id; a volume a live sandbox or a snapshot mounts is a 409
    (exit 5), with the server's message naming them."""
    outcomes = output.Outcomes(args, key="volume")
    with client(config) as api:
        for ref in args.volumes:
            try:
                volume = find(api, ref)
                check(api.delete(f"/volumes/{segment(volume.id)}"))
            except ApiError as exc:
                outcomes.failed(ref, exc.status, exc.message.partition(": ")[2] or exc.message)
                continue
            except CliError as exc:
                outcomes.failed(ref, 404, exc.message.partition(": ")[2] or exc.message)
                continue
            outcomes.ok(ref, f"Deleted volume {volume.name} ({volume.id})")
    return outcomes.finish()


def cmd_mkdir(args, config: Config) -> int:
    with content(config, args.volume) as (volume, files):
        made = check(files.post("/dir", params={"path": _remote(args.path), "force": args.parents})).json()
    print(f"Made {volume.name}:{made['path']}", flush=True)
    return 0


# --------------------------------------------------------------------------- put


def _put(files: httpx.Client, source: Path, dest: str, progress: output.Progress) -> dict:
    """One local file to ``dest``, streamed with its length (the server writes it whole)."""
    size = os.path.getsize(source)
    progress.describe(source.name)

    def body():
        with open(source, "rb") as f:
            while chunk := f.read(CHUNK):
                progress.advance(len(chunk))
                yield chunk

    return check(files.put("/file", params={"path": dest}, content=body(),
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})).json()


def cmd_put(args, config: Config) -> int:
    from .transfer import local_source_mode, local_tree, upload_destination  # noqa: PLC0415 - the upload's rules

    source = Path(args.local_path)
    mode = local_source_mode(source)
    tree = local_tree(source) if stat.S_ISDIR(mode) else None
    name = source.resolve().name
    with content(config, args.volume, timeout=max(API_TIMEOUT, 600)) as (volume, files):
        remote = _remote(args.remote_path)
        existing = None if args.remote_path.endswith("/") else _stat(files, remote)
        into = args.remote_path.endswith("/") or remote == "/" or (existing or {}).get("type") == "directory"
        dest = upload_destination(remote, name, into=into, exists=existing is not None, tree=tree is not None)
        if tree is None:
            with output.Progress(os.path.getsize(source), "Uploading", quiet=args.quiet) as progress:
                entry = _put(files, source, dest, progress)
            print(f"Uploaded {source} to {volume.name}:{entry['path']}", flush=True)
            return 0
        check(files.post("/dir", params={"path": dest, "force": True}))
        for rel in tree.dirs:
            check(files.post("/dir", params={"path": posixpath.join(dest, rel.as_posix()), "force": True}))
        with output.Progress(tree.size, "Uploading", quiet=args.quiet) as progress:
            for rel in tree.files:
                _put(files, source / rel, posixpath.join(dest, rel.as_posix()), progress)
    print(f"Uploaded directory {source} to {volume.name}:{dest} ({len(tree.files)} files, "
          f"{output.size(tree.size)})", flush=True)
    return 0


# --------------------------------------------------------------------------- get


def _get(files: httpx.Client, entry: dict, dest: Path, force: bool, progress: output.Progress) -> None:
    from .transfer import land_file  # noqa: PLC0415 - the downloads' hidden twin and rename

    progress.describe(entry["name"])

    def fetch(sink) -> None:
        with files.stream("GET", "/file", params={"path": entry["path"]}) as resp:
            if resp.status_code >= 400:
                resp.read()
                check(resp)
            for chunk in resp.iter_bytes(CHUNK):
                sink.write(chunk)
                progress.advance(len(chunk))

    land_file(dest, fetch, force=force, mode=entry.get("mode"))


def _refuse_links(entries: list[dict]) -> None:
    for e in entries:
        if e.get("type") == "symlink":
            raise CliError(f"symbolic links are not supported: {e.get('path')}", errors.USAGE)
        if e.get("type") not in ("file", "directory"):
            raise CliError(f"special files are not supported: {e.get('path')}", errors.USAGE)


def cmd_get(args, config: Config) -> int:
    from .transfer import check_file_target, local_destination, prepare_tree  # noqa: PLC0415

    with content(config, args.volume, timeout=max(API_TIMEOUT, 600)) as (volume, files):
        remote = _remote(args.remote_path)
        entry = _stat(files, remote)
        if entry is None:
            raise CliError(f"remote path does not exist: {volume.name}:{remote}", errors.NOT_FOUND)
        _refuse_links([entry])
        dest = local_destination(args.local_path, posixpath.basename(entry["path"]) or volume.name)
        if entry["type"] == "file":
            check_file_target(dest, args.force)
            with output.Progress(entry["size"], "Downloading", quiet=args.quiet) as progress:
                _get(files, entry, dest, args.force, progress)
            print(f"Downloaded {volume.name}:{entry['path']} to {dest}", flush=True)
            return 0
        listed = check(files.get("/dir", params={"path": entry["path"], "depth": MAX_DEPTH})).json()
        _refuse_links(listed)
        base = entry["path"]
        wanted = [e for e in listed if e["type"] == "file"]
        prepare_tree(dest, [posixpath.relpath(e["path"], base) for e in listed if e["type"] == "directory"],
                     [posixpath.relpath(e["path"], base) for e in wanted], args.force)
        total = sum(e["size"] for e in wanted)
        with output.Progress(total, "Downloading", quiet=args.quiet) as progress:
            for e in wanted:
                _get(files, e, dest / posixpath.relpath(e["path"], base), args.force, progress)
    print(f"Downloaded directory {volume.name}:{base} to {dest} ({len(wanted)} files, {output.size(total)})",
          flush=True)
    return 0
