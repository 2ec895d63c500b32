"""Why a command failed and what ``aenv`` exits with: the one table of exit statuses
(docs/cli.md) and the mapping of API answers, envd errors and transport failures
onto it, so every command reports the same failure the same way.

Imports nothing heavy: ``describe`` recognises httpx and envd errors only if their
modules are already loaded (a command that failed with one has loaded it)."""
from __future__ import annotations

import sys

OK = 0
FAILED = 1         # anything below does not cover: a failed build or fork child, a server error (5xx)
USAGE = 2          # bad arguments: refused by the parser, or by the server (400)
AUTH = 3           # no API key configured, or the key was refused (401 / 403)
NOT_FOUND = 4      # no such sandbox, template, snapshot, node or path (404)
CONFLICT = 5       # the wrong state for that (409), or a local file in the way (use --force)
UNAVAILABLE = 6    # the server or the sandbox cannot be reached (connection, 502 / 503 / 504, 429)
TIMED_OUT = 124    # exec --timeout: the command ran out of time and was killed (as timeout(1))
INTERRUPTED = 130  # Ctrl-C; and a shell session cut because its sandbox was paused, killed or lost
# exec, connect and an attached start exit with the remote command's status instead
# (128 + N when a signal N killed it, 255 when the signal is unknown).

_BY_STATUS = {400: USAGE, 401: AUTH, 403: AUTH, 404: NOT_FOUND, 409: CONFLICT, 422: USAGE, 429: UNAVAILABLE,
              502: UNAVAILABLE, 503: UNAVAILABLE, 504: UNAVAILABLE}
_BY_ENVD_CODE = {"not_found": NOT_FOUND, "unauthenticated": AUTH, "permission_denied": AUTH,
                 "invalid_argument": USAGE, "already_exists": CONFLICT, "failed_precondition": CONFLICT,
                 "unavailable": UNAVAILABLE, "deadline_exceeded": UNAVAILABLE}


class CliError(Exception):
    """A failure the command reports as ``aenv: <message>`` and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = FAILED):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class ApiError(CliError):
    """The API answered ``status`` with ``message`` (E2B's ``{code, message}``)."""

    def __init__(self, status: int, message: str):
        self.status = status
        if status == 401:
            text = f"authentication failed (401): {message}; run `aenv auth` to set your API key"
        else:
            text = f"{status}: {message}"
        super().__init__(text, exit_code_for_status(status))


def exit_code_for_status(status: int) -> int:
    return _BY_STATUS.get(status, FAILED if status >= 400 else OK)


def describe(exc: BaseException) -> tuple[str, int] | None:
    """(message, exit status) for an envd error or an httpx transport failure that a
    command let through; None for anything else (a bug: the traceback is shown)."""
    envd_errors = sys.modules.get("envd_client.errors")
    if envd_errors is not None and isinstance(exc, envd_errors.EnvdError):
        if isinstance(exc, envd_errors.EnvdUnavailable):
            return f"cannot reach the sandbox: {exc.message}", UNAVAILABLE
        if exc.status is not None:  # an HTTP error answer says its status, as the API's errors do
            return f"{exc.status}: {exc.message}", exit_code_for_status(exc.status)
        return f"{exc.code}: {exc.message}", _BY_ENVD_CODE.get(exc.code, FAILED)
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.HTTPError):
        url = getattr(getattr(exc, "request", None), "url", None) if isinstance(exc, httpx.RequestError) else None
        where = f" at {url.scheme}://{url.netloc.decode()}" if url is not None else ""
        return f"cannot reach the server{where}: {type(exc).__name__}: {exc}", UNAVAILABLE
    return None


# Linux signal numbers by the words envd reports them with ("signal: killed"; Go's
# ProcessState wording, envd.processes): the guest is Linux whatever the host is.
_SIGNAL_NUMBERS = {"hangup": 1, "interrupt": 2, "quit": 3, "illegal instruction": 4, "trace/breakpoint trap": 5,
                   "aborted": 6, "bus error": 7, "floating point exception": 8, "killed": 9,
                   "user defined signal 1": 10, "segmentation fault": 11, "user defined signal 2": 12,
                   "broken pipe": 13, "alarm clock": 14, "terminated": 15}
SIGNALLED_UNKNOWN = 255


def remote_exit_status(exit_code: int | None, status: str = "") -> int:
    """What ``aenv`` exits with for a remote process that ended with envd's ``exit_code``
    and ``status``: its own code, or 128 + N when signal N killed it, as a shell does."""
    if exit_code is not None and exit_code >= 0:
        return exit_code
    word = status.removeprefix("signal: ").strip()
    if word.startswith("signal "):  # "signal 34": envd's words for a signal it has no name for
        number = word.removeprefix("signal ")
        return 128 + int(number) if number.isdigit() else SIGNALLED_UNKNOWN
    number = _SIGNAL_NUMBERS.get(word)
    return 128 + number if number else SIGNALLED_UNKNOWN
