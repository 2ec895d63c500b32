"""File permission checks on behalf of the requesting user.

envd runs as root, so the kernel would let it touch anything; the SDK's `user`
must get exactly what Unix permissions give that account (e.g. no reading
/etc/shadow through `../../etc/shadow`). Checks follow the owner/group/other
bits of every directory on the way and of the target itself."""
import functools
import os
import stat

READ, WRITE, EXECUTE = 4, 2, 1


@functools.lru_cache(maxsize=64)
def _groups(name: str, gid: int) -> frozenset:
    return frozenset(os.getgrouplist(name, gid))


def _allows(st: os.stat_result, pw, bits: int) -> bool:
    if st.st_uid == pw.pw_uid:
        mode = st.st_mode >> 6
    elif st.st_gid in _groups(pw.pw_name, pw.pw_gid):
        mode = st.st_mode >> 3
    else:
        mode = st.st_mode
    return (mode & bits) == bits


def _deny(path: str, what: str):
    raise PermissionError(f"permission denied: cannot {what} '{path}'")


def _check_traverse(pw, path: str) -> None:
    """Every directory above `path` must be searchable (x) by the user."""
    parent = os.path.dirname(os.path.realpath(path)) if os.path.lexists(path) else os.path.dirname(path)
    parts = [p for p in parent.split("/") if p]
    current = "/"
    for part in [""] + parts:
        current = os.path.join(current, part) if part else current
        try:
            st = os.stat(current)
        except FileNotFoundError:
            return  # the rest does not exist; creating it is checked separately
        if not _allows(st, pw, EXECUTE):
            _deny(current, "enter")


def _is_root(pw) -> bool:
    return pw.pw_uid == 0


def check_read(pw, path: str) -> None:
    """May `pw` read the file (or list the directory) at `path`?"""
    if _is_root(pw):
        return
    _check_traverse(pw, path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # the caller reports not-found
    if not _allows(st, pw, READ | (EXECUTE if stat.S_ISDIR(st.st_mode) else 0)):
        _deny(path, "read")


def check_stat(pw, path: str) -> None:
    if not _is_root(pw):
        _check_traverse(pw, path)


def check_write(pw, path: str) -> None:
    """May `pw` create or overwrite `path` (creating missing parent directories)?"""
    if _is_root(pw):
        return
    _check_traverse(pw, path)
    if os.path.lexists(path) and not os.path.isdir(path):
        if not _allows(os.stat(path), pw, WRITE):
            _deny(path, "write")
        return
    check_change_in(pw, path)


def check_change_in(pw, path: str) -> None:
    """May `pw` add or remove `path` as an entry of its nearest existing ancestor?"""
    if _is_root(pw):
        return
    ancestor = os.path.dirname(path)
    while ancestor != "/" and not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not _allows(os.stat(ancestor), pw, WRITE | EXECUTE):
        _deny(ancestor, "write in")
