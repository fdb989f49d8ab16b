"""The reconcile loops' error shell: back-off while Redis is away, one log line per change of health."""

from __future__ import annotations

import threading

import structlog.testing

from fdeplb.errors import NotFoundError, RedisUnavailableError
from fdeplb.backoff import REDIS_RETRY_CAP_S, REDIS_RETRY_S, redis_backoff_s
from fdeplb.orchestration.reconcile import run_until_stopped


class _Clock(threading.Event):
    """A stop event whose waits return at once and are recorded (no real time passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):  # noqa: D102
        self.waits.append(timeout)
        return self.is_set()


def _run(outcomes):
    """Run the shell over ``outcomes`` (an exception to raise, or None for a pass that succeeds); the pass after
    the last one stops the loop. Returns (waits, log events)."""
    stop = _Clock()
    todo = list(outcomes)

    def iterate():
        if not todo:
            return True
        out = todo.pop(0)
        if out is not None:
            raise out
        return False

    with structlog.testing.capture_logs() as logs:
        run_until_stopped(stop, iterate, structlog.get_logger("test"), announce=lambda err: None,
                          retry_s=lambda: 1.0)
    return stop.waits, logs


def test_redis_away_backs_off_exponentially_to_a_cap_and_logs_the_change_once():
    waits, logs = _run([RedisUnavailableError(f"attempt {i}") for i in range(12)] + [None])
    expected = [min(REDIS_RETRY_CAP_S, REDIS_RETRY_S * 2 ** i) for i in range(12)]
    assert waits == expected and waits[-1] == REDIS_RETRY_CAP_S and waits[0] == REDIS_RETRY_S
    events = [e["event"] for e in logs]
    assert events == ["redis unavailable", "recovered"], events
    assert logs[1]["after_failures"] == 12
    assert redis_backoff_s(10_000) == REDIS_RETRY_CAP_S


def test_a_repeated_step_failure_is_logged_once_per_change():
    gone = NotFoundError("no cluster record at fdeplb:{c}:rearrange")
    waits, logs = _run([gone] * 30 + [NotFoundError("other")] * 3 + [None, gone])
    assert waits == [1.0] * 34
    assert [(e["event"], e.get("error")) for e in logs] == [
        ("step failed", str(gone)), ("step failed", "other"), ("recovered", None), ("step failed", str(gone)),
        ("recovered", None)]


def test_the_back_off_restarts_after_a_recovery():
    waits, _ = _run([RedisUnavailableError("x")] * 3 + [None] + [RedisUnavailableError("x")] * 2)
    assert waits == [0.5, 1.0, 2.0, 0.5, 1.0]
