"""What a volume name and a mount path may be (pure: the API and the node agree on it).

Names: E2B's rule (letters, digits, ``_`` and ``-``), at most 128 characters. Mount paths:
absolute and clean, as E2B checks them, and never over the guest's system directories or
aenv's own (a volume mounted over ``/usr`` or ``/opt/aenv`` would replace the guest's
programs with files another sandbox of the team wrote)."""
from __future__ import annotations

import posixpath
import re

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_PATH = 1024
# A mount at or under these would hide or replace what the guest runs on.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt/aenv", "/proc",
                "/run", "/sbin", "/sys", "/usr", "/var/lib", "/var/run")
# A mount exactly here would hide the whole directory (a home, the logs); below it is fine.
SYSTEM_DIRS = ("/", "/home", "/root", "/var", "/opt", "/tmp", "/mnt", "/srv", "/media")


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a volume name, or None."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        return "volume name must be 1-128 characters: letters, digits, '_' or '-'"
    return None


def path_problem(path: object) -> str | None:
    """Why ``path`` cannot be a mount point, or None (E2B's messages where E2B has one)."""
    if not isinstance(path, str) or path == "":
        return "path cannot be empty"
    if len(path) > MAX_PATH or "\x00" in path:
        return f"path must be at most {MAX_PATH} characters, without NUL"
    if not path.startswith("/"):
        return "path must be absolute"
    if posixpath.normpath(path) != path or path.startswith("//"):
        return "path must not contain any '.' or '..' components"
    if path in SYSTEM_DIRS:
        return f"path '{path}' would hide a system directory"
    for tree in SYSTEM_TREES:
        if path == tree or path.startswith(tree + "/"):
            return f"path '{path}' is inside the system directory {tree}"
    return None


def nested(a: str, b: str) -> bool:
    """One mount point inside (or equal to) the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")
