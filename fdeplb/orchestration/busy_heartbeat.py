"""The rank agent's heartbeat while its loop thread is busy in one long call (staging a plan's experts from peers
or the checkpoint): a thread of its own beats every period until the call returns, so a rank that is working is
not suspected of being gone (a peer that stalls costs the receiver its per-peer wait, not its membership).

The loop's own heartbeat (:meth:`~fdeplb.orchestration.agent.RankAgent._heartbeat`) only runs between steps; this
covers the one step that can outlast the heartbeat TTL. Only the loop thread does the rest of what a heartbeat
checks (a superseded agent, lost records): the beat given here must be the plain heartbeat.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


@contextmanager
def beating(beat: Callable[[], None], period_s: float, log: Any) -> Iterator[None]:
    """Call ``beat()`` every ``period_s`` seconds (> 0) on a daemon thread while the block runs. A beat that raises
    (Redis away: the loop reports it at its next step) is logged and the next one tried a period later; the thread
    is stopped and joined (waiting at most ``max(period_s, 1)`` s for a beat in flight) when the block ends, however it
    ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            try:
                beat()
            except Exception as err:  # noqa: BLE001 - Redis away, or a bug: the next beat is tried all the same
                log.warning("heartbeat while busy failed", error=f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=run, name="fdeplb-busy-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=max(period_s, 1.0))
