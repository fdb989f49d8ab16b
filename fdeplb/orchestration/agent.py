"""The rank agent: lives inside each serving worker (one per EP rank) and drives that rank's machine.

It talks to the rest of the cluster only through Redis. It publishes the rank's expert_load window when a round
collects, stages the experts its new slots need while the cluster is LOADING, swaps them into the live slot tensors
in place once the plan is committed (SWAPPING), and reports each step as a transition of its rank record.

Like the coordinator it is a reconcile loop over (cluster record, own rank record): every state has idempotent
entry work, so an agent restarted at any point rebuilds its live experts from the cluster's *current placement*
and carries on from what the records say.

Two ways to run it, built on the same pieces:

- **threaded** (:meth:`RankAgent.run`, the simulated cluster): the loop applies swaps and weight clear / update in
  its own thread as soon as it reaches them;
- **embedded in a serving worker** (:class:`EmbeddedAgent`): the worker calls :meth:`RankAgent.record` once per
  forward step and :meth:`RankAgent.at_safe_point` between steps; the loop runs in a background thread, stages in
  the background, and leaves every change of the live expert tensors and routing tables (a committed swap, a weight
  clear or update) to the safe point where the worker's step counter reaches the change's *switch step* (see
  :meth:`RankAgent.at_safe_point`), so that every EP rank switches at the same step.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple

import numpy as np
import structlog

from fdeplb.errors import FdeplbError, GuardError, InputError, RedisUnavailableError, StaleStateError, StateError, \
    VerificationError, WeightError
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import RANK, WEIGHTS, ClusterState, RankState, WeightState, entry_work
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.placement import check_counts, routing_digest
from fdeplb.store import ClusterConfig, ClusterRecord, PendingCall, RankRecord, Store, WeightRecord
from fdeplb.store.redis_store import SWITCH_MARGIN_STEPS
from fdeplb.weights.backend import BackendFactory, CheckpointBackend, Staged, SwapReport, WeightBackend

log = structlog.get_logger("fdeplb.agent")

class _Staging(NamedTuple):
    """What the agent staged for one plan."""

    plan_id: str
    staged: Staged


#: returns the rank's expert_load window, int64 [num_layers, num_logical_experts], for a round.
LoadSource = Callable[[int], np.ndarray]

_INT64_MAX = np.iinfo(np.int64).max


class ExpertLoadWindow:
    """The rank's sliding expert_load window: the last ``steps`` recorded steps (vLLM's ``expert_load_window``)
    and/or the steps of the last ``seconds`` seconds, summed in int64 (exact past 2**31, where FastDeploy's int32
    accumulator wraps). Thread-safe: the worker adds, the agent's background thread reads.

    Args:
        num_layers, num_logical_experts: the shape [L, E] of one step's load.
        steps: keep at most this many steps (None: no step limit; then ``seconds`` is needed).
        seconds: drop steps older than this (None: no time limit).
        clock: monotonic seconds (tests pass their own).

    Raises:
        InputError: neither limit given, or a limit that is not positive.
    """

    def __init__(self, num_layers: int, num_logical_experts: int, *, steps: int | None = 1000,
                 seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if steps is None and seconds is None:
            raise InputError("a load window needs steps, seconds or both")
        if (steps is not None and int(steps) < 1) or (seconds is not None and not float(seconds) > 0):
            raise InputError(f"load window limits must be positive, got steps={steps!r} seconds={seconds!r}")
        self.shape = (int(num_layers), int(num_logical_experts))
        self.max_steps = None if steps is None else int(steps)
        self.seconds = None if seconds is None else float(seconds)
        self.clock = clock
        self._entries: collections.deque[tuple[float, np.ndarray]] = collections.deque()
        self._total = np.zeros(self.shape, dtype=np.int64)
        self._lock = threading.Lock()

    def add(self, load: np.ndarray) -> None:
        """Add one step's load, int64 [L, E], each count >= 0 (checked by the caller; the window keeps ``load``
        itself).

        Raises:
            InputError: the window's sum would pass the int64 range (it would wrap to negative counts); nothing
                is added then.
        """
        now = self.clock()
        with self._lock:
            self._expire(now)  # time-based: would drop on any read as well
            full = self.max_steps is not None and len(self._entries) == self.max_steps
            kept = self._total - self._entries[0][1] if full else self._total  # >= 0: no wrap below
            # per serving step: the two maxima bound every sum; the elementwise test only when they could wrap
            if (load.size and int(load.max()) > _INT64_MAX - int(np.max(kept))
                    and bool(np.any(load > _INT64_MAX - kept))):
                raise InputError("expert counts would take the load window's sum past the int64 range")
            if full:
                self._total -= self._entries.popleft()[1]
            self._entries.append((now, load))
            self._total += load

    def _expire(self, now: float) -> None:
        if self.seconds is not None:
            while self._entries and self._entries[0][0] < now - self.seconds:
                self._total -= self._entries.popleft()[1]

    def total(self) -> np.ndarray:
        """The window's sum, int64 [L, E] (a copy)."""
        with self._lock:
            self._expire(self.clock())
            return self._total.copy()

    def __len__(self) -> int:
        """Steps in the window."""
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Empty the window (FastDeploy's ``clear_stat``)."""
        with self._lock:
            self._entries.clear()
            self._total[...] = 0


class _Arm(NamedTuple):
    """What an armed worker publishes and reads at every safe point until its change's switch step is fixed
    (:meth:`fdeplb.store.Store.arm_switch`)."""

    armed: str
    """The change, the same on every rank: ``swap:<round>:<plan_id>`` or ``weights:<request>``."""
    field: str
    """The cluster-record field that holds the change's switch step."""
    current: dict[str, Any]
    """Cluster-record fields that identify the change while it is the cluster's current one."""


class _SafePointOp:
    """A change of the live experts waiting for its safe point: ``fn`` runs in :meth:`RankAgent.at_safe_point` once
    the worker's step counter reaches ``switch_step`` (at once in a threaded agent). With ``arm``, the switch step
    is not known yet (None): the worker learns it at its safe points (:meth:`RankAgent.at_safe_point`). ``gone``:
    the change stopped being the cluster's current one before its switch step was fixed (``done`` is set, ``fn``
    never ran)."""

    def __init__(self, key: tuple, switch_step: int | None, arm: _Arm | None, fn: Callable[[], Any]) -> None:
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


class RankAgent:
    """Agent of one EP rank.

    ``load_source(round)`` gives this rank's expert_load window (int64 [L, E], tokens x top-k assignments).
    ``backend_factory`` builds the rank's :class:`~fdeplb.weights.WeightBackend` from the cluster's checkpoint and
    current placement (default: :class:`~fdeplb.weights.CheckpointBackend` on ``device``, paddle tensors;
    :class:`fdeplb.testing.NumpyWeights` runs without paddle).
    ``staging_budget_bytes``: staging refuses (rank LOAD_FAILED) plans that need more host memory than this.
    ``verify_all``: after each swap, compare *every* slot of the rank with the checkpoint (re-reads the rank's
    whole share from disk; the demo and tests do it). Otherwise only the slots the swap wrote are verified, by the
    backend's swap itself.
    ``load_source`` defaults to the agent's own :class:`ExpertLoadWindow` (``window_steps`` / ``window_s``), fed
    by :meth:`record`. ``safe_points``: leave every change of the live experts to :meth:`at_safe_point` (an
    embedded agent, see :class:`EmbeddedAgent`); otherwise the loop applies them itself.
    ``publish_interval_s``: also publish the load window this often (None: only when a round collects).
    ``heartbeat_ttl_ms``: the heartbeat's time to live; the rank is stale (no round starts) once it lapses.
    ``switch_margin_steps``: when this rank is the one that fixes a switch step, the steps it adds to the largest
    armed step counter (>= 1; see :meth:`at_safe_point`).
    """

    def __init__(self, store: Store, ep_rank: int, *, load_source: LoadSource | None = None,
                 backend_factory: BackendFactory | None = None, staging_budget_bytes: int | None = None,
                 device: str | None = None, actor: str | None = None, verify_all: bool = False,
                 safe_points: bool = False, window_steps: int | None = 1000, window_s: float | None = None,
                 publish_interval_s: float | None = None, heartbeat_ttl_ms: int = 10_000,
                 switch_margin_steps: int = SWITCH_MARGIN_STEPS) -> None:
        if heartbeat_ttl_ms < 100:
            raise InputError(f"heartbeat_ttl_ms must be >= 100, got {heartbeat_ttl_ms}")
        if int(switch_margin_steps) < 1:
            raise InputError(f"switch_margin_steps must be >= 1, got {switch_margin_steps}")
        self.switch_margin_steps = int(switch_margin_steps)
        self._sync_failures = 0
        self.store = store
        self.ep_rank = int(ep_rank)
        self.load_source = load_source or (lambda _round: self.window.total())
        self.safe_points = bool(safe_points)
        self.window_steps, self.window_s = window_steps, window_s
        self.window: ExpertLoadWindow | None = None
        self.publish_interval_s = publish_interval_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_ms)
        self.steps = 0  # safe points passed (the worker's step counter)
        self.pauses_ms: collections.deque[float] = collections.deque(maxlen=10_000)
        self.late_switches = 0
        self._op: _SafePointOp | None = None
        self._apply_lock = threading.Lock()  # held while a safe point applies a change (see at_safe_point)
        self._in_safe_point = False
        self._live_phy2log: np.ndarray | None = None
        self._next_publish = 0.0
        self._published_round = -1  # the newest round this agent knows its window was published for
        self._plan_read: tuple[str, np.ndarray | None] = ("", None)  # (plan_id, its new phy2log)
        self._hb = (0.0, 0, 0.0)  # (monotonic time, steps, steps_per_s) of the last heartbeat
        self._clear_stat_seen = 0
        self._swap_attempts: dict[str, int] = {}
        self.backend_factory = backend_factory or CheckpointBackend.factory(device=device)
        self.staging_budget_bytes = staging_budget_bytes
        self.verify_all = verify_all
        self.actor = actor or f"rank{ep_rank}@{os.getpid()}"
        self.agent_id = uuid.uuid4().hex  # this agent instance, in the registry (see _check_superseded)
        self.stop_event = threading.Event()
        self.config: ClusterConfig | None = None
        self.backend: WeightBackend | None = None
        self.live_plan_id: str | None = None
        self.staged: _Staging | None = None
        self._stage_ms = 0.0
        self._load_failed_round = -1
        self._outbox: list[PendingCall] = []  # the step's last writes, sent with the next wait (see run)
        self.rank = RecordHandle(store, RANK, self.ep_rank, actor=self.actor)
        self.weights = RecordHandle(store, WEIGHTS, self.ep_rank, actor=self.actor)
        self.log = log.bind(ep_rank=self.ep_rank, cluster=store.cluster)

    # ---- start-up -------------------------------------------------------------------------------------------------
    def start(self, info: dict[str, Any] | None = None) -> None:
        """Load the live experts of the cluster's current placement and register the rank."""
        self.config = self.store.read_config()
        if not 0 <= self.ep_rank < self.config.ep_size:
            raise InputError(f"ep_rank {self.ep_rank} outside [0, {self.config.ep_size})")
        self.rank.ensure()
        self.weights.ensure()
        me = self.rank.read()  # a restarted worker's step counter carries on from the last one it published
        self.steps = max(self.steps, me.step, me.armed_step)
        placement = self.store.current_placement()
        t0 = time.perf_counter()
        self.backend = self.backend_factory(self.config.checkpoint, placement.phy2log, self.ep_rank,
                                            self.config.ep_size)
        self._live_phy2log = self.backend.phy2log
        self.live_plan_id = placement.plan_id
        if self.window is None:
            self.window = ExpertLoadWindow(self.config.num_layers, self.config.num_logical_experts,
                                           steps=self.window_steps, seconds=self.window_s)
        self._clear_stat_seen = self.store.read_cluster().clear_stat_request  # a fresh window is empty
        self.store.register_rank(self.ep_rank, {"pid": os.getpid(), "actor": self.actor, "agent_id": self.agent_id,
                                                **(info or {})})
        self._heartbeat(force=True, live_plan_id=placement.plan_id, clear_stat=self._clear_stat_seen,
                        routing_digest=routing_digest(self.backend.phy2log))
        self.store.emit_event("rank_ready", rank=self.ep_rank, plan_id=placement.plan_id)
        self.log.info("ready", plan_id=placement.plan_id, load_s=round(time.perf_counter() - t0, 3))

    # ---- loop ---------------------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None, block_ms: int = 1_000) -> None:
        """Reconcile until :attr:`stop_event` is set or ``until()`` is true (asked after every step, a failed one
        included). A lost Redis connection is logged and retried every 0.5 s; any other exception out of a step (a
        typed :class:`FdeplbError` or a bug) raises an ``alarm`` event and is retried after 1 s: no value kills the
        loop. The worker's live experts keep serving either way.

        One round trip per wake-up (issue #9): a step's last write (a load window, or a transition after which only
        a cluster change gives the rank work: ``staged``, ``swapped``, ``finish``) is not sent on its own but
        with the wait that follows it, and the wait reads the next step's view as it returns
        (:meth:`fdeplb.store.Store.wait_view`)."""
        if self.backend is None:
            self.start()
        cursor = None  # on the signal stream: wakes on cluster-record changes only (not every rank's transitions)
        view = None
        try:
            while not self.stop_event.is_set():
                try:
                    if cursor is None:  # in the loop: Redis may be away when run() begins
                        cursor = self.store.signal_cursor()
                    given, view = view, None
                    try:
                        progressed = self.step(given, send=False)
                    except (StaleStateError, GuardError) as err:
                        self.log.info("retry", error=str(err))
                        progressed = True
                    if until is not None and until():
                        return
                    if progressed and self._outbox:  # the next step reads: it must see this one's writes
                        self._send()
                    if not progressed:
                        self._heartbeat()
                        op = self._op
                        if op is not None and not op.done.is_set():  # the worker's safe point applies it
                            self._send()
                            op.done.wait(self._wait_ms(block_ms) / 1000)
                        else:
                            view = self._send(cursor, self._wait_ms(block_ms))
                except RedisUnavailableError as err:  # Redis away: the live experts keep serving
                    self.log.warning("redis unavailable", error=str(err))
                    if until is not None and until():
                        return
                    self.stop_event.wait(0.5)
                except Exception as err:  # noqa: BLE001 - a missing plan, a corrupt record, a bug: keep serving
                    self.log.error("step failed", error=str(err), error_type=type(err).__name__)
                    try:
                        self.store.emit_event("alarm", rank=self.ep_rank, message=f"agent step failed: {err}")
                    except FdeplbError:
                        pass
                    if until is not None and until():
                        return
                    self.stop_event.wait(1.0)
        finally:
            try:
                self._send()
            except FdeplbError as err:
                self.log.warning("last writes not sent", error=str(err))

    def _send(self, cursor: dict | None = None, block_ms: int = 0) -> Any:
        """Send the deferred writes (one round trip); with ``cursor``, in the pipeline of the wait on it, and
        return the view read after the wait. A refused write is logged (the next step sees why in the view); when
        the round trip fails, the writes' fate is unknown and the next steps redo them (the load window: its
        round is looked up again)."""
        writes, self._outbox = self._outbox, []
        try:
            if cursor is None:
                outcomes, view = self.store.send(writes), None
            else:
                _, view, outcomes = self.store.wait_view(cursor, self.ep_rank, block_ms, writes)
        except FdeplbError:
            if writes:
                self._published_round = -1
            raise
        for w, out in zip(writes, outcomes):
            if isinstance(out, StateError):  # a lost race: the view read with it shows why
                self.log.info("retry", write=w.what, error=str(out))
            elif isinstance(out, FdeplbError):  # Redis refused the write itself (out of memory, read-only replica)
                self.log.error("write failed", write=w.what, error=str(out))
                try:
                    self.store.emit_event("alarm", rank=self.ep_rank, message=f"{w.what} failed: {out}")
                except FdeplbError:
                    pass  # logged above; the next step redoes the write
            if isinstance(out, FdeplbError):
                self._published_round = -1
        return view

    def _wait_ms(self, block_ms: int) -> int:
        """How long the loop may block: ``block_ms``, cut short by the next heartbeat and the next periodic
        load publication (both are timers, not wake-ups)."""
        now = time.monotonic()
        due = self._hb[0] + self.heartbeat_ttl_ms / 4000
        if self.publish_interval_s:
            due = min(due, self._next_publish)
        return max(1, min(int(block_ms), int((due - now) * 1000) + 1))

    def step(self, view: tuple[ClusterRecord, RankRecord, WeightRecord] | None = None, *, send: bool = True) -> bool:
        """One reconcile step on ``view`` (cluster, own rank and weight-status records; read now when None);
        True if the caller should look again without waiting. With ``send`` (the default) the step's deferred
        writes are sent before it returns (True then); :meth:`run` leaves them to its wait."""
        progressed = self._reconcile(*(view or self.store.read_view(self.ep_rank)))
        if send and self._outbox:
            self._send()
            return True
        return progressed

    def _reconcile(self, cluster: ClusterRecord, me: RankRecord, weights: WeightRecord) -> bool:
        self._failpoint(me)
        if cluster.clear_stat_request > self._clear_stat_seen:
            self.window.clear()
            self._clear_stat_seen = cluster.clear_stat_request
            self.rank.update(clear_stat=cluster.clear_stat_request)
        if cluster.state is ClusterState.COLLECTING:
            self._publish_load(cluster)  # nothing else to do for it: no second look needed
        if self.publish_interval_s and time.monotonic() >= self._next_publish:
            self._next_publish = time.monotonic() + self.publish_interval_s
            self.store.publish_load(self.ep_rank, cluster.round, self.load_source(cluster.round).astype(np.int64))
        if self._weights_step(cluster, weights):
            return True
        self.rank.take_committed()
        progressed = ENTRY_WORK[me.state](self, me, cluster)
        # chain this rank's own transitions (stage -> staged, swap -> swapped) on the record the commit left,
        # without reading it again: the cluster record read above is at most as stale as a fresh read would be
        # by the time of the next commit, and every commit still checks version and guards in Redis
        for _ in RankState:
            after = self.rank.take_committed()
            if not progressed or after is None:
                break
            self._failpoint(after)
            progressed = ENTRY_WORK[after.state](self, after, cluster)
        return progressed

    def _failpoint(self, me: RankRecord) -> None:
        """The ``rank.hang`` failpoint (tests): before the entry work of every rank state this agent runs."""
        failpoint("rank.hang", me.state,
                  lambda: self.store.emit_event("failpoint", name="rank.hang", state=me.state, rank=self.ep_rank))

    # ---- the worker's side: record, safe points ------------------------------------------------------------------
    def record(self, counts: Any, *, physical: bool | None = None) -> None:
        """Add one forward step's routed tokens to the load window. Call once per step from the worker.

        ``counts``: tokens x top-k assignments per logical expert, [num_layers, num_logical_experts], or per
        physical slot, [num_layers, num_physical_experts] (summed into logical experts through the *live* phy2log,
        the one the step routed with); a numpy array or a paddle tensor of any integer dtype. ``physical`` says
        which (None: by shape; when E == P a [L, E] array is taken as logical). Accumulated in int64.

        Raises:
            InputError: not an integer array (float, NaN, bool, ragged), wrong shape, a negative count, a count
                past the int64 range (also once summed per logical expert or into the window), or the agent is
                not started. Nothing is recorded then.
        """
        if self.window is None or self._live_phy2log is None:
            raise InputError("record() before start(): the agent has no load window yet")
        arr = counts
        if not isinstance(arr, np.ndarray):
            try:
                arr = arr.numpy() if hasattr(arr, "numpy") else np.asarray(arr)
            except ValueError as err:  # a ragged nested list
                raise InputError(f"expert counts are not an array: {err}") from None
        if arr.dtype.kind not in "iu":
            raise InputError(f"expert counts must be an integer array, got dtype {arr.dtype}")
        num_layers, num_phy = self._live_phy2log.shape
        num_log = self.window.shape[1]
        wanted = f"{(num_layers, num_log)} (logical) or {(num_layers, num_phy)} (physical)"
        if physical is None:
            physical = arr.shape == (num_layers, num_phy) and num_phy != num_log
        else:
            physical = bool(physical)
            wanted = f"{(num_layers, num_phy) if physical else (num_layers, num_log)} (physical={physical})"
        expected = (num_layers, num_phy) if physical else (num_layers, num_log)
        if arr.shape != expected:
            raise InputError(f"expert counts have shape {arr.shape}, expected {wanted}")
        if arr.size:
            if arr.dtype.kind == "i" and int(arr.min()) < 0:
                raise InputError(f"expert counts must be >= 0, found {int(arr.min())}")
            if arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:
                raise InputError(f"expert count {int(arr.max())} is past the int64 range")
        arr = arr.astype(np.int64)
        if physical:
            # a layer's row sum bounds each of its logical sums: past int64 // P, fold exactly in Python ints
            wide = arr.size and int(arr.max()) > _INT64_MAX // num_phy
            logical = np.zeros((num_layers, num_log), dtype=object if wide else np.int64)
            np.add.at(logical, (np.arange(num_layers)[:, None], self._live_phy2log), arr.astype(logical.dtype))
            if wide and max(logical.ravel().tolist()) > _INT64_MAX:
                raise InputError("expert counts per slot sum past the int64 range for a logical expert")
            arr = logical.astype(np.int64)
        self.window.add(arr)

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
           newer one (see :meth:`_weights_step`), can find itself past the switch step. It then
           applies the change at once (a committed plan only rolls forward; a weight request is carried out),
           records ``late_steps`` in its rank record and raises an ``alarm`` (event and audit record) naming the
           steps during which the ranks' placements disagreed: tokens routed then may have reached the wrong
           expert (``examples/serving_node.py`` counts them and fails).

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

    def _learn_switch(self, op: _SafePointOp) -> bool:
        """An armed safe point: publish the step counter, read (or fix) the switch step; True once it is known."""
        arm = op.arm
        try:
            switch, status = self.store.arm_switch(self.ep_rank, arm.armed, self.steps, arm.field, arm.current,
                                                   self.switch_margin_steps)
        except FdeplbError as err:  # keep serving the old placement; past the switch step it applies late, alarmed
            self._sync_failures += 1
            if self._sync_failures in (1, 10, 100) or self._sync_failures % 1000 == 0:
                self.log.warning("armed safe point could not reach Redis", armed=arm.armed, step=self.steps,
                                 failures=self._sync_failures, error=str(err))
            return False
        if status == "gone":  # superseded before its switch step was fixed: the background thread decides again
            op.gone = True
            op.done.set()
            return False
        if switch <= 0:
            return False  # waiting for the other ranks to arm
        op.switch_step = switch
        return True

    @property
    def serving(self) -> bool:
        """False while the rank's expert weights are cleared (the worker must not run a forward step)."""
        return self.backend is not None and not self.backend.cleared

    def _at_safe_point(self, key: tuple, when: "_Arm | int", fn: Callable[[], Any]) -> _SafePointOp | None:
        """Have ``fn`` applied at a safe point (at once in a threaded agent): armed (``when`` an :class:`_Arm`: at
        the switch step the ranks fix together, see :meth:`at_safe_point`) or at step ``when`` (0: the next one).
        Returns the op once it was applied (or is ``gone``), None while it waits. Idempotent per ``key``; an op
        whose change is gone is replaced by a new one (armed for what is current now)."""
        op = self._op
        if op is None or op.key != key or op.gone:
            arm = when if isinstance(when, _Arm) else None
            if not self.safe_points:
                op = _SafePointOp(key, 0, None, fn)
                op.apply(self.steps)
                self._live_phy2log = self.backend.phy2log
                self._op = None
                return op
            op = _SafePointOp(key, None if arm is not None else int(when), arm, fn)
            self._op = op
        if not op.done.is_set():
            return None
        return op

    def _applied(self, op: _SafePointOp, cluster: ClusterRecord, what: str) -> dict[str, Any]:
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

    def _heartbeat(self, force: bool = False, **changes: Any) -> None:
        """Heartbeat with TTL, step counter and step rate (at most every ttl / 4 unless ``force``)."""
        now = time.monotonic()
        last_t, last_steps, rate = self._hb
        if not force and now - last_t < self.heartbeat_ttl_ms / 4000:
            return
        if last_t and now > last_t:
            current = (self.steps - last_steps) / (now - last_t)
            rate = current if rate == 0 else 0.5 * rate + 0.5 * current
        self._hb = (now, self.steps, rate)
        self.store.heartbeat(self.ep_rank, heartbeat_ttl_ms=self.heartbeat_ttl_ms, step=self.steps,
                             steps_per_s=round(rate, 3), **changes)
        self._check_superseded()

    def _check_superseded(self) -> None:
        """One agent per rank: a worker restarted while its old process still runs registers a new agent for the
        same rank. The older one finds the registry naming another agent at its next heartbeat (within
        ``heartbeat_ttl_ms / 4``), raises an alarm (event and audit record) naming both and stops its loop, so only
        the newest agent drives the rank's records (until then both commit under the records' version checks)."""
        owner = self.store.rank_agent(self.ep_rank)
        if owner is None or owner == self.agent_id or self.stop_event.is_set():
            return
        message = (f"rank {self.ep_rank}: agent {self.actor} ({self.agent_id}) superseded by agent {owner}, "
                   "registered later for the same rank; this agent stops")
        self.log.error("superseded", agent_id=self.agent_id, by=owner)
        self.store.emit_event("alarm", rank=self.ep_rank, message=message)
        self.store.append_alarm(self.store.read_cluster(), actor=self.actor, reason=message)
        self.stop_event.set()

    # ---- weight status (dynamic clear / update) ---------------------------------------------------------------------
    def _weights_step(self, cluster: ClusterRecord, w: WeightRecord) -> bool:
        """Carry out the cluster's latest weight request through this rank's weight-status machine: the transition
        into CLEARING / UPDATING is committed first (its guards: no clear or update while a round is past FREE),
        the work runs at the safe point of the request's switch step, the outcome is committed after
        (``cleared``, ``updated``, or ``update_failed`` with the reason: never NORMAL with wrong weights).

        Two phases: every rank first commits its transition (or finds nothing to do: clear while CLEARED) and arms
        for request n (``weights:<n>``); the request's switch step is fixed once all are armed, and all switch at
        it (:meth:`at_safe_point`). Requests are carried out one at a time
        (:meth:`fdeplb.store.Store.request_weights` refuses a new one while a rank is CLEARING or UPDATING). A
        request that still overtakes one (written between this rank's read of request n and its commit of the
        transition for n) finds this rank's pending work re-armed for the new request: the ranks still switch at
        one step, but this rank then carries out the new request on its own, past that step, which raises the
        late-switch alarm (:meth:`at_safe_point`, point 3). ``w``: this rank's weight-status record as read."""
        n = cluster.weights_request
        arm = _Arm(f"weights:{n}", "weights_switch_step", {"weights_request": n})
        if w.state is WeightState.CLEARING:
            op = self._at_safe_point(("clear", w.request), arm, self.backend.clear)
            if op is None or op.gone:
                return False
            if op.error is not None:  # freeing memory does not fail; if it did, say so and stay CLEARING
                self._op = None
                self.store.emit_event("alarm", rank=self.ep_rank, message=f"weight clear failed: {op.error}")
                self.store.update(WEIGHTS, self.ep_rank, reason=f"clear failed: {op.error}")
                return False
            # the rank's report first: whoever sees CLEARED sees when it was applied
            self.rank.update(**self._applied(op, cluster, f"weight clear {w.request}"))
            self.weights.fire("cleared", record=w, changes={"reason": ""})
            return True
        if w.state is WeightState.UPDATING:
            placement = self.store.current_placement()  # the cluster's CURRENT placement (vLLM PR #55228)
            op = self._at_safe_point(("update", w.request), arm, lambda: self.backend.reload_in(placement.phy2log))
            if op is None or op.gone:
                return False
            applied = self._applied(op, cluster, f"weight update {w.request}")
            err = op.error
            if err is None and op.result.verified != op.result.total:
                err = VerificationError(f"{op.result.total - op.result.verified} of {op.result.total} slots differ "
                                        "from the checkpoint after the update")
            if err is None:
                applied["live_plan_id"] = placement.plan_id
            self.rank.update(**applied)  # the rank's report first: whoever sees the outcome sees when it applied
            if err is not None:
                reason = f"update failed: {err}"
                self.log.error("weight update failed", error=str(err))
                self.store.emit_event("alarm", rank=self.ep_rank, message=reason)
                self.weights.fire("update_failed", record=w, reason=reason, changes={"reason": reason})
            else:
                self.live_plan_id = placement.plan_id
                self.weights.fire("updated", record=w, plan_id=placement.plan_id,
                                  changes={"plan_id": placement.plan_id, "reason": ""})
            return True
        if w.request >= n:
            return False
        action = cluster.weights_action
        if action not in ("clear", "update"):
            self.store.update(WEIGHTS, self.ep_rank, request=n, reason=f"unknown weight action {action!r}")
            return True
        if cluster.state is not ClusterState.FREE:
            return False  # the guards refuse while a round runs: wait for FREE (no retry storm)
        if action == "clear" and w.state is WeightState.CLEARED:  # nothing to free; arms all the same
            op = self._at_safe_point(("nothing", n), arm, lambda: None)
            if op is None:
                return False
            self._op = None  # applied, or gone (superseded: nothing was to be done anyway)
            self.store.update(WEIGHTS, self.ep_rank, request=n)
            return True
        self.weights.fire(action, record=w, reason=cluster.weights_reason, changes={"request": n, "reason": ""})
        return True

    # ---- collecting -----------------------------------------------------------------------------------------------
    def _publish_load(self, cluster: ClusterRecord) -> bool:
        round_ = cluster.round
        if self._published_round < 0:  # a fresh process: a previous one may have published for this round
            self._published_round = self.store.load_round(self.ep_rank) or 0
        if self._published_round >= round_ or self._load_failed_round == round_:
            return False
        expected = (self.config.num_layers, self.config.num_logical_experts)
        try:
            window = check_counts(self.load_source(round_), "load window")  # fractional: refused, not truncated
            if window.shape != expected:
                raise InputError(f"load window has shape {window.shape}, expected {expected}")
        except Exception as err:  # noqa: BLE001 - the engine's recorder is foreign code; never kill the agent
            # publish nothing: the coordinator's collecting deadline aborts the round and names this rank
            self._load_failed_round = round_  # once per round: no retry storm
            self.log.error("load source failed", round=round_, error=str(err))
            self.store.emit_event("alarm", rank=self.ep_rank, message=f"load source failed: {err}")
            return False
        self._outbox.append(self.store.deferred_publish(self.ep_rank, round_, window))  # sent with the next wait
        self._published_round = round_  # reset to "look it up" if the write is refused or its fate unknown
        return True

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _plan_alive(self, plan_id: str, cluster: ClusterRecord) -> bool:
        """The plan is the cluster's round in progress (not aborted, not superseded)."""
        return cluster.plan_id == plan_id and cluster.state in (ClusterState.LOADING, ClusterState.LOAD_SUCC,
                                                                ClusterState.SWAPPING)

    def _new_phy2log(self, plan_id: str) -> np.ndarray:
        """The plan's new phy2log, read once per plan (plans are content-addressed and write-once)."""
        if self._plan_read[0] != plan_id:
            new = self.store.plan_phy2log(plan_id)
            if new is None:
                raise WeightError(f"plan {plan_id} has no new_phy2log")
            self._plan_read = (plan_id, new)
        return self._plan_read[1]

    def _keep_plan(self, plan_id: str, new: np.ndarray | None) -> None:
        if new is not None:  # a missing plan is reported by _new_phy2log when staging asks for it
            self._plan_read = (plan_id, new)

    def _stage(self, plan_id: str) -> dict[str, Any]:
        """Stage the experts the plan needs on this rank (idempotent: reuses a staging of the same plan); returns
        the rank-record fields that report it."""
        if self.staged is None or self.staged.plan_id != plan_id:
            self._drop_staging()
            t0 = time.perf_counter()
            staged = self.backend.stage(self._new_phy2log(plan_id), self.staging_budget_bytes)
            self.staged = _Staging(plan_id, staged)
            self._stage_ms = round((time.perf_counter() - t0) * 1000, 3)
        return {**dataclasses.asdict(self.staged.staged.report), "stage_ms": self._stage_ms}

    def _drop_staging(self) -> None:
        if self.staged is not None:
            self.staged.staged.release()
            self.staged = None

    # ---- entry work per rank state (idempotent) -------------------------------------------------------------------
    def _on_idle(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        self._drop_staging()
        if cluster.state is not ClusterState.LOADING:
            return False
        plan_id = cluster.plan_id
        self.rank.fire("stage", record=me, plan_id=plan_id, round_=cluster.round,
                       changes={"plan_id": plan_id, "round": cluster.round, "reason": ""}, defer=self._outbox)
        # the stage commit and the read of the plan it stages, in one round trip; the chain goes on to LOADING's
        # staging only if the commit succeeded (RecordHandle.take_committed), else the next step looks again
        if self._plan_read[0] != plan_id:
            read = self.store.deferred_plan_read(plan_id)
            self._outbox.append(dataclasses.replace(read, then=lambda new: self._keep_plan(plan_id, new)))
        self._send()
        return True

    def _on_loading(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        plan_id = me.plan_id
        if not self._plan_alive(plan_id, cluster):
            return self._abort(me, "round aborted while loading")
        try:
            info = self._stage(plan_id)
        except WeightError as err:
            self._drop_staging()
            self.log.error("staging failed", plan_id=plan_id, error=str(err))
            self.rank.fire("fail", record=me, reason=str(err), changes={"reason": str(err)})
            return True
        self.rank.fire("staged", record=me, changes=info, defer=self._outbox)  # next work: the cluster's commit
        return False

    def _on_loaded(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        plan_id = me.plan_id
        committed = cluster.state is ClusterState.SWAPPING and cluster.plan_id == plan_id
        if committed:  # staging (again, after a restart) happens in SWAPPING, which cannot fail the round
            self.rank.fire("swap", record=me)
            return True
        if not self._plan_alive(plan_id, cluster):
            return self._abort(me, "round aborted after loading")
        try:
            self._stage(plan_id)  # a restarted agent lost its staging: stage again (same plan, same result)
        except WeightError as err:
            self._drop_staging()
            self.rank.fire("fail", record=me, reason=str(err), changes={"reason": str(err)})
            return True
        return False

    def _on_swapping(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        plan_id = me.plan_id
        new = self._new_phy2log(plan_id)
        report: dict[str, Any] = {}
        pending = self._op is not None and self._op.key[:2] == ("swap", plan_id)  # applied, not yet reported
        if pending or not np.array_equal(self.backend.phy2log, new):
            attempt = self._swap_attempts.get(plan_id, 1)
            try:
                info = self._stage(plan_id)
            except WeightError as err:  # past the commit point: report and retry on the next wake-up
                self.log.error("staging failed after the commit point", error=str(err))
                self.rank.update(reason=f"staging failed after commit: {err}")
                self.store.emit_event("alarm", rank=self.ep_rank, message=f"staging failed: {err}")
                return False
            staged = self.staged.staged
            when: _Arm | int = 0  # a retry after a failed verification: at the next safe point
            if attempt == 1 and cluster.state is ClusterState.SWAPPING and cluster.plan_id == plan_id:
                when = _Arm(f"swap:{cluster.round}:{plan_id}", "switch_step",
                            {"state": ClusterState.SWAPPING, "round": cluster.round, "plan_id": plan_id})
            op = self._at_safe_point(("swap", plan_id, attempt), when, lambda: self._swap_or_restore(staged, new))
            if op is None or op.gone:
                return False  # waits for the worker's safe point (a gone op is re-armed on the next wake-up)
            report.update(self._applied(op, cluster, f"plan {plan_id}"))
            if isinstance(op.error, VerificationError):
                # past the commit point: no abort. The swap restored the old placement from the checkpoint; stage
                # again from disk and retry once; then stay SWAPPING and let the deadline raise the alarm.
                self.log.error("swap verification failed", attempt=attempt, error=str(op.error))
                self.store.emit_event("alarm", rank=self.ep_rank, message=f"swap verification failed: {op.error}")
                self._drop_staging()
                self._swap_attempts[plan_id] = attempt + 1
                if attempt >= 2:
                    self.rank.update(reason=f"swap verification failed twice: {op.error}", **report)
                    return False
                return True
            if op.error is not None:
                self._drop_staging()
                raise op.error
            swap: SwapReport = op.result
            report.update(info)  # the staging's counts: the swap carried out the same transfer
            report.update(snapshots=swap.snapshots, bytes_from_staging=swap.bytes_from_staging,
                          bytes_local=swap.bytes_local, swap_ms=round(op.pause_ms, 3))
            self._drop_staging()
        total = self.backend.slots_total
        if self.verify_all:
            verified, total = self.backend.verify()
        else:  # swap() verified every changed slot; the kept ones were verified when they were written
            verified = total
        self.live_plan_id = plan_id
        self._swap_attempts.pop(plan_id, None)
        report.update({"slots_verified": verified, "slots_total": total, "live_plan_id": plan_id,
                       "verified_all": int(self.verify_all), "routing_digest": routing_digest(self.backend.phy2log)})
        if verified != total:
            self.log.error("verification failed", verified=verified, total=total)
            report["reason"] = f"{total - verified} of {total} slots do not match the checkpoint"
            self.rank.update(**report)
            self.store.emit_event("alarm", rank=self.ep_rank, message=report["reason"])
            return False
        self.rank.fire("swapped", record=me, changes=report, defer=self._outbox)  # next: the round's release
        return False

    def _swap_or_restore(self, staged: Staged, new: np.ndarray) -> SwapReport:
        """Swap in place (at the safe point); on a failed verification rewrite the old placement from the source
        of truth before re-raising, so the rank keeps serving the old placement consistently."""
        try:
            return self.backend.swap(staged, new)
        except VerificationError:
            self.backend.reload()
            raise

    def _on_swapped(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        if cluster.state is ClusterState.SWAPPING and cluster.plan_id == me.plan_id:
            return False  # the other ranks are still swapping (the round's release wakes this rank)
        self.rank.fire("finish", record=me, defer=self._outbox)  # next work: the next round's LOADING
        return False

    def _on_load_failed(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        if self._plan_alive(me.plan_id, cluster):
            return False  # the coordinator aborts the round
        return self._abort(me, me.reason or "load failed")

    def _abort(self, me: RankRecord, reason: str) -> bool:
        self._drop_staging()
        self.rank.fire("abort", record=me, reason=reason, changes={"reason": reason})
        return True


#: rank state -> the agent's entry work in that state (checked complete against the RANK table at import)
ENTRY_WORK = entry_work(RANK, {
    RankState.IDLE: RankAgent._on_idle,
    RankState.LOADING: RankAgent._on_loading,
    RankState.LOADED: RankAgent._on_loaded,
    RankState.LOAD_FAILED: RankAgent._on_load_failed,
    RankState.SWAPPING: RankAgent._on_swapping,
    RankState.SWAPPED: RankAgent._on_swapped,
})


class EmbeddedAgent(RankAgent):
    """The rank agent embedded in a serving worker: the engine owns the forward loop and calls :meth:`record` and
    :meth:`at_safe_point`; the reconcile loop (publishing the load window, staging, the weight-status machine,
    heartbeats with a TTL) runs in a background daemon thread started by :meth:`start`.

    Args:
        store: a :class:`~fdeplb.store.Store`, or a Redis URL (then ``cluster`` names the cluster).
        ep_rank: this worker's EP rank.
        tensors: the engine's live expert tensors, ``suffix -> [paddle.Tensor per MoE layer, each
            [slots_per_rank, *shape]]``, already holding the cluster's current placement: attached in place and
            verified against the checkpoint (:meth:`fdeplb.weights.LiveExperts.attach`). Without them the agent
            loads the rank's slots from the cluster's checkpoint (or uses ``backend_factory``).
        device: paddle device of the tensors ("cpu", "gpu:0"; None = paddle's current one).
        block_ms: longest wait of the background loop between looks at Redis.
        publish_interval_s: publish the load window this often (None: only when a round collects).
        **kwargs: the other :class:`RankAgent` arguments (``window_steps``, ``window_s``, ``heartbeat_ttl_ms``,
            ``backend_factory``, ``verify_all``, ``staging_budget_bytes`` ...).

    Raises:
        InputError: a URL without a cluster, both ``tensors`` and ``backend_factory``.

    Use as a context manager or call :meth:`close`; see README "Embedding in a serving worker".
    """

    def __init__(self, store: Store | str, ep_rank: int, *, cluster: str | None = None,
                 tensors: dict[str, list[Any]] | None = None, device: str | None = None, block_ms: int = 50,
                 publish_interval_s: float | None = 5.0, **kwargs: Any) -> None:
        if isinstance(store, str):
            if not cluster:
                raise InputError("EmbeddedAgent(url, ...) needs cluster=")
            store = Store(store, cluster)
        if tensors is not None:
            if kwargs.get("backend_factory") is not None:
                raise InputError("give the engine's tensors or a backend_factory, not both")
            kwargs["backend_factory"] = CheckpointBackend.attached(tensors, device)
        super().__init__(store, ep_rank, safe_points=True, device=device, publish_interval_s=publish_interval_s,
                         **kwargs)
        self.block_ms = int(block_ms)
        self._thread: threading.Thread | None = None

    def start(self, info: dict[str, Any] | None = None) -> "EmbeddedAgent":
        """Load (or attach) the live experts, register the rank and start the background loop."""
        super().start(info)
        self._thread = threading.Thread(target=self.run, kwargs={"block_ms": self.block_ms}, daemon=True,
                                        name=f"fdeplb-rank{self.ep_rank}")
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the background loop (waits up to ``timeout_s``) and close the store's connections. The rank's
        heartbeat then lapses after its TTL; the live experts stay as they are."""
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.store.close()

    def __enter__(self) -> "EmbeddedAgent":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
