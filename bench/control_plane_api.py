"""The API process of ``bench/control_plane.py --profile``: daphne serving ``config.asgi``
as the stack runs it, under cProfile on every thread (the event loop's and each
``sync_to_async`` / sender thread), the merged stats written when it exits.

Why not py-spy: it is not a dependency of the project; cProfile is in the standard library.
Its own cost inflates many small calls (the ORM's) more than a few large ones, so read
its figures as where the time goes, not as the time itself (that is what the bench's
table says, from a run without it). A benchmark stand-in only.

    AENV_BENCH_PROFILE_OUT=path.prof python bench/control_plane_api.py <daphne args>
    kill -USR2 <pid>   # writes the stats so far (also written at exit)
"""
from __future__ import annotations

import atexit
import cProfile
import os
import pstats
import signal
import sys
import threading
from pathlib import Path

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _start_in_thread(frame, event, arg):  # threading.setprofile's hook: once per new thread
    sys.setprofile(None)
    profile = cProfile.Profile()
    with _lock:
        _profiles.append(profile)
    profile.enable()


def _dump(out: Path) -> None:
    with _lock:
        profiles = list(_profiles)
    stats = None
    for profile in profiles:
        try:
            profile.create_stats()
        except Exception:  # noqa: BLE001 - a thread's profile still running: skip it
            continue
        if not profile.stats:
            continue
        if stats is None:
            stats = pstats.Stats(profile)
        else:
            stats.add(profile)
    if stats is not None:
        stats.dump_stats(str(out))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if os.environ.get("AENV_BENCH_SWITCH_INTERVAL"):  # an experiment: the GIL's hand-over interval (s)
        sys.setswitchinterval(float(os.environ["AENV_BENCH_SWITCH_INTERVAL"]))
    from daphne.cli import CommandLineInterface  # noqa: PLC0415

    if os.environ.get("AENV_BENCH_PROFILE_OUT"):
        main_profile = cProfile.Profile()
        _profiles.append(main_profile)
        threading.setprofile(_start_in_thread)
        out = Path(os.environ["AENV_BENCH_PROFILE_OUT"])
        atexit.register(_dump, out)
        # the bench asks for the stats with SIGUSR2 before it stops the stack: a stop that
        # waits out its timeout (SIGKILL) would lose what atexit writes
        signal.signal(signal.SIGUSR2, lambda *_: _dump(out))
        main_profile.enable()
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
