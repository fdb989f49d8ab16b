"""The safe-point switch and its pause: the Python side of ``store/lua/switch.lua``.

A change of a rank's live experts (a committed swap, a weight clear or update) is prepared by the agent's
background thread and applied by the worker between two forward steps, at the step the ranks fix together (the
*switch step*). This module owns that hand-over: :class:`SafePointOp` (one pending change), :class:`Arm` (what an
armed worker publishes until its switch step is fixed), :class:`Chunked` (a swap applied in chunks of layers) and
:class:`SafePointSwitch`, the object the agent holds for it (:meth:`SafePointSwitch.at_safe_point`, scheduling a
change, reporting it once applied).

**The pause** is the time the worker is held in :meth:`SafePointSwitch.at_safe_point` while a change is applied:
measured per chunk by :meth:`SafePointOp.apply` (a probe run in it and the wait for a background prepare count too),
kept within the rank's pause budget (:class:`~fdeplb.weights.plan.PauseBudget`: the chunk layout the rank publishes
when it arms) and reported in the rank record by :meth:`SafePointSwitch.pause_fields` (``pause_max_ms``: the longest
safe point, ``pause_sum_ms``; ``benchmarks/swap.py`` and ``benchmarks/safe_point.py`` measure it).

**Chunks.** A committed swap is applied in chunks of whole layers, one chunk per safe point: chunk k at step
``switch_step + k`` on every rank. The layout is fixed with the switch step, in the same atomic script call
(``lua/switch.lua``): every armed rank publishes its own layout within its pause budget, the fixing call keeps their
union (so each rank's chunks fit its own budget) in the cluster record's ``switch_chunks`` and every rank reads it
back with the switch step. So every rank computes chunk k's step with no further Redis round trip, and switches a
given layer at the same step. Between chunks each layer routes with its own rows (switched with its weights).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from fdeplb.errors import FdeplbError, InputError
from fdeplb.failpoints import failpoint
from fdeplb.orchestration.probe import ProbeRun
from fdeplb.store import ClusterRecord
from fdeplb.weights.plan import chunk_layers

#: the cluster-record field holding a swap's fixed chunk layout (``lua/switch.lua``)
CHUNKS_FIELD = "switch_chunks"


class Arm(NamedTuple):
    """What an armed worker publishes and reads at every safe point until its change's switch step is fixed
    (:meth:`fdeplb.store.Store.arm_switch`)."""

    armed: str
    """The change, the same on every rank: ``swap:<round>:<plan_id>`` or ``weights:<request>``."""
    field: str
    """The cluster-record field that holds the change's switch step."""
    current: dict[str, Any]
    """Cluster-record fields that identify the change while it is the cluster's current one."""
    withdrawn: dict[str, Any] | None = None
    """Cluster-record fields that hold these values once the change was withdrawn (a cancelled weight request)."""


class Chunked(NamedTuple):
    """A swap applied in chunks of layers (one per safe point) instead of ``fn`` at once."""

    starts: tuple[int, ...]
    """This rank's own layout (first layer of each chunk), published when it arms."""
    changed: np.ndarray
    """int64 [n]: the layers the swap changes (the same on every rank)."""
    prepare: Callable[[tuple[int, ...]], Any]
    """Background work before a chunk's switch step (move its experts to the device)."""
    apply: Callable[[tuple[int, ...]], Any]
    """The chunk's pause: its copies, on-device check and routing rows; returns the chunk's report."""


