"""User lookup, per-user base environment and path resolution relative to home."""

import base64
import binascii
import os
import pwd

from .state import DEFAULT_PATH


class UnknownUser(Exception):
    """Raised for a username that has no passwd entry."""


def lookup(name):
    """Return the ``pwd.struct_passwd`` for ``name`` or raise UnknownUser."""
    if not name:
        raise UnknownUser("empty username")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(f"user '{name}' not found") from None


def username_from_basic_auth(header):
    """Extract the username from ``Basic base64("name:")``; None if absent/malformed."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=False).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    name, _, _password = decoded.partition(":")
    return name or None


def base_env(pw):
    """Environment every process of ``pw`` starts from (lowest precedence)."""
    return {
        "PATH": DEFAULT_PATH,
        "HOME": pw.pw_dir,
        "USER": pw.pw_name,
        "LOGNAME": pw.pw_name,
    }


def resolve_path(path, home):
    """Make ``path`` absolute: ``~`` expands to ``home``, relative paths are under ``home``.

    The result is lexically normalised (``..`` collapsed) but symlinks are kept,
    so Stat of a link reports the link itself.
    """
    if path is None or path == "":
        raise ValueError("path is required")
    if "\x00" in path:
        raise ValueError("path contains a NUL byte")
    if path == "~":
        path = home
    elif path.startswith("~/"):
        path = os.path.join(home, path[2:])
    elif not path.startswith("/"):
        path = os.path.join(home, path)
    path = os.path.normpath(path)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path
