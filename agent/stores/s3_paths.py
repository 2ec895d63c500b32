"""Rewriting a snapshot manifest's paths between nodes, for the S3 store.

A driver's manifest names absolute paths on the node that took the snapshot: its own
files and the files it uses from the images dir (template base layer, kernel, initrd,
tools). What is uploaded names them ``$SNAPSHOT/…`` and ``$IMAGES/…`` instead, and a
node that downloads it puts its own directories back. Kept apart from the store so
the rewriting is plain functions on manifest JSON, with no S3 in sight."""
from __future__ import annotations

from pathlib import Path

SNAP, IMAGES = "$SNAPSHOT", "$IMAGES"


def relativize(value, snap_dir: Path, images_dirs: list[Path]):
    """``value`` (manifest JSON) with absolute paths into the snapshot dir or the
    images dir replaced by ``$SNAPSHOT``/``$IMAGES`` forms."""
    roots = [(str(snap_dir), SNAP)] + [(str(d), IMAGES) for d in images_dirs]
    if isinstance(value, dict):
        return {k: relativize(v, snap_dir, images_dirs) for k, v in value.items()}
    if isinstance(value, list):
        return [relativize(v, snap_dir, images_dirs) for v in value]
    if isinstance(value, str):
        for root, token in roots:
            if value == root or value.startswith(root + "/"):
                return token + value[len(root):]
    return value


def localize(value, snap_dir: Path, images_dir: Path):
    """The inverse of relativize, onto this node's directories."""
    if isinstance(value, dict):
        return {k: localize(v, snap_dir, images_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [localize(v, snap_dir, images_dir) for v in value]
    if isinstance(value, str):
        for token, root in ((SNAP, snap_dir), (IMAGES, images_dir)):
            if value == token or value.startswith(token + "/"):
                return str(root) + value[len(token):]
    return value


def image_files(manifest: dict, images_dirs: list[Path]) -> dict[str, str]:
    """{role: path} of the files a snapshot's manifest takes from the node's images dir:
    its template's base disk (the bottom layer, unless the snapshot carries its own), the
    kernel, initrd and tools drive."""
    machine = manifest.get("machine") or {}
    layers = manifest.get("layers") or []
    named = {"base": layers[0] if layers else "", **{key: machine.get(key) or "" for key in ("kernel", "initrd", "tools")}}
    roots = [str(d) + "/" for d in images_dirs]
    return {role: path for role, path in named.items() if path and path.startswith(tuple(roots))}


def replace_path(value, old: str, new: str):
    """Every string of the manifest JSON ``value`` equal to ``old`` becomes ``new`` (in place)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in list(items):
        if item == old:
            value[key] = new
        elif isinstance(item, (dict, list)):
            replace_path(item, old, new)


def unique_paths(paths: list[Path]) -> list[Path]:
    """``paths`` without repeats, in order (an images dir and its resolved form may be one)."""
    out = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out
