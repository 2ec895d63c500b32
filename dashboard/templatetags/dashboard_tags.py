"""Small formatting filters for the dashboard templates."""
from django import template

register = template.Library()


def human_seconds(seconds) -> str:
    """``3725`` → ``1h 2m``; ``42`` → ``42s``. Mirrors ``fmtSeconds`` in dashboard.js."""
    if seconds is None:
        return "—"
    seconds = int(seconds)
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days}d {hours}h"
    if hours:
        return f"{sign}{hours}h {minutes}m"
    if minutes:
        return f"{sign}{minutes}m {secs}s"
    return f"{sign}{secs}s"


@register.filter
def seconds(value):
    return human_seconds(value)


@register.filter
def duration_ms(value):
    if value is None:
        return "—"
    value = float(value)
    if value < 1000:
        return f"{value:.0f} ms"
    return f"{value / 1000:.1f} s" if value < 60_000 else human_seconds(value / 1000)


@register.filter
def percent(used, total):
    try:
        return max(0, min(100, round(100 * float(used) / float(total)))) if total else 0
    except (TypeError, ValueError):
        return 0


@register.filter
def gib(value):
    """Bytes → GiB with one decimal (``25769803776`` → ``24.0``)."""
    try:
        return f"{float(value) / 2**30:.1f}"
    except (TypeError, ValueError):
        return "—"