class SafePointOp:
    """A change of the live experts waiting for its safe point: ``fn`` runs in :meth:`SafePointSwitch.at_safe_point`
    once the worker's step counter reaches ``switch_step`` (at once in a threaded agent). With ``arm``, the switch
    step is not known yet (None): the worker learns it at its safe points. ``gone``: the change stopped being the
    cluster's current one before its switch step was fixed (``done`` is set, ``fn`` never ran).

    With ``probe`` (a swap's :class:`~fdeplb.orchestration.probe.ProbeRun`), the probe runs in the safe point of
    the first chunk before it is applied and in that of the last after it is (both counted in those pauses: the
    worker is held for them).

    With ``chunked``, the change is applied in chunks: chunk k at the safe point where the step counter reaches
    ``switch_step + k`` (:attr:`chunks` is known once the switch step is); ``result`` is then the list of the
    chunks' results, ``pauses_ms`` / ``applied_steps`` one entry per applied chunk, ``done`` set after the last
    (or the first failed) one. The background thread prepares the next chunk (:meth:`prepare_next`) between its
    predecessor's safe point and its own; a chunk not prepared by then is prepared in its pause (``late_prepares``).
    """

    def __init__(self, key: tuple, switch_step: int | None, arm: Arm | None, fn: Callable[[], Any],
                 chunked: Chunked | None = None, probe: ProbeRun | None = None) -> None:
        self.key = key
        self.probe = probe  # run before the first chunk and after the last, in the same safe points
        self.switch_step = switch_step
        self.arm = arm
        self.fn = fn
        self.chunked = chunked
        self.chunks: list[tuple[int, ...]] | None = None if chunked is not None else [()]
        self.result: Any = None
        self.error: BaseException | None = None
        self.applied_steps: list[int] = []
        self.pauses_ms: list[float] = []
        self.late_prepares = 0
        self.prepare_error: BaseException | None = None  # the last background prepare's failure (retried in the pause)
        self.gone = False
        self.done = threading.Event()
        self.progress = threading.Event()  # set when the layout is learned and after every applied chunk
        self._lock = threading.Lock()  # one of prepare / apply at a time (they share the device buffer)
        self._next = 0
        self._prepared = -1

    @property
    def applied_step(self) -> int:
        """Step at which the last chunk (the whole change) was applied (0 = not yet)."""
        return self.applied_steps[-1] if self.applied_steps else 0

    @property
    def pause_ms(self) -> float:
        """The pauses of every applied chunk together (ms)."""
        return sum(self.pauses_ms)

    @property
    def safe_point_pauses_ms(self) -> list[float]:
        """The pause of each safe point that applied chunks (ms): the chunks applied at one step together (a rank
        late to its switch step, or a retry, may apply several at once)."""
        out: dict[int, float] = {}
        for step, ms in zip(self.applied_steps, self.pauses_ms):
            out[step] = out.get(step, 0.0) + ms
        return list(out.values())

    def set_layout(self, starts: tuple[int, ...]) -> None:
        """Fix the chunks from a layout (the cluster's, or this rank's own when unarmed)."""
        ch = self.chunked
        if ch is not None and self.chunks is None:
            try:
                chunks = chunk_layers(starts or ch.starts, ch.changed)
            except InputError:  # a layout that does not cover the swap (never written by switch.lua): at once
                chunks = [tuple(int(layer) for layer in ch.changed)]
            self.chunks = chunks or [()]
            self.progress.set()

    def due(self, step: int) -> bool:
        """A chunk's step is reached and it is not applied yet: chunk k at ``switch_step + k`` (several at once only
        for a rank past them); with no switch step (0: a retry, at the next safe point), one chunk per safe point."""
        if self.chunks is None or self._next >= len(self.chunks):
            return False
        if self.switch_step:
            return self.switch_step + self._next <= step
        return not self.applied_steps or self.applied_steps[-1] < step

    def prepare_next(self) -> None:
        """Background thread: prepare the next chunk to apply, once (its predecessor is applied: one device
        buffer). A failure is left to the chunk's pause, which prepares it again and reports the error."""
        ch, chunks = self.chunked, self.chunks
        if ch is None or chunks is None or self.done.is_set():
            return
        with self._lock:
            k = self._next
            if k >= len(chunks) or self._prepared >= k:
                return
            try:
                ch.prepare(chunks[k])
                self._prepared = k
            except Exception as err:  # noqa: BLE001 - retried in the chunk's pause, where an error is reported
                self.prepare_error = err  # the agent logs it (SafePointSwitch.wait_for_worker)

    def apply(self, step: int) -> None:
        """Apply every chunk whose step is reached (normally one; several only for a rank late to its switch
        step), each timed as its own pause; stops at the first error. The worker's wait for the background
        thread to finish preparing (the two share the device buffer) counts in the first chunk's pause: the
        worker is held for it."""
        held = time.perf_counter()
        with self._lock:
            results = self.result if isinstance(self.result, list) else []
            while self.due(step):
                k = self._next
                t0 = held if held is not None else time.perf_counter()
                held = None
                try:
                    if k == 0 and self.probe is not None:  # the old placement, before anything changes
                        self.probe.before()
                    if self.chunked is None:
                        results.append(self.fn())
                    else:
                        if self._prepared < k:
                            self.late_prepares += 1
                            self.chunked.prepare(self.chunks[k])
                            self._prepared = k
                        results.append(self.chunked.apply(self.chunks[k]))
                except Exception as err:  # noqa: BLE001 - reported by the agent's loop (an alarm or a failure)
                    self.error = err
                self.pauses_ms.append((time.perf_counter() - t0) * 1000)
                self.applied_steps.append(step)
                self._next = k + 1
                if self.error is not None:
                    break
            self.result = results if self.chunked is not None else (results[0] if results else None)
            if self.error is None and self._next >= len(self.chunks) and self.probe is not None:
                t0 = time.perf_counter()
                self.probe.after()  # the new placement, in the last chunk's safe point: part of its pause
                self.pauses_ms[-1] += (time.perf_counter() - t0) * 1000
            if self.error is not None or self._next >= len(self.chunks):
                self.done.set()
            self.progress.set()

    def late_steps(self) -> int:
        """Most steps any chunk was applied past its own switch step (0 = every chunk on time)."""
        if not self.switch_step:
            return 0
        return max((s - (self.switch_step + k) for k, s in enumerate(self.applied_steps)), default=0)


