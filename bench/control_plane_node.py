"""The node worker of bench/control_plane.py: ``manage.py run_node`` on the in-memory driver
(AENV_DRIVER=fake) with the guest calls (envd /init, token handoff, liveness) answered at
once, so a request's time is the control plane's and Celery's alone: no VM, no TCG, no envd.
A benchmark stand-in only; a real node never runs this."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def main() -> None:
    import django  # noqa: PLC0415

    django.setup()
    from agent import tasks  # noqa: PLC0415

    tasks.init_envd = lambda *a, **k: None
    tasks.handoff_token = lambda *a, **k: None
    tasks.guest_responds = lambda *a, **k: True
    from django.core.management import call_command  # noqa: PLC0415

    call_command("run_node", loglevel=os.environ.get("AENV_BENCH_NODE_LOGLEVEL", "WARNING"))


if __name__ == "__main__":
    main()
