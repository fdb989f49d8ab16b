"""The rank agent embedded in a serving worker: the engine owns the forward loop, the agent's reconcile loop runs in
a background thread (:class:`EmbeddedAgent`). README "Embedding in a serving worker" shows its use.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any

from fdeplb.errors import InputError
from fdeplb.orchestration.agent import RankAgent
from fdeplb.store import Store
from fdeplb.weights.backend import CheckpointBackend


class EmbeddedAgent(RankAgent):
    """The rank agent embedded in a serving worker: the engine owns the forward loop and calls :meth:`record` and
    :meth:`at_safe_point`; the reconcile loop (publishing the load window, staging, the weight-status machine,
    heartbeats with a TTL) runs in a background daemon thread started by :meth:`start`.

    Args:
        store: a :class:`~fdeplb.store.Store`, or a Redis URL (then ``cluster`` names the cluster).
        ep_rank: this worker's EP rank.
        tensors: the engine's live expert tensors, ``suffix -> [paddle.Tensor per MoE layer, each
            [slots_per_rank, *shape]]``, already holding the cluster's current placement: attached in place and
            verified against the checkpoint (:meth:`fdeplb.weights.CheckpointBackend.attached`). Without them the
            agent loads the rank's slots from the cluster's checkpoint (or uses ``backend_factory``).
        device: paddle device of the tensors ("cpu", "gpu:0"; None = paddle's current one).
        block_ms: longest wait of the background loop between looks at Redis.
        publish_interval_s: publish the load window this often (None: only when a round collects).
        max_pause_bytes: this worker's pause budget: bytes one safe point may write into its live slots (None: the
            cluster's ``max_pause_bytes``, default 64 MiB; 0: no byte limit). A committed swap is applied in
            chunks of whole layers, one chunk per safe point, within every rank's budget.
        layers_per_safe_point: most changed layers one safe point switches (None: the cluster's; 0: no limit).
        **kwargs: the other :class:`RankAgent` arguments (``window_steps``, ``window_s``, ``heartbeat_ttl_ms``,
            ``backend_factory``, ``verify_all``, ``staging_budget_bytes`` ...).

    Raises:
        InputError: a URL without a cluster, both ``tensors`` and ``backend_factory``.

    Use as a context manager or call :meth:`close`; see README "Embedding in a serving worker".
    """

    def __init__(self, store: Store | str, ep_rank: int, *, cluster: str | None = None,
                 tensors: dict[str, list[Any]] | None = None, device: str | None = None, block_ms: int = 50,
                 publish_interval_s: float | None = 5.0, max_pause_bytes: int | None = None,
                 layers_per_safe_point: int | None = None, **kwargs: Any) -> None:
        if isinstance(store, str):
            if not cluster:
                raise InputError("EmbeddedAgent(url, ...) needs cluster=")
            store = Store(store, cluster)
        if tensors is not None:
            if kwargs.get("backend_factory") is not None:
                raise InputError("give the engine's tensors or a backend_factory, not both")
            kwargs["backend_factory"] = CheckpointBackend.attached(tensors, device)
        super().__init__(store, ep_rank, safe_points=True, device=device, publish_interval_s=publish_interval_s,
                         max_pause_bytes=max_pause_bytes, layers_per_safe_point=layers_per_safe_point, **kwargs)
        self.block_ms = int(block_ms)
        self._thread: threading.Thread | None = None
        self._close_lock = threading.Lock()
        self._loop_ended = False
        #: True when :meth:`close` gave up waiting for the background loop: the loop closes the store as it ends
        self.abandoned = False

    def start(self, info: dict[str, Any] | None = None) -> "EmbeddedAgent":
        """Load (or attach) the live experts, register the rank and start the background loop."""
        super().start(info)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"fdeplb-rank{self.ep_rank}")
        self._thread.start()
        return self

    def _loop(self) -> None:
        """The background thread: :meth:`run` until stopped; nothing raised leaves the thread (it is logged), and
        when :meth:`close` has abandoned it, the thread closes the store as it ends (its last user)."""
        try:
            self.run(block_ms=self.block_ms)
        except Exception as err:  # noqa: BLE001 - the engine's process must not see a traceback from our thread
            self.log.error("agent loop failed", error=str(err), error_type=type(err).__name__)
        finally:
            with self._close_lock:
                self._loop_ended = True
                abandoned = self.abandoned
            if abandoned:
                self.store.close()
                self.log.info("abandoned agent loop ended: store closed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the background loop and close the store's connections. Waits up to ``timeout_s`` seconds for the
        loop (a staging in progress, a disk read or a peer's transfer, cannot be cut short); past that the loop is
        abandoned (:attr:`abandoned`, a warning): it stops at the end of its step, sends no more heartbeats
        meanwhile, and closes the store itself as it ends, so the store is never closed under it. The rank's
        heartbeat then lapses after its TTL; the live experts stay as they are. A negative ``timeout_s`` waits 0 s.

        Raises:
            InputError: ``timeout_s`` not a finite number (NaN, infinity, None, a string, a bool), before anything is
                stopped or closed.
        """
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                or not math.isfinite(timeout_s)):
            raise InputError(f"timeout_s must be a finite number of seconds, got {timeout_s!r}: close() waits at "
                             "most that long for the agent's loop")
        self.stop_event.set()
        thread = self._thread
        if thread is not None:
            thread.join(max(float(timeout_s), 0.0))
        with self._close_lock:
            busy = thread is not None and not self._loop_ended
            self.abandoned = self.abandoned or busy
        if busy:
            self.log.warning("agent loop still busy at close: abandoned, it closes the store when its step ends",
                             timeout_s=timeout_s)
            return
        self.store.close()

    def __enter__(self) -> "EmbeddedAgent":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
