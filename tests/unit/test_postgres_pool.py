"""The PostgreSQL pool the settings give Django (config/postgresql/base.py): after a database
outage its reconnection attempts come at most a second apart (psycopg_pool's own back-off
doubles without bound: after a 10 s outage the next attempt came ~as long after the server was
back, the chaos bench's ~20 s stall), and a connection that fails its check as it leaves the
pool drains the idle ones, which died with it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in a process of its own: the settings build DATABASES from DATABASE_URL at import.
# Every attempt to connect fails (nothing listens on port 1); the delays the pool schedules
# between attempts are recorded instead of waited.
PROBE = r"""
import json, django
django.setup()
from django.db import connection
import psycopg
pool = connection.pool
delays = []
def refuse(*a, **k):
    raise psycopg.OperationalError("refused")
pool._connect = refuse
pool.schedule_task = lambda task, delay: delays.append((task, delay))
pool._add_connection(None)
for _ in range(9):
    task, _delay = delays[-1]
    pool._add_connection(task.attempt, task.growing)
print(json.dumps({"engine": connection.settings_dict["ENGINE"], "vendor": connection.vendor,
                  "checks": pool._check is not None, "delays": [d for _t, d in delays]}))
"""


def test_reconnection_attempts_after_an_outage_come_at_most_a_second_apart():
    env = {**os.environ, "DATABASE_URL": "postgres://aenv@127.0.0.1:1/aenv", "DJANGO_SETTINGS_MODULE": "config.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vendor"] == "postgresql"
    assert got["checks"], "connections are not checked as they leave the pool"
    assert len(got["delays"]) == 10
    # the first ~1 s (psycopg_pool's jittered start), then never more: not 2, 4, 8, ... 512 s
    assert max(got["delays"]) <= 1.0, got["delays"]
    assert min(got["delays"]) >= 0.9, got["delays"]


def test_a_connection_failing_its_check_drains_the_idle_ones():
    from config.postgresql.base import Pool  # noqa: PLC0415

    pool = Pool("postgres://aenv@127.0.0.1:1/aenv", open=False)
    dead = mock.Mock(autocommit=True, _pool=pool)
    dead.execute.side_effect = psycopg.OperationalError("server closed the connection unexpectedly")
    with mock.patch.object(pool, "drain") as drain, pytest.raises(psycopg.OperationalError):
        Pool.check_and_drain(dead)
    drain.assert_called_once_with()

    alive = mock.Mock(autocommit=True, _pool=pool)
    with mock.patch.object(pool, "drain") as drain:
        Pool.check_and_drain(alive)
    alive.execute.assert_called_once_with("")
    drain.assert_not_called()
