"""The house retry rule while a server is away (Redis, or an ``fdeplb serve`` in front of it), in one place: the
exponential back-off of the reconcile loops (:mod:`fdeplb.orchestration.reconcile`) and :func:`ride_out`, which the
command-line clients (``rearrange --wait``, ``audit --follow``) call a read through so that an outage within their
timeout is waited out, said once, instead of ending them.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TypeVar

from fdeplb.errors import RedisUnavailableError

T = TypeVar("T")

#: seconds before the first retry while Redis is away; doubled at every failed attempt up to REDIS_RETRY_CAP_S
REDIS_RETRY_S = 0.5
#: most seconds between two tries while Redis is away
REDIS_RETRY_CAP_S = 8.0


def redis_backoff_s(attempt: int) -> float:
    """Seconds to wait after the ``attempt``-th consecutive failed try (1-based) while Redis is away:
    ``REDIS_RETRY_S * 2 ** (attempt - 1)``, at most :data:`REDIS_RETRY_CAP_S`."""
    return min(REDIS_RETRY_CAP_S, REDIS_RETRY_S * 2 ** min(max(attempt, 1) - 1, 32))


def _stderr_note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def ride_out(call: Callable[[], T], *, what: str, retry_s: float,
             say: Callable[[str], None] = _stderr_note) -> T:
    """``call()``, called again after :func:`redis_backoff_s` of the failed tries (0.5 s, 1 s, 2 s, ... up to
    :data:`REDIS_RETRY_CAP_S`, never past the bound) while it raises :class:`RedisUnavailableError`, for at most
    ``retry_s`` seconds from the start of the try that failed first (a frozen Redis makes a try last the socket
    timeout: counting from its failure doubled the bound); returns what it returns.

    ``what`` names the server (``"Redis at redis://..."``); ``say`` is told once when the outage starts
    (``"<what> unavailable, retrying for up to N s (<error>)"``) and once when it ends (``"<what> answers again
    after X s"``), not at every try. Raises :class:`RedisUnavailableError` (saying how long it tried and the last
    error) when the bound passes, at once when ``retry_s <= 0``; any other exception of ``call`` at once. The bound
    may be overrun by one try's own length (a connect that times out)."""
    failures, first = 0, 0.0
    while True:
        started = time.monotonic()
        try:
            result = call()
        except RedisUnavailableError as err:
            now = time.monotonic()
            if not failures:
                first = started
                if retry_s <= 0:
                    raise
                say(f"{what} unavailable, retrying for up to {retry_s:.0f} s ({err})")
            failures += 1
            left = first + retry_s - now
            if left <= 0:
                raise RedisUnavailableError(f"{what} did not answer for {now - first:.1f} s ({failures} tries with "
                                            f"back-off): {err}") from None
            time.sleep(min(redis_backoff_s(failures), left))
            continue
        if failures:
            say(f"{what} answers again after {time.monotonic() - first:.1f} s")
        return result
