"""How much the host takes from a guest's envd: the one place for those limits.

Why: a guest runs code an agent wrote, and that code may replace envd (it runs as root in
the guest). Whatever answers on envd's port can send an endless body, drip a byte a
second, or send numbers no column holds. Every envd call of the node, the API and the
data plane goes through ``envd_client``, which reads answers with these caps: a body is
read in chunks and the read stops past its cap (``EnvdAnswerTooLarge``); a call's
``timeout`` is its total deadline, not a per-read one (``deadline``); a number from a
guest is checked against the range of the column it goes to (``guest_int`` /
``guest_percent``), so nothing a guest sends can make the host hold more, wait longer or
store something the database refuses.
"""
from __future__ import annotations

import math

from .errors import EnvdAnswerTooLarge, EnvdError

# -- sizes (bytes) --------------------------------------------------------------------------
ANSWER_BYTES = 8 << 20          # a unary answer: a process list, a stat, /init
LISTING_BYTES = 64 << 20        # a ListDir answer (the CLI lists a tree 100 levels deep at once)
METRICS_BYTES = 64 << 10        # GET /metrics: eight numbers (envd's answer is ~200 bytes)
ERROR_BYTES = 64 << 10          # the body of an error answer (only its message is kept)
FILE_BYTES = 64 << 20           # read_file, whole in memory (download_file streams to a sink instead)
STREAM_MESSAGE_BYTES = 4 << 20  # one Connect envelope of a stream (envd's output chunks are ≤ 32 KiB)
RUN_OUTPUT_BYTES = 16 << 20     # the output run()/run_argv() keep per stream (the callbacks see all of it)

# -- time (seconds) ---------------------------------------------------------------------------
# run()/run_argv() with a ``deadline``: envd ends the process then; the client gives up this
# much later even if a guest keeps the stream open.
RUN_DEADLINE_GRACE = 10.0

# -- numbers ----------------------------------------------------------------------------------
# What the database columns of guest figures hold: a 32-bit count (``PositiveIntegerField``)
# and a signed 64-bit byte count (``BigIntegerField``), on SQLite and PostgreSQL alike.
COUNT_MAX = 2**31 - 1
BYTES_MAX = 2**63 - 1


def guest_int(value, name: str, maximum: int) -> int:
    """``value`` if it is a JSON integer in 0..``maximum``; else ``ValueError`` naming it
    (a float, a bool, a string, a negative or a too-large number is refused, not converted)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} is not an integer: {value!r:.50}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} out of range 0..{maximum}: {value!r:.50}")
    return value


def guest_percent(value, name: str) -> float:
    """``value`` as a float if it is a finite JSON number in 0..100; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number: {value!r:.50}")
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 100.0:
        raise ValueError(f"{name} out of range 0..100: {value!r:.50}")
    return value


def check_encoding(headers) -> None:
    """Refuses a compressed answer (the client asks for ``identity``): what is counted
    against a cap must be what is held, not a small body that inflates."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise EnvdError("internal", f"unexpected Content-Encoding {encoding[:40]!r} of an answer")


class Cap:
    """Collects a body's chunks up to ``cap`` bytes. Past the cap ``add`` raises
    EnvdAnswerTooLarge naming ``what``, or, with ``truncate`` (an error answer, whose start
    is enough), keeps the first ``cap`` bytes and answers False: stop reading."""

    def __init__(self, what: str, cap: int, *, truncate: bool = False):
        self.what, self.cap, self.truncate = what, cap, truncate
        self._buf = bytearray()

    def add(self, chunk: bytes) -> bool:
        room = self.cap - len(self._buf)
        if len(chunk) > room:
            if not self.truncate:
                raise EnvdAnswerTooLarge(self.what, self.cap)
            self._buf += chunk[:room]
            return False
        self._buf += chunk
        return True

    def bytes(self) -> bytes:
        return bytes(self._buf)
