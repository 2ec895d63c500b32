"""The one host-side client of envd, the in-guest agent (sync and async).

Why: the node agent (``/init``, the token handoff), the QEMU driver (``/health`` polls,
``/aenv/sync`` before a filesystem-only pause), the template builder (warm-up commands),
the dashboard terminal (PTYs) and the CLI (``exec``) all talk to envd. Each used to carry
its own copy of the Connect framing, error decoding and ``/init`` body; now they share
this package, which speaks the framing of ``envd.wire`` — the very module envd itself
serves with — so host and guest cannot disagree about a byte.

    from envd_client import EnvdClient, EnvdError

    with EnvdClient.at(host, port, access_token=token) as envd:
        envd.init({"A": "1"}, access_token=token)
        result = envd.run("echo hi", on_stdout=sys.stdout.buffer.write)

``AsyncEnvdClient`` has the same calls, awaited. Errors: ``EnvdError`` (a Connect code:
``not_found``, ``unauthenticated``, ...) and its subclasses ``EnvdUnavailable`` (nothing
listening, connection broken, timed out: a call's ``timeout`` is its total deadline) and
``EnvdAnswerTooLarge`` (the guest sent more than the call's cap). Modules: ``protocol``
(requests without I/O), ``answers`` (reading answers and events, the result types, without
I/O), ``base`` (address, token, timeouts), ``sync``, ``aio``, ``errors``, ``limits`` (how
much the host takes from a guest: sizes, time, number ranges) and ``deadline`` (the
blocking client's total deadline).

Light on purpose (the CLI will be installable on its own): httpx and the standard
library only — no Django, no protobuf — and ``import envd_client`` loads httpx only when
a client class is first used.
"""
from __future__ import annotations

from .errors import EnvdAnswerTooLarge, EnvdError, EnvdUnavailable

__all__ = ["EnvdClient", "AsyncEnvdClient", "EnvdError", "EnvdUnavailable", "EnvdAnswerTooLarge", "Event", "RunResult", "ProcessInfo",
           "GuestMetrics", "EntryInfo"]

_LAZY = {"EnvdClient": "sync", "AsyncEnvdClient": "aio", "Event": "answers", "RunResult": "answers",
         "ProcessInfo": "answers", "GuestMetrics": "answers", "EntryInfo": "answers"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module  # noqa: PLC0415

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
