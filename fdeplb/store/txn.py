"""The store's optimistic transactions, each with one bound: :func:`transaction` runs redis-py's WATCH / check /
MULTI / EXEC cycle (the semantics of ``redis.Redis.transaction``) but gives up after :data:`TXN_ATTEMPTS` attempts
instead of retrying forever while another writer keeps changing a WATCHed key. Every optimistic transaction of
:mod:`fdeplb.store` goes through it, so "nothing waits without a deadline" holds for them by construction.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import redis

from fdeplb.errors import ContentionError

#: the most attempts (WATCH, ``func``, EXEC) one optimistic transaction makes before it gives up with
#: :class:`~fdeplb.errors.ContentionError`. A store constant, not a configured deadline: a transaction is a few round
#: trips (each bounded by the client's socket timeout), so this bounds its time too, and a contention that outlasts
#: 64 attempts is a writer changing the key in a loop, not a race that one more attempt would win.
TXN_ATTEMPTS = 64


def transaction(client: Any, func: Callable[[Any], Any], *watches: str, value_from_callable: bool = False,
                watch_delay: float | None = None) -> Any:
    """Run ``func`` as an optimistic transaction on ``client`` (a redis-py ``Redis`` or ``RedisCluster``), as
    redis-py's ``client.transaction(func, *watches, value_from_callable=..., watch_delay=...)`` does: WATCH
    ``watches``, call ``func(pipe)`` (it reads through ``pipe`` at once, then queues writes after ``pipe.multi()``),
    EXEC; when a WATCHed key changed before EXEC (``WatchError``: nothing was written), wait ``watch_delay`` seconds
    (None: not at all) and run it again, at most :data:`TXN_ATTEMPTS` times in all.

    Returns ``func``'s value when ``value_from_callable``, else EXEC's replies (a list; [] when ``func`` queued
    nothing). What ``func`` raises is raised (nothing queued is sent). :class:`~fdeplb.errors.ContentionError`
    (nothing written) when a WATCHed key changed on every attempt."""
    with client.pipeline(True) as pipe:
        for _ in range(TXN_ATTEMPTS):
            try:
                if watches:
                    pipe.watch(*watches)
                value = func(pipe)
                replies = pipe.execute()
                return value if value_from_callable else replies
            except redis.WatchError:
                if watch_delay:
                    time.sleep(watch_delay)
    raise ContentionError(f"gave up after {TXN_ATTEMPTS} attempts: another writer changed "
                          f"{', '.join(watches) or 'a watched key'} before each could commit; nothing was written, "
                          f"try again")
