"""Set the guest clock from /init's timestamp (guests resume from snapshots with stale clocks)."""

import logging
import os
import re
import time
from datetime import datetime, timezone

log = logging.getLogger("envd.clock")

MAX_SKEW_SECONDS = 1.0
_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?([Zz]|[+-]\d{2}:\d{2})$"
)


def parse_rfc3339(value):
    """RFC 3339 timestamp (any number of fractional digits) -> float Unix seconds."""
    m = _RFC3339.match(value.strip())
    if not m:
        raise ValueError(f"invalid RFC 3339 timestamp {value!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac = m.group(7) or ""
    tz = m.group(8)
    dt = datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc)
    seconds = dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)
    if tz not in ("Z", "z"):
        sign = 1 if tz[0] == "+" else -1
        seconds -= sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return seconds


def should_set(target, now, mode, is_root):
    """Decide whether to step the clock: ``never``, ``always`` (root), ``auto`` (root and skew > 1 s)."""
    if mode == "never" or not is_root:
        return False
    if mode == "always":
        return True
    return abs(target - now) > MAX_SKEW_SECONDS


def maybe_set_clock(timestamp, mode):
    """Best effort: never raises (a host run without privileges must still accept /init)."""
    try:
        target = parse_rfc3339(timestamp)
    except ValueError as exc:
        log.warning("ignoring /init timestamp: %s", exc)
        return False
    if not should_set(target, time.time(), mode, os.geteuid() == 0):
        return False
    try:
        time.clock_settime(time.CLOCK_REALTIME, target)
    except (OSError, AttributeError) as exc:
        log.warning("could not set clock: %s", exc)
        return False
    log.info("clock set to %s", timestamp)
    return True