class SafePointSwitch:
    """The worker's side of the switch protocol, held by the rank agent (``agent.switch``).

    It keeps the worker's step counter (:attr:`steps`), the one pending change (:attr:`op`), the pauses the worker
    was held for (:attr:`pauses_ms`, ms, one per safe point that applied a change) and the late switches
    (:attr:`late_switches`).

    Args:
        store: the cluster's :class:`~fdeplb.store.Store` (``arm_switch``, events, alarms).
        ep_rank, actor, log: the rank, its audit actor and its bound logger.
        safe_points: leave every change to :meth:`at_safe_point` (else apply it at once, in the caller's thread).
        switch_margin_steps: see :meth:`at_safe_point` (>= 1).
        applied: called after every applied change (the agent re-reads the routing its load recorder folds with).

    Raises:
        InputError: ``switch_margin_steps`` < 1.
    """

    def __init__(self, store: Any, ep_rank: int, actor: str, log: Any, *, safe_points: bool,
                 switch_margin_steps: int, applied: Callable[[], None]) -> None:
        if int(switch_margin_steps) < 1:
            raise InputError(f"switch_margin_steps must be >= 1, got {switch_margin_steps}")
        self.store, self.ep_rank, self.actor, self.log, self.applied = store, int(ep_rank), actor, log, applied
        self.switch_margin_steps = int(switch_margin_steps)
        self.safe_points = bool(safe_points)
        self._sync_failures = 0
        self.steps = 0  # safe points passed (the worker's step counter)
        self.safe_point_t = time.monotonic()  # of the last safe point (from the start: an engine that never steps)
        self.pauses_ms: collections.deque[float] = collections.deque(maxlen=10_000)
        self.late_switches = 0
        self.op: SafePointOp | None = None  # the one pending change
        self._apply_lock = threading.Lock()  # held while a safe point applies a change (see at_safe_point)
        self._in_safe_point = False

    def safe_point_age_ms(self, now: float) -> int | None:
        """ms from the worker's last safe point (or the switch's making) to ``now`` (``time.monotonic()`` s), as
        the heartbeat reports it; None for an agent whose changes apply at once (no engine calls
        :meth:`at_safe_point`, so none can hang)."""
        return round((now - self.safe_point_t) * 1000) if self.safe_points else None

    def at_safe_point(self) -> bool:
        """Call between forward steps: counts the step and applies a pending change whose switch step is reached.

        This is the only place the live expert tensors and the routing tables (phy2log, log2phy, logcnt) change
        in an embedded agent: a committed swap (staged in the background), a weight clear or a weight update.
        With nothing pending it returns at once (see ``benchmarks/safe_point.py``). Returns True when it applied
        a change (the worker was held for the in-place copy only: staging is done before the rank arms).

        **Ranks switch together, by construction.** Every EP rank applies a change at the safe point where its
        step counter reaches the change's *switch step*, so every rank routes step ``switch_step + 1`` with the new
        placement. The switch step is not estimated from lazily reported counters; it is fixed from the ranks'
        current counters once every rank is ready for the change:

        1. *Armed window.* Once the background thread has prepared a change (a committed swap: staged, rank
           SWAPPING; a weight request: the rank's weight-status transition committed, or nothing to do on this
           rank), the rank is *armed*: at every safe point it runs one atomic Redis script
           (:meth:`fdeplb.store.Store.arm_switch`, ``lua/switch.lua``) that publishes its step counter and reads the
           switch step. Outside that window this method does no I/O.
        2. *Fixed from current steps.* The first such call that finds *every* rank armed for the same change fixes
           the switch step at ``max(armed step of every rank) + switch_margin_steps``, atomically with that read.
           A rank whose last call published step s makes its next call at step s + 1 <= switch step, so every
           armed rank learns the switch step before reaching it, however late its background thread learned of
           the change or however slow its worker is (a rank not armed yet holds everyone back: nobody switches).
        3. *Past it anyway.* Only a rank that could not reach Redis at its armed safe points (the script failed:
           logged, the worker keeps serving the old placement), or one whose weight request was overtaken by a
           newer one (see :class:`~fdeplb.orchestration.weight_status.WeightStatusDriver`), can find itself past
           the switch step. It then applies the change at once (a committed plan only rolls forward; a weight
           request is carried out), records ``late_steps`` in its rank record and raises an ``alarm`` (event and
           audit record) naming the steps during which the ranks' placements disagreed: tokens routed then may
           have reached the wrong expert (``examples/serving_node.py`` counts them and fails).

        4. *Chunks.* A committed swap is applied in chunks of layers within the pause budget, chunk k at the safe
           point where the counter reaches ``switch_step + k`` (the layout is fixed with the switch step, see the
           module doc); each returns True and is one entry of :attr:`pauses_ms`. The rank is SWAPPED after the
           last one.

        Call it at every step, also when the engine is idle: a change waits for every rank's safe points. Calls
        from several threads apply a change once; a call that arrives while another applies it waits for it.
        """
        self.steps += 1
        self.safe_point_t = time.monotonic()  # the heartbeat reports it: a hung engine is suspected (stale_of)
        op = self.op
        if op is None or op.done.is_set():
            return False
        if op.switch_step is None and not self._learn_switch(op):
            return False
        if not op.due(self.steps):
            return False
        with self._apply_lock:  # a second thread at a safe point waits for the change, never applies it again
            if op.done.is_set() or not op.due(self.steps):
                return False
            self._in_safe_point = True
            applied = len(op.pauses_ms)
            try:
                op.apply(self.steps)
                self.applied()  # after a failed chunk: the restored placement
            finally:
                self._in_safe_point = False
        self.pauses_ms.append(sum(op.pauses_ms[applied:]))
        if not op.done.is_set():  # between two chunks (kill tests: rank.chunk.hang=<chunks applied>)
            chunks = str(len(op.pauses_ms))
            failpoint("rank.chunk.hang", chunks, lambda: self.store.emit_event(
                "failpoint", name="rank.chunk.hang", rank=self.ep_rank, chunks=chunks, step=self.steps))
        return True

    def _learn_switch(self, op: SafePointOp) -> bool:
        """An armed safe point: publish the step counter, read (or fix) the switch step; True once it is known."""
        arm = op.arm
        chunked = op.chunked
        try:
            switch, status, layout = self.store.arm_switch(
                self.ep_rank, arm.armed, self.steps, arm.field, arm.current, self.switch_margin_steps, arm.withdrawn,
                chunks=chunked.starts if chunked is not None else (), chunks_field=CHUNKS_FIELD if chunked else "")
        except FdeplbError as err:  # keep serving the old placement; past the switch step it applies late, alarmed
            self._sync_failures += 1
            if self._sync_failures in (1, 10, 100) or self._sync_failures % 1000 == 0:
                self.log.warning("armed safe point could not reach Redis", armed=arm.armed, step=self.steps,
                                 failures=self._sync_failures, error=str(err))
            return False
        if status in ("gone", "cancelled"):  # superseded or withdrawn before its switch step was fixed: the
            # background thread decides again (a cancelled request: the rank's cancel transition)
            op.gone = True
            op.done.set()
            return False
        if switch <= 0:
            return False  # waiting for the other ranks to arm
        op.set_layout(layout)
        op.switch_step = switch
        return True

    def schedule(self, key: tuple, when: Arm | int, fn: Callable[[], Any],
                       chunked: Chunked | None = None, probe: ProbeRun | None = None) -> SafePointOp | None:
        """Have ``fn`` applied at a safe point (at once in a threaded agent): armed (``when`` an :class:`Arm`: at
        the switch step the ranks fix together, see :meth:`at_safe_point`) or at step ``when`` (0: the next one).
        With ``chunked`` (safe points only), the change is applied chunk by chunk instead of ``fn``: armed, in
        the layout fixed with the switch step; at step ``when``, in this rank's own layout, every chunk due then.
        Returns the op once it was applied (or is ``gone``), None while it waits. Idempotent per ``key``; an op
        whose change is gone is replaced by a new one (armed for what is current now). ``probe``: the swap's
        output probe, run before the first chunk and after the last (:mod:`~fdeplb.orchestration.probe`)."""
        op = self.op
        if op is None or op.key != key or op.gone:
            arm = when if isinstance(when, Arm) else None
            if not self.safe_points:
                op = SafePointOp(key, 0, None, fn, probe=probe)
                op.apply(self.steps)
                self.applied()
                self.op = None
                return op
            op = SafePointOp(key, None if arm is not None else int(when), arm, fn, chunked, probe)
            if arm is None:
                op.set_layout(())
            self.op = op
        if not op.done.is_set():
            return None
        return op

    def applied_fields(self, op: SafePointOp, cluster: ClusterRecord, what: str) -> dict[str, Any]:
        """Rank-record fields reporting an applied op; raises the late alarm when it came after its switch step."""
        self.op = None
        late = op.late_steps() if self.safe_points else 0
        if late > 0:
            self.late_switches += 1
            message = (f"rank {self.ep_rank} applied {what} at step {op.applied_step}, {late} step(s) past the "
                       f"switch step {op.switch_step}: the ranks' placements disagreed for those steps")
            self.log.error("late switch", applied_step=op.applied_step, switch_step=op.switch_step)
            self.store.emit_event("alarm", rank=self.ep_rank, message=message)
            self.store.append_alarm(cluster, actor=self.actor, reason=message)
        return {"applied_step": op.applied_step, "late_steps": max(late, 0)}

    @staticmethod
    def pause_fields(op: SafePointOp) -> dict[str, Any]:
        """Rank-record fields reporting a swap's pause: ``swap_ms`` / ``pause_sum_ms`` (every chunk's pause, ms),
        ``pause_max_ms`` (the longest safe point, ms: what the pause budget bounds), ``chunks``, ``late_prepares``."""
        return {"swap_ms": round(op.pause_ms, 3), "chunks": len(op.pauses_ms), "late_prepares": op.late_prepares,
                "pause_max_ms": round(max(op.safe_point_pauses_ms, default=0.0), 3),
                "pause_sum_ms": round(op.pause_ms, 3)}

    def wait_for_worker(self, op: SafePointOp, timeout_s: float) -> None:
        """The background loop while the worker's safe points apply ``op``: prepare its next chunk, then wait
        (at most ``timeout_s``) for the next chunk to be applied or the layout to be learned."""
        op.progress.clear()
        op.prepare_next()
        err, op.prepare_error = op.prepare_error, None
        if err is not None:  # the chunk is prepared again in its pause (counted in late_prepares), which reports
            # a failure there; this one is logged so a load that failed and then succeeded is not silent
            self.log.warning("chunk prepare failed in the background; retried in its pause", error=str(err),
                             error_type=type(err).__name__, chunk=op._next)
        op.progress.wait(timeout_s)

