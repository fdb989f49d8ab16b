"""The rank agent: lives inside each serving worker (one per EP rank) and drives that rank's machine.

It talks to the rest of the cluster only through Redis. It publishes the rank's expert_load window when a round
collects, stages the experts its new slots need while the cluster is LOADING, swaps them into the live slot tensors
in place once the plan is committed (SWAPPING), and reports each step as a transition of its rank record.

Like the coordinator it is a reconcile loop over (cluster record, own rank record): every state has idempotent
entry work, so an agent restarted at any point rebuilds its live experts from the cluster's *current placement*
and carries on from what the records say.

This module owns the loop, its start-up, heartbeat and rank-state entry work; the pieces it is built from live
beside it: the load recorder (:mod:`~fdeplb.orchestration.load_window`), the safe-point switch protocol
(:mod:`~fdeplb.orchestration.safe_points`), the weight-status driver (:mod:`~fdeplb.orchestration.weight_status`),
the rejoining of a cluster created again over the live rank (:mod:`~fdeplb.orchestration.recovery`) and the
embedding in a serving worker (:mod:`~fdeplb.orchestration.embedded_agent`). Two ways to run it:

- **threaded** (:meth:`RankAgent.run`, the simulated cluster): the loop applies swaps and weight clear / update in
  its own thread as soon as it reaches them;
- **embedded in a serving worker** (:class:`~fdeplb.orchestration.embedded_agent.EmbeddedAgent`): the worker calls
  :meth:`RankAgent.record` once per forward step and :meth:`RankAgent.at_safe_point` between steps; the loop runs
  in a background thread, stages in the background, and leaves every change of the live expert tensors and routing
  tables (a committed swap, a weight clear or update) to the safe point where the worker's step counter reaches
  the change's *switch step* (see :meth:`RankAgent.at_safe_point`), so that every EP rank switches at the same
  step.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple

import numpy as np
import structlog

from fdeplb.errors import (FdeplbError, GuardError, InputError, NotFoundError, RedisUnavailableError, StaleStateError,
                           StateError, WeightError)
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import RANK, WEIGHTS, ClusterState, RankState, entry_work
from fdeplb.orchestration import peer_agent
from fdeplb.orchestration.busy_heartbeat import beating
from fdeplb.orchestration.comeback import ComeBack
from fdeplb.orchestration.membership import Rejoin
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.orchestration.load_window import LoadRecorder, LoadSource
from fdeplb.orchestration.probe import Probing
from fdeplb.orchestration.reconcile import StopsWhenDeleted, run_until_stopped
from fdeplb.orchestration import takeover
from fdeplb.orchestration.recovery import Recovery, Rejoining
from fdeplb.orchestration.safe_points import SafePointSwitch
from fdeplb.orchestration.swap_driver import SwapDriver
from fdeplb.orchestration.weight_status import WeightStatusDriver
from fdeplb.placement import routing_digest
from fdeplb.store import ClusterConfig, ClusterRecord, PendingCall, RankRecord, Store, WeightRecord
from fdeplb.store.cluster_config import check_pause_budget
from fdeplb.store.liveness import SWITCH_MARGIN_STEPS
from fdeplb.weights.backend import BackendFactory, CheckpointBackend, Staged, WeightBackend
from fdeplb.weights.peer import MAX_SERVING, ExpertSource, check_max_serving
from fdeplb.weights.plan import PauseBudget

log = structlog.get_logger("fdeplb.agent")

__all__ = ["ENTRY_WORK", "RankAgent"]


class _Staging(NamedTuple):
    """What the agent staged for one plan."""

    plan_id: str
    staged: Staged


class RankAgent(LoadRecorder, WeightStatusDriver, SwapDriver, Probing, Rejoining, ComeBack, StopsWhenDeleted):
    """Agent of one EP rank.

    ``load_source(round)`` gives this rank's expert_load window (int64 [L, E], tokens x top-k assignments).
    ``backend_factory`` builds the rank's :class:`~fdeplb.weights.WeightBackend` from the cluster's checkpoint and
    current placement (default: :class:`~fdeplb.weights.CheckpointBackend` on ``device``, paddle tensors;
    :class:`fdeplb.testing.NumpyWeights` runs without paddle).
    ``staging_budget_bytes``: staging refuses (rank LOAD_FAILED) plans that need more host memory than this.
    ``verify_all``: after each swap, compare *every* slot of the rank with the checkpoint (re-reads the rank's
    whole share from disk; the demo and tests do it). Otherwise only the slots the swap wrote are verified, by the
    backend's swap itself.
    ``load_source`` defaults to the agent's own :class:`~fdeplb.orchestration.load_window.ExpertLoadWindow`
    (``window_steps`` / ``window_s``), fed by :meth:`record`. ``safe_points``: leave every change of the live
    experts to :meth:`at_safe_point` (an embedded agent, see
    :class:`~fdeplb.orchestration.embedded_agent.EmbeddedAgent`); otherwise the loop applies them itself (the
    protocol: ``switch``, a :class:`~fdeplb.orchestration.safe_points.SafePointSwitch`; the weight-status machine:
    :class:`~fdeplb.orchestration.weight_status.WeightStatusDriver`).
    ``publish_interval_s``: also publish the load window this often (None: only when a round collects).
    ``heartbeat_ttl_ms``: the heartbeat's time to live; the rank is stale (no round starts) once it lapses.
    ``switch_margin_steps``: when this rank is the one that fixes a switch step, the steps it adds to the largest
    armed step counter (>= 1; see :meth:`at_safe_point`).
    ``max_pause_bytes`` / ``layers_per_safe_point``: this rank's pause budget of one safe point (bytes written into
    its live slots / changed layers switched; 0 = no limit of that kind); None = the cluster's
    (``ClusterConfig``). With safe points a committed swap is applied in chunks of whole layers within every rank's
    budget, one chunk per safe point (:class:`~fdeplb.orchestration.safe_points.Chunked`); a re-placement round
    that changes the members is applied at one safe point (its routing names other ranks).
    ``peer_secret``: the peer-transfer secret (:mod:`~fdeplb.orchestration.peer_agent`); ``peer_max_serving``:
    the requests its peer server answers at once (None: :data:`fdeplb.weights.peer.MAX_SERVING`; each holds up to
    64 MiB of host copies; past it a request waits, then is refused and read from the checkpoint).
    ``replace``: supersede a live agent of the same rank (one whose heartbeat is within its TTL, that did not
    stop: :meth:`run` notes its end in the registry, and whose process is not provably dead on this host:
    :mod:`~fdeplb.orchestration.takeover`); without it :meth:`start` refuses with
    :class:`~fdeplb.errors.StateError` (a second worker started by mistake must not take a healthy rank over).
    """

    def __init__(self, store: Store, ep_rank: int, *, load_source: LoadSource | None = None,
                 backend_factory: BackendFactory | None = None, staging_budget_bytes: int | None = None,
                 device: str | None = None, actor: str | None = None, verify_all: bool = False,
                 safe_points: bool = False, window_steps: int | None = 1000, window_s: float | None = None,
                 publish_interval_s: float | None = None, heartbeat_ttl_ms: int = 10_000,
                 switch_margin_steps: int = SWITCH_MARGIN_STEPS, max_pause_bytes: int | None = None,
                 layers_per_safe_point: int | None = None, replace: bool = False,
                 peer_secret: str | None = None, peer_max_serving: int | None = None) -> None:
        if heartbeat_ttl_ms < 100:
            raise InputError(f"heartbeat_ttl_ms must be >= 100, got {heartbeat_ttl_ms}")
        own = check_pause_budget(0 if max_pause_bytes is None else max_pause_bytes,  # the cluster's rule
                                 0 if layers_per_safe_point is None else layers_per_safe_point)
        self._pause_args = tuple(None if arg is None else v for arg, v in zip((max_pause_bytes, layers_per_safe_point), own))
        #: the pause budget of one safe point (the agent's arguments over the cluster's), known after start()
        self.pause_budget: PauseBudget | None = None
        self._init_load(load_source, window_steps, window_s, publish_interval_s)
        self.store = store
        self.ep_rank = int(ep_rank)
        self.heartbeat_ttl_ms = int(heartbeat_ttl_ms)
        self._plan_read: tuple[str, np.ndarray | None] = ("", None)  # (plan_id, its new phy2log)
        self._hb = (0.0, 0, 0.0)  # (monotonic time, steps, steps_per_s) of the last heartbeat
        self._swap_attempts: dict[str, int] = {}
        self.backend_factory = backend_factory or CheckpointBackend.factory(device=device)
        self.staging_budget_bytes = staging_budget_bytes
        self.verify_all = verify_all
        self.replace = bool(replace)
        self.actor = actor or f"rank{ep_rank}@{os.getpid()}"
        self.agent_id = uuid.uuid4().hex  # this agent instance, in the registry (see _check_superseded)
        self.stop_event = threading.Event()
        self.config: ClusterConfig | None = None
        self.backend: WeightBackend | None = None
        self.live_plan_id: str | None = None
        #: the EP ranks the engine dispatches to: the members the current placement was committed for (read at
        #: start), then changed only at the safe point that swaps a committed plan, together with the routing
        #: tables (which name only their slots), to that round's members
        self.live_ranks: tuple[int, ...] = ()
        self._rejoin: Rejoin | None = None
        self.staged: _Staging | None = None
        self._stage_ms = 0.0
        self._outbox: list[PendingCall] = []  # the step's last writes, sent with the next wait (see run)
        self.rank = RecordHandle(store, RANK, self.ep_rank, actor=self.actor)
        self.weights = RecordHandle(store, WEIGHTS, self.ep_rank, actor=self.actor)
        self.log = log.bind(ep_rank=self.ep_rank, cluster=store.cluster)
        #: the worker's side of the switch protocol and its pause (the step counter, the pending change)
        self.switch = SafePointSwitch(store, self.ep_rank, self.actor, self.log, safe_points=safe_points,
                                      switch_margin_steps=switch_margin_steps, applied=self._follow_routing)
        self._info: dict[str, Any] = {}  # what start() registered besides pid / actor / agent_id (API address)
        self.recovery: Recovery | None = None  # made once the backend is (start)
        self._init_probe()
        self._peer_secret = peer_agent.peer_secret(peer_secret)  # None: every moved expert from the checkpoint
        self._peer_max_serving = check_max_serving(MAX_SERVING if peer_max_serving is None else peer_max_serving)
        self.peers: peer_agent.PeerService | None = None  # serves the live slots to peers (peer_agent)

    # ---- start-up -------------------------------------------------------------------------------------------------
    def start(self, info: dict[str, Any] | None = None) -> None:
        """Load the live experts of the cluster's current placement and register the rank. :class:`InputError` for
        an ep_rank outside the cluster; :class:`StateError` when a live agent drives the rank and ``replace`` is
        not set (nothing written then)."""
        self.config = self.store.read_config()
        if not 0 <= self.ep_rank < self.config.ep_size:
            raise InputError(f"ep_rank {self.ep_rank} outside [0, {self.config.ep_size})")
        takeover.check_not_driven(self.store, self.ep_rank, self.agent_id, replace=self.replace, by=self.actor)
        max_bytes, max_layers = self._pause_args
        self.pause_budget = PauseBudget(self.config.max_pause_bytes if max_bytes is None else max_bytes,
                                        self.config.layers_per_safe_point if max_layers is None else max_layers)
        self.rank.ensure()
        self.weights.ensure()
        me = self.rank.read()  # a restarted worker's step counter carries on from the last one it published
        self.steps = max(self.steps, me.step, me.armed_step)
        placement = self.store.current_placement()
        t0 = time.perf_counter()
        self.backend = self.backend_factory(self.config.checkpoint, placement.phy2log, self.ep_rank,
                                            self.config.ep_size)
        self._live_phy2log = self.backend.phy2log
        self.recovery = Recovery(self.store, self.ep_rank, self.backend, agent_id=self.agent_id,
                                 heartbeat_ttl_ms=self.heartbeat_ttl_ms)
        self.live_plan_id = placement.plan_id
        self._rejoin = Rejoin(self.store, self.ep_rank, self.actor, self.log)
        self._rejoin.begin(placement.plan_id)  # an excluded rank comes back: REJOINING, admitted when FREE
        # route as every member does: over the ranks the current placement was committed for (a rejoining rank
        # is not one of them until the membership round that follows its admission switches)
        self.live_ranks = placement.live_ranks(self.config.ep_size)
        self.backend.set_live_ranks(self.live_ranks)
        self._open_window(self.config)
        self._info = dict(info or {})
        opened = bool(self._peer_secret and self.peers is None and isinstance(self.backend, ExpertSource))
        if opened:
            self.peers = peer_agent.PeerService(self.backend, self._peer_secret, self.store.cluster, self.ep_rank,
                                                self.config.ep_size,
                                                timeout_s=peer_agent.peer_wait_s(self.heartbeat_ttl_ms),
                                                share_s=peer_agent.peer_share_s(self.config.deadlines.loading_ms),
                                                actor=self.actor, max_serving=self._peer_max_serving)
        try:
            if self.peers is not None:
                self.peers.server.source = self.backend
                self._info[peer_agent.ADDRESS_FIELD] = self.peers.address
            self.switch.safe_point_t = time.monotonic()  # loading took its time: the first step is due from now
            self._register(placement.plan_id)
            self.store.emit_event("rank_ready", rank=self.ep_rank, plan_id=placement.plan_id)
        except BaseException:  # a start that fails leaves no server listening (no loop will ever close it)
            if opened:
                self.peers.close()
                self.peers = None
            raise
        self.log.info("ready", plan_id=placement.plan_id, load_s=round(time.perf_counter() - t0, 3))

    def _register(self, plan_id: str) -> None:
        """Register the rank (pid, actor, agent id and :attr:`_info`) and heartbeat the plan it holds live."""
        self.store.register_rank(self.ep_rank, {"pid": os.getpid(), "actor": self.actor, "agent_id": self.agent_id,
                                                **takeover.host_identity(), **self._info})
        self._heartbeat(force=True, live_plan_id=plan_id, clear_stat=self._clear_stat_seen,
                        routing_digest=routing_digest(self.backend.phy2log))

    # ---- loop ---------------------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None, block_ms: int = 1_000) -> None:
        """Reconcile until :attr:`stop_event` is set or ``until()`` is true (asked after every step, a failed one
        included). A lost Redis connection is logged and retried every 0.5 s; any other exception out of a step (a
        typed :class:`FdeplbError` or a bug) raises an ``alarm`` event and is retried after 1 s: no value kills the
        loop. The worker's live experts keep serving either way.

        One round trip per wake-up: a step's last write (a load window, or a transition after which only
        a cluster change gives the rank work: ``staged``, ``swapped``, ``finish``) is not sent on its own but
        with the wait that follows it, and the wait reads the next step's view as it returns
        (:meth:`fdeplb.store.Store.wait_view`)."""
        if self.backend is None:
            self.start()
        cursor = None  # on the signal stream: wakes on cluster-record changes only (not every rank's transitions)
        view = None

        def iterate() -> bool:
            nonlocal cursor, view
            if cursor is None:  # in the loop: Redis may be away when run() begins
                cursor = self.store.signal_cursor()
            given, view = view, None
            try:
                progressed = self.step(given, send=False)
            except (StaleStateError, GuardError) as err:
                self.log.info("retry", error=str(err))
                progressed = True
            except NotFoundError as err:  # records gone (Redis lost its data?): report, then register again
                self._records_lost(err)
                progressed = True
            if until is not None and until():
                return True
            if progressed and self._outbox:  # the next step reads: it must see this one's writes
                self._send()
            if not progressed:
                self._heartbeat()
                op = self.switch.op
                if op is not None and not op.done.is_set():  # the worker's safe point applies it
                    self._send()
                    self.switch.wait_for_worker(op, self._wait_ms(block_ms) / 1000)
                else:
                    view = self._send(cursor, self._wait_ms(block_ms))
            return False

        try:  # the live experts keep serving whatever happens here
            run_until_stopped(self.stop_event, iterate, self.log, retry_s=lambda: 1.0, until=until,
                              deleted=self._stop_if_deleted,
                              announce=lambda err: self.store.emit_event("alarm", rank=self.ep_rank,
                                                                         message=f"agent step failed: {err}"))
        finally:
            if self.peers is not None:  # its registered address now refuses: peers read from the checkpoint
                self.peers.close()
                self.peers = None
            try:
                if self.deleted is None:  # an operator deleted the cluster: nothing of it is written
                    self._send()
                    self.store.mark_rank_stopped(self.ep_rank, self.agent_id)  # the next agent needs no replace
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
        self._load_step(cluster)  # nothing else to do for it: no second look needed
        if self._rejoin is not None:
            self._rejoin.step(cluster.state)  # routed to from the switch step of the round that follows
            if self._come_back(cluster, me):  # excluded while it lived on (a hung engine): rejoins now
                return True
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

    # ---- the worker's side: the safe-point switch the agent holds (fdeplb.orchestration.safe_points) ------------
    def at_safe_point(self) -> bool:
        """Call between forward steps: :meth:`SafePointSwitch.at_safe_point` (True when it applied a change)."""
        return self.switch.at_safe_point()

    steps = property(lambda self: self.switch.steps, lambda self, n: setattr(self.switch, "steps", n),
                     doc="The worker's step counter (safe points passed); a restarted worker sets it to carry on.")
    pauses_ms = property(lambda self: self.switch.pauses_ms, doc="Each safe point's pause (ms), the newest 10,000.")
    late_switches = property(lambda self: self.switch.late_switches, doc="Changes applied past their switch step.")
    safe_points = property(lambda self: self.switch.safe_points, doc="Changes wait for the worker's safe points.")

    @property
    def serving(self) -> bool:
        """False while the rank's expert weights are cleared (the worker must not run a forward step)."""
        return self.backend is not None and not self.backend.cleared

    def _heartbeat(self, force: bool = False, check: bool = True, **changes: Any) -> None:
        """Heartbeat with TTL, step counter and step rate (at most every ttl / 4 unless ``force``); ``check``: then
        look for a superseding agent (the loop thread only: not the heartbeat while staging)."""
        now = time.monotonic()
        last_t, last_steps, rate = self._hb
        if not force and now - last_t < self.heartbeat_ttl_ms / 4000:
            return
        self._note_away(now, last_t)
        if last_t and now > last_t:
            current = (self.steps - last_steps) / (now - last_t)
            rate = current if rate == 0 else 0.5 * rate + 0.5 * current
        self._hb = (now, self.steps, rate)
        self.store.heartbeat(self.ep_rank, heartbeat_ttl_ms=self.heartbeat_ttl_ms, step=self.steps,
                             steps_per_s=round(rate, 3), safe_point_age_ms=self.switch.safe_point_age_ms(now),
                             **changes)
        if check:
            self._check_superseded()

    def _check_superseded(self) -> None:
        """One agent per rank: a worker restarted while its old process still runs registers a new agent for the
        same rank. The older one finds the registry naming another agent at its next heartbeat (within
        ``heartbeat_ttl_ms / 4``), raises an alarm (event and audit record) naming both and stops its loop, so only
        the newest agent drives the rank's records (until then both commit under the records' version checks)."""
        owner = self.store.rank_agent(self.ep_rank)
        if owner is None and not self.stop_event.is_set():  # the registry lost this rank: Redis lost its data?
            self._records_lost(None)
            return
        if owner is None or owner == self.agent_id or self.stop_event.is_set():
            return
        message = (f"rank {self.ep_rank}: agent {self.actor} ({self.agent_id}) superseded by agent {owner}, "
                   "registered later for the same rank; this agent stops")
        self.log.error("superseded", agent_id=self.agent_id, by=owner)
        self.store.emit_event("alarm", rank=self.ep_rank, message=message)
        self.store.append_alarm(self.store.read_cluster(), actor=self.actor, reason=message)
        self.stop_event.set()

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
        the rank-record fields that report it. With safe points, staged for a chunked swap within
        :attr:`pause_budget` (a device buffer for its largest chunk, in the same staging budget)."""
        if self.staged is None or self.staged.plan_id != plan_id:
            self._drop_staging()
            t0 = time.perf_counter()
            new = self._new_phy2log(plan_id)
            pause = self.pause_budget if self.safe_points else None
            args = (new, self.staging_budget_bytes) if pause is None else (new, self.staging_budget_bytes, pause)
            # staging may outlast the heartbeat TTL (a peer's deadline, disk reads): beat on meanwhile
            with beating(self._busy_beat, self.heartbeat_ttl_ms / 4000, self.log):
                if self.peers is None:
                    staged = self.backend.stage(*args)
                else:  # experts new to the rank from the peers that hold them live, the rest from the checkpoint
                    staged = self.peers.stage(self.backend, new, self.staging_budget_bytes, pause, self.live_ranks,
                                              self.store)
            self.staged = _Staging(plan_id, staged)
            self._stage_ms = round((time.perf_counter() - t0) * 1000, 3)
        return {**dataclasses.asdict(self.staged.staged.report), "stage_ms": self._stage_ms}

    def _busy_beat(self) -> None:
        """The heartbeat while staging; none once the agent is stopping (a closed agent's rank lapses after its
        TTL even while an abandoned staging runs on)."""
        if not self.stop_event.is_set():
            self._heartbeat(force=True, check=False)

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
        except (StateError, RedisUnavailableError):
            raise  # a lost race or a lost connection: the loop retries, staging did not fail
        except Exception as err:  # noqa: BLE001 - any staging error (out of memory, a bug) fails this rank's load
            return self._staging_failed(me, plan_id, err)
        reason, detail = peer_agent.fallback_reason(getattr(self.staged.staged, "fallbacks", []))
        self.rank.fire("staged", record=me, changes=info, defer=self._outbox,  # next work: the cluster's commit
                       reason=reason, detail=detail)
        return False

    def _staging_failed(self, me: RankRecord, plan_id: str, err: Exception) -> bool:
        """Staging raised: drop what was staged and mark the rank LOAD_FAILED with the cause (the exception's type
        and message, which the coordinator's abort reason names), whatever the exception: a
        :class:`~fdeplb.errors.WeightError`, paddle out of memory, a bug. Before, only a WeightError did; any other
        alarmed every second until the loading deadline aborted the round without naming it."""
        self._drop_staging()
        reason = f"staging failed: {type(err).__name__}: {err}"[:1000]
        self.log.error("staging failed", plan_id=plan_id, error=str(err), error_type=type(err).__name__)
        self.rank.fire("fail", record=me, reason=reason, changes={"reason": reason})
        return True

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
        except (StateError, RedisUnavailableError):
            raise
        except Exception as err:  # noqa: BLE001 - as in LOADING: any staging error fails this rank's load
            return self._staging_failed(me, plan_id, err)
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

