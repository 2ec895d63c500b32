"""Who a request acts as, lookup, per-user base environment and path resolution relative to home."""

import base64
import binascii
import logging
import os
import pwd

from .state import DEFAULT_PATH, DEFAULT_USER

log = logging.getLogger("envd.users")


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
    except ValueError:  # a NUL in it: a name no account can have (not quoted back)
        raise UnknownUser("user not found: the name is not a valid account name") from None


def request_user(settings, name):
    """The account a request acts as, for every endpoint: the user it names (``username`` on
    /files, ``Authorization: Basic`` on RPCs), else the sandbox's default user (template file,
    /init, ``--default-user``), else E2B's ``user``. SDKs name a user only when the caller passes
    one (or, for envd < 0.4.0, always ``user``); newer ones rely on this default.
    Raises UnknownUser for a name without an account."""
    return lookup(name or settings.default_user or DEFAULT_USER)


def ensure_home(pw, directory):
    """Creates ``pw``'s missing home when ``directory`` (where something is about to be made, or
    a process's cwd) is that home or lies in it, as ``useradd --create-home`` would have: missing
    parents root's, the home the user's, 0755. E2B's envd creates every missing parent of a write
    as root; aenv checks the user's own permissions, so without this a user whose home is absent
    (a template USER made without one) could write no relative path ("cannot write in '/'").
    A failure is only logged: the caller's own checks then give the request its answer."""
    home = os.path.normpath(pw.pw_dir or "/")
    if home == "/" or not home.startswith("/") or os.path.lexists(home):
        return
    if directory != home and not directory.startswith(home + "/"):
        return
    try:
        os.makedirs(os.path.dirname(home), mode=0o755, exist_ok=True)
        os.mkdir(home, 0o755)
        if os.geteuid() == 0:
            os.chown(home, pw.pw_uid, pw.pw_gid)
        os.chmod(home, 0o755)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("could not create the home %s of %s: %s", home, pw.pw_name, exc)


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
    so Stat of a link reports the link itself. A home that is not absolute (a passwd entry
    without one) counts as ``/``: a relative result would never reach ``/`` in the
    permission walk.
    """
    if not home or not home.startswith("/"):
        home = "/"
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
