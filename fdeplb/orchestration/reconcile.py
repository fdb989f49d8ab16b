"""The error shell of a reconcile loop, shared by the coordinator and the rank agent: what a failed pass does.

A lost Redis connection is retried with the house exponential back-off (:func:`fdeplb.backoff.redis_backoff_s`,
which the command-line clients use too); any other exception (a typed :class:`~fdeplb.errors.FdeplbError` or a bug)
is announced (an event) and retried after the caller's back-off: no value kills the loop. Each *change* of the
loop's health is logged once, not every attempt: the first ``redis unavailable``, the first ``step failed`` with a
given error, and ``recovered`` when a pass succeeds again (with how many passes failed and for how long). State:
only the loop's own failure streak (:class:`_Streak`), local to one call.

A loop whose cluster is gone asks whether an operator deleted it (:class:`StopsWhenDeleted`: its tombstone is
there) and then stops, writing nothing more, instead of retrying or recovering.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from fdeplb.backoff import REDIS_RETRY_CAP_S, redis_backoff_s
from fdeplb.errors import FdeplbError, NotFoundError, RedisUnavailableError
from fdeplb.store.liveness import Tombstone


@dataclass
class _Streak:
    """The loop's current failure streak: what failed (None: healthy), how many passes in a row, since when."""

    what: tuple[str, str] | None = None
    failures: int = 0
    redis_failures: int = 0
    since: float = 0.0

    def fail(self, what: tuple[str, str]) -> bool:
        """Count a failed pass; True when ``what`` differs from the streak's last failure (to be logged)."""
        changed = what != self.what
        if self.what is None:
            self.since = time.monotonic()
        self.what = what
        self.failures += 1
        return changed

    def ok(self, log: Any) -> None:
        """A pass succeeded: log ``recovered`` once if a streak ends."""
        if self.what is not None:
            log.info("recovered", after_failures=self.failures, failed_s=round(time.monotonic() - self.since, 3),
                     last_error=self.what[1][:200])
        self.what, self.failures, self.redis_failures = None, 0, 0


def run_until_stopped(stop_event: threading.Event, iterate: Callable[[], bool], log: Any, *,
                      announce: Callable[[Exception], Any], retry_s: Callable[[], float],
                      until: Callable[[], bool] | None = None, deleted: Callable[[], bool] | None = None) -> None:
    """Call ``iterate()`` until ``stop_event`` is set or it returns True.

    A :class:`~fdeplb.errors.RedisUnavailableError` out of it is retried after :func:`redis_backoff_s` of the
    consecutive Redis failures (0.5 s, 1 s, 2 s, ... up to :data:`REDIS_RETRY_CAP_S`); the first of a streak is
    logged as a warning (``redis unavailable``). Any other exception is retried after ``retry_s()`` seconds; it is
    logged as an error (``step failed``, with its type) and passed to ``announce`` (an event; a failure of that is
    ignored: the log has it) when it differs from the streak's previous failure, so a cluster whose records are
    gone logs one line, not one a second. The first pass that succeeds after failures logs ``recovered`` (info).
    ``until``: asked after a failed pass too, before the back-off (True: return); None: only ``iterate`` decides.
    ``deleted``: asked when a pass raised :class:`~fdeplb.errors.NotFoundError` (the cluster's records gone);
    True (an operator deleted the cluster, :meth:`StopsWhenDeleted._stop_if_deleted`): return at once, nothing
    announced (an event would write the deleted cluster's stream anew).
    """
    streak = _Streak()
    while not stop_event.is_set():
        try:
            done = iterate()
        except RedisUnavailableError as err:
            if streak.fail(("RedisUnavailableError", "")):
                log.warning("redis unavailable", error=str(err), retry="exponential back-off",
                            cap_s=REDIS_RETRY_CAP_S)
            streak.redis_failures += 1
            if until is not None and until():
                return
            stop_event.wait(redis_backoff_s(streak.redis_failures))
            continue
        except Exception as err:  # noqa: BLE001 - a missing plan, a corrupt record, a bug: keep going
            if isinstance(err, NotFoundError) and deleted is not None and deleted():
                return
            streak.redis_failures = 0
            if streak.fail((type(err).__name__, str(err))):
                log.error("step failed", error=str(err), error_type=type(err).__name__,
                          note="logged once until it changes or the loop recovers")
                try:
                    announce(err)
                except Exception:  # noqa: BLE001 - logged above; the next pass tries again
                    pass
            if until is not None and until():
                return
            stop_event.wait(retry_s())
            continue
        streak.ok(log)
        if done:
            return


class StopsWhenDeleted:
    """Mixed into the rank agent and the coordinator (uses their ``store``, ``stop_event`` and ``log``): once
    :meth:`_stop_if_deleted` finds the cluster's tombstone (an operator's ``fdeplb cluster delete``,
    :meth:`fdeplb.store.Store.tombstone`), :attr:`deleted` holds it and the loop stops: its process says so and
    exits (the sim worker, ``fdeplb coordinator``)."""

    deleted: Tombstone | None = None
    """The tombstone that stopped the loop (None while it runs)."""

    def _stop_if_deleted(self) -> bool:
        """Called where the cluster's records are found gone, before any recovery or write: True (the loop's
        ``stop_event`` set, a warning logged once) when an operator deleted the cluster; False otherwise (Redis
        lost its data, or the cluster was never made: the caller goes on as before)."""
        if self.deleted is None:
            try:
                tombstone = self.store.tombstone()
            except FdeplbError as err:  # Redis away, a corrupt tombstone: not known deleted (the loop goes on)
                self.log.warning("tombstone unreadable", error=str(err), error_type=type(err).__name__)
                return False
            if tombstone is None:
                return False
            self.deleted = tombstone
            self.log.warning("cluster deleted by an operator: stopping, nothing more is written", by=tombstone.by,
                             at_ms=tombstone.at_ms, keys=tombstone.keys)
        self.stop_event.set()
        return True
