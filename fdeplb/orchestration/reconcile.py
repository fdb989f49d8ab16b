"""The error shell of a reconcile loop, shared by the coordinator and the rank agent: what a failed pass does.

A lost Redis connection is logged and retried every :data:`REDIS_RETRY_S`; any other exception (a typed
:class:`~fdeplb.errors.FdeplbError` or a bug) is logged, announced (an event) and retried after a back-off: no
value kills the loop. No state of its own.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from fdeplb.errors import RedisUnavailableError

#: seconds between two tries while Redis is away
REDIS_RETRY_S = 0.5


def run_until_stopped(stop_event: threading.Event, iterate: Callable[[], bool], log: Any, *,
                      announce: Callable[[Exception], Any], retry_s: Callable[[], float],
                      until: Callable[[], bool] | None = None) -> None:
    """Call ``iterate()`` until ``stop_event`` is set or it returns True.

    A :class:`~fdeplb.errors.RedisUnavailableError` out of it is logged as a warning (``redis unavailable``) and
    retried after :data:`REDIS_RETRY_S` seconds. Any other exception is logged as an error (``step failed``, with
    its type), passed to ``announce`` (an event; a failure of that is ignored: the log has it) and retried after
    ``retry_s()`` seconds. ``until``: asked after a failed pass too, before the back-off (True: return); None:
    only ``iterate`` decides.
    """
    while not stop_event.is_set():
        try:
            if iterate():
                return
        except RedisUnavailableError as err:
            log.warning("redis unavailable", error=str(err))
            if until is not None and until():
                return
            stop_event.wait(REDIS_RETRY_S)
        except Exception as err:  # noqa: BLE001 - a missing plan, a corrupt record, a bug: keep going
            log.error("step failed", error=str(err), error_type=type(err).__name__)
            try:
                announce(err)
            except Exception:  # noqa: BLE001 - logged above; the next pass tries again
                pass
            if until is not None and until():
                return
            stop_event.wait(retry_s())
