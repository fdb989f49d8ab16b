"""The safe-point switch protocol: the Python side of ``store/lua/switch.lua``.

A change of a rank's live experts (a committed swap, a weight clear or update) is prepared by the agent's
background thread and applied by the worker between two forward steps, at the step the ranks fix together (the
*switch step*). This module owns that hand-over: :class:`SafePointOp` (one pending change), :class:`Arm` (what an
armed worker publishes until its switch step is fixed) and :class:`SafePoints`, the agent's side of it
(:meth:`SafePoints.at_safe_point`, scheduling a change, reporting it once applied).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, NamedTuple

from fdeplb.errors import FdeplbError, InputError
from fdeplb.store import ClusterRecord


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


class SafePointOp:
    """A change of the live experts waiting for its safe point: ``fn`` runs in :meth:`SafePoints.at_safe_point`
    once the worker's step counter reaches ``switch_step`` (at once in a threaded agent). With ``arm``, the switch
    step is not known yet (None): the worker learns it at its safe points. ``gone``: the change stopped being the
    cluster's current one before its switch step was fixed (``done`` is set, ``fn`` never ran)."""

    def __init__(self, key: tuple, switch_step: int | None, arm: Arm | None, fn: Callable[[], Any]) -> None:
        self.key = key
        self.switch_step = switch_step
        self.arm = arm
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.applied_step = 0
        self.pause_ms = 0.0
        self.gone = False
        self.done = threading.Event()

    def apply(self, step: int) -> None:
        t0 = time.perf_counter()
        try:
            self.result = self.fn()
        except Exception as err:  # noqa: BLE001 - reported by the agent's loop (an alarm or a recorded failure)
            self.error = err
        self.pause_ms = (time.perf_counter() - t0) * 1000
        self.applied_step = step
        self.done.set()


class SafePoints:
    """The agent's side of the switch protocol, mixed into :class:`~fdeplb.orchestration.agent.RankAgent`.

    It keeps the worker's step counter (:attr:`steps`), the one pending change (``_op``), the pauses the worker
    was held for (:attr:`pauses_ms`) and the late switches (:attr:`late_switches`). It uses, of its host: ``store``,
    ``ep_rank``, ``actor``, ``log``, ``backend`` (whose ``phy2log`` it copies into ``_live_phy2log``, the routing
    the load recorder folds with, once a change is applied).
    """

    store: Any
    ep_rank: int
    actor: str
    log: Any
    backend: Any
    _live_phy2log: Any

    def _init_safe_points(self, safe_points: bool, switch_margin_steps: int) -> None:
        """``safe_points``: leave every change to :meth:`at_safe_point` (else apply it at once);
        ``switch_margin_steps``: see :meth:`at_safe_point` (>= 1; :class:`InputError` otherwise)."""
        if int(switch_margin_steps) < 1:
            raise InputError(f"switch_margin_steps must be >= 1, got {switch_margin_steps}")
        self.switch_margin_steps = int(switch_margin_steps)
        self.safe_points = bool(safe_points)
        self._sync_failures = 0
        self.steps = 0  # safe points passed (the worker's step counter)
        self.pauses_ms: collections.deque[float] = collections.deque(maxlen=10_000)
        self.late_switches = 0
        self._op: SafePointOp | None = None
        self._apply_lock = threading.Lock()  # held while a safe point applies a change (see at_safe_point)
        self._in_safe_point = False

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

        Call it at every step, also when the engine is idle: a change waits for every rank's safe points. Calls
        from several threads apply a change once; a call that arrives while another applies it waits for it.
        """
        self.steps += 1
        op = self._op
        if op is None or op.done.is_set():
            return False
        if op.switch_step is None and not self._learn_switch(op):
            return False
        if self.steps < op.switch_step:
            return False
        with self._apply_lock:  # a second thread at a safe point waits for the change, never applies it again
            if op.done.is_set():
                return False
            self._in_safe_point = True
            try:
                op.apply(self.steps)
                if op.error is None:
                    self._live_phy2log = self.backend.phy2log
            finally:
                self._in_safe_point = False
        self.pauses_ms.append(op.pause_ms)
        return True

    def _learn_switch(self, op: SafePointOp) -> bool:
        """An armed safe point: publish the step counter, read (or fix) the switch step; True once it is known."""
        arm = op.arm
        try:
            switch, status = self.store.arm_switch(self.ep_rank, arm.armed, self.steps, arm.field, arm.current,
                                                   self.switch_margin_steps, arm.withdrawn)
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
        op.switch_step = switch
        return True

    def _at_safe_point(self, key: tuple, when: Arm | int, fn: Callable[[], Any]) -> SafePointOp | None:
        """Have ``fn`` applied at a safe point (at once in a threaded agent): armed (``when`` an :class:`Arm`: at
        the switch step the ranks fix together, see :meth:`at_safe_point`) or at step ``when`` (0: the next one).
        Returns the op once it was applied (or is ``gone``), None while it waits. Idempotent per ``key``; an op
        whose change is gone is replaced by a new one (armed for what is current now)."""
        op = self._op
        if op is None or op.key != key or op.gone:
            arm = when if isinstance(when, Arm) else None
            if not self.safe_points:
                op = SafePointOp(key, 0, None, fn)
                op.apply(self.steps)
                self._live_phy2log = self.backend.phy2log
                self._op = None
                return op
            op = SafePointOp(key, None if arm is not None else int(when), arm, fn)
            self._op = op
        if not op.done.is_set():
            return None
        return op

    def _applied(self, op: SafePointOp, cluster: ClusterRecord, what: str) -> dict[str, Any]:
        """Rank-record fields reporting an applied op; raises the late alarm when it came after its switch step."""
        self._op = None
        late = op.applied_step - op.switch_step if op.switch_step and self.safe_points else 0
        if late > 0:
            self.late_switches += 1
            message = (f"rank {self.ep_rank} applied {what} at step {op.applied_step}, {late} step(s) past the "
                       f"switch step {op.switch_step}: the ranks' placements disagreed for those steps")
            self.log.error("late switch", applied_step=op.applied_step, switch_step=op.switch_step)
            self.store.emit_event("alarm", rank=self.ep_rank, message=message)
            self.store.append_alarm(cluster, actor=self.actor, reason=message)
        return {"applied_step": op.applied_step, "late_steps": max(late, 0)}

