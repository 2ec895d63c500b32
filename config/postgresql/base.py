"""Django's PostgreSQL backend with a connection pool that is back as soon as the server is.

psycopg_pool, as Django builds it, has two habits that turn a short database outage into a
long stall after the server is back (the chaos bench's PostgreSQL restart: the first request
after it waited ~20 s):

- a broken connection is replaced by a task that retries with an exponential back-off (1, 2,
  4, 8, 16 s ...), and while the pool's one "grow" task sits in such a back-off no other grows:
  a request that arrives once the server is back waits for the next attempt, about as long as
  the outage lasted;
- the connections idle in the pool when the server went away are dead, and without a check
  each is handed out once and fails its request (a 503) before it is replaced.

Here the retries come at most ``RECONNECT_DELAY_MAX`` seconds apart (a refused connection
costs the server nothing), and every connection is checked as it leaves the pool (one empty
round trip, Django's CONN_HEALTH_CHECKS); the first that fails the check drains the pool's
other idle ones (they died with it), so a request after a restart meets one dead connection
at most and then a fresh one. Selected by ENGINE ``config.postgresql`` (config/settings.py)."""
from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool
from psycopg_pool.base import AttemptWithBackoff

# The longest wait between two attempts to reconnect (psycopg_pool doubles it without bound).
RECONNECT_DELAY_MAX = 1.0


class CappedAttempt(AttemptWithBackoff):
    """psycopg_pool's back-off, the delay capped at RECONNECT_DELAY_MAX (its give-up time,
    ``reconnect_timeout``, unchanged)."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_DELAY_MAX)


class Pool(ConnectionPool):
    """A ConnectionPool whose reconnection attempts use CappedAttempt and whose failed
    check drains the idle connections."""

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # psycopg_pool passes the same attempt on to each retry it schedules
        super()._add_connection(attempt or CappedAttempt(timeout=self.reconnect_timeout), growing)

    @staticmethod
    def check_and_drain(conn) -> None:
        try:
            ConnectionPool.check_connection(conn)
        except Exception:
            pool = getattr(conn, "_pool", None)
            if pool is not None:
                pool.drain()  # the idle ones are as dead: replaced, none handed out
            raise


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self):
        pool_options = self.settings_dict["OPTIONS"].get("pool")
        if self.alias == base.NO_DB_ALIAS or not pool_options:
            return None
        if self.alias not in self._connection_pools:
            if self.settings_dict.get("CONN_MAX_AGE", 0) != 0:
                raise ImproperlyConfigured("Pooling doesn't support persistent connections.")
            connect_kwargs = self.get_connection_params()
            connect_kwargs["autocommit"] = True  # as Django's: it sets the mode itself later
            pool = Pool(kwargs=connect_kwargs, open=False, configure=self._configure_connection,
                        check=Pool.check_and_drain, **({} if pool_options is True else pool_options))
            self._connection_pools.setdefault(self.alias, pool)
        return self._connection_pools[self.alias]
