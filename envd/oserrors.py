"""What a failed file operation answers: the one table from an OS error to an HTTP status (REST,
``/files``) and a Connect code (the RPCs).

Why one table: the kernel's refusals (a write under ``/proc`` as root is ``EPERM``, ``EINVAL`` or
``EACCES``; a read-only mount ``EROFS``; a full disk ``ENOSPC``) are the caller's to act on, and
were 500s / ``internal`` wherever a handler had not listed them. An errno that is not here (``EIO``,
``EMFILE``, ``ENOMEM``) is envd's or the guest's own trouble and stays a 500 / ``internal``.
HTTP statuses follow the E2B spec for ``/files`` (507 is the SDK's ``NotEnoughSpaceException``);
Connect codes are chosen so the SDK raises what the caller can act on (``ENOSPC`` is not
``resource_exhausted``, which the SDK turns into ``RateLimitException``).
"""

import errno

# errno -> (HTTP status, Connect code)
_BY_ERRNO = {
    errno.ENOENT: (404, "not_found"),
    errno.EEXIST: (409, "already_exists"),
    # not allowed: by permissions, by the kernel (a /proc or /sys file, an immutable file) or
    # because the file system is mounted read-only (Connect has no better code than
    # permission_denied for it, and 409 would be the SDK's already_exists)
    errno.EPERM: (403, "permission_denied"),
    errno.EACCES: (403, "permission_denied"),
    errno.EROFS: (403, "permission_denied"),
    # no room: 507 is E2B's answer to a full disk
    errno.ENOSPC: (507, "failed_precondition"),
    errno.EDQUOT: (507, "failed_precondition"),
    errno.EFBIG: (413, "failed_precondition"),
    # the caller's input: a name past NAME_MAX or PATH_MAX, a loop of links, a path through a
    # file, a directory where a file is needed, a value the file refuses (EINVAL: a write of text
    # to a number in /proc), an argv or environment past the kernel's limit, a device that is
    # not there (ENXIO: a socket's path, a FIFO nobody reads, no controlling terminal)
    errno.ENAMETOOLONG: (400, "invalid_argument"),
    errno.ELOOP: (400, "invalid_argument"),
    errno.ENOTDIR: (400, "invalid_argument"),
    errno.EISDIR: (400, "invalid_argument"),
    errno.EINVAL: (400, "invalid_argument"),
    errno.E2BIG: (400, "invalid_argument"),
    errno.ENXIO: (400, "invalid_argument"),
    errno.ENODEV: (400, "invalid_argument"),
    errno.EOPNOTSUPP: (400, "invalid_argument"),
    errno.EXDEV: (400, "invalid_argument"),
    # the file is in a state that forbids it now
    errno.ENOTEMPTY: (409, "failed_precondition"),
    errno.EBUSY: (409, "failed_precondition"),
    errno.ETXTBSY: (409, "failed_precondition"),
    # a device that cannot take more now (files are opened O_NONBLOCK so none blocks envd)
    errno.EAGAIN: (503, "unavailable"),
}

# Exceptions raised without an errno (``PermissionError("…")`` from envd's own checks).
_BY_CLASS = (
    (FileNotFoundError, (404, "not_found")),
    (FileExistsError, (409, "already_exists")),
    (PermissionError, (403, "permission_denied")),
    (NotADirectoryError, (400, "invalid_argument")),
    (IsADirectoryError, (400, "invalid_argument")),
)


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(HTTP status, Connect code) for an OS error the caller can act on; None for any other."""
    if not isinstance(exc, OSError):
        return None
    found = _BY_ERRNO.get(exc.errno)
    if found is not None:
        return found
    for cls, answer in _BY_CLASS:
        if isinstance(exc, cls):
            return answer
    return None


def http_status(exc: BaseException) -> int:
    """The REST status of ``exc``: the table's, else 500."""
    found = classify(exc)
    return found[0] if found else 500


def message(exc: OSError) -> str:
    """The error's text without Python's ``[Errno N]`` prefix: what the kernel said, and the path."""
    text = exc.strerror or str(exc)
    if exc.filename is not None:
        text = f"{text}: '{exc.filename}'"
    return text
