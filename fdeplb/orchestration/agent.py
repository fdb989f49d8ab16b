"""The rank agent: lives inside each serving worker (one per EP rank) and drives that rank's machine.

It talks to the rest of the cluster only through Redis. It publishes the rank's expert_load window when a round
collects, stages the experts its new slots need while the cluster is LOADING, swaps them into the live slot tensors
in place once the plan is committed (SWAPPING), and reports each step as a transition of its rank record.

Like the coordinator it is a reconcile loop over (cluster record, own rank record): every state has idempotent
entry work, so an agent restarted at any point rebuilds its live experts from the cluster's *current placement*
and carries on from what the records say.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, NamedTuple

import numpy as np
import structlog

from fdeplb.errors import FdeplbError, GuardError, InputError, RedisUnavailableError, StaleStateError, \
    VerificationError, WeightError
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import RANK, WEIGHTS, ClusterState, RankState, entry_work
from fdeplb.orchestration.records import RecordHandle
from fdeplb.placement import check_counts, routing_digest
from fdeplb.store import ClusterConfig, ClusterRecord, RankRecord, Store
from fdeplb.weights.backend import BackendFactory, CheckpointBackend, Staged, WeightBackend

log = structlog.get_logger("fdeplb.agent")

#: rank-record fields a swap report may fill (the record type names them once)
_REPORT_FIELDS = frozenset(f.name for f in dataclasses.fields(RankRecord))


class _Staging(NamedTuple):
    """What the agent staged for one plan."""

    plan_id: str
    staged: Staged


#: returns the rank's expert_load window, int64 [num_layers, num_logical_experts], for a round.
LoadSource = Callable[[int], np.ndarray]


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
    """

    def __init__(self, store: Store, ep_rank: int, *, load_source: LoadSource,
                 backend_factory: BackendFactory | None = None, staging_budget_bytes: int | None = None,
                 device: str | None = None, actor: str | None = None, verify_all: bool = False) -> None:
        self.store = store
        self.ep_rank = int(ep_rank)
        self.load_source = load_source
        self.backend_factory = backend_factory or CheckpointBackend.factory(device=device)
        self.staging_budget_bytes = staging_budget_bytes
        self.verify_all = verify_all
        self.actor = actor or f"rank{ep_rank}@{os.getpid()}"
        self.stop_event = threading.Event()
        self.config: ClusterConfig | None = None
        self.backend: WeightBackend | None = None
        self.live_plan_id: str | None = None
        self.staged: _Staging | None = None
        self._stage_ms = 0.0
        self._load_failed_round = -1
        self.rank = RecordHandle(store, RANK, self.ep_rank, actor=self.actor)
        self.weights = RecordHandle(store, WEIGHTS, self.ep_rank, actor=self.actor)
        self.log = log.bind(rank=self.ep_rank, cluster=store.cluster)

    # ---- start-up -------------------------------------------------------------------------------------------------
    def start(self, info: dict[str, Any] | None = None) -> None:
        """Load the live experts of the cluster's current placement and register the rank."""
        self.config = self.store.read_config()
        if not 0 <= self.ep_rank < self.config.ep_size:
            raise InputError(f"ep_rank {self.ep_rank} outside [0, {self.config.ep_size})")
        self.rank.ensure()
        self.weights.ensure()
        placement = self.store.current_placement()
        t0 = time.perf_counter()
        self.backend = self.backend_factory(self.config.checkpoint, placement.phy2log, self.ep_rank,
                                            self.config.ep_size)
        self.live_plan_id = placement.plan_id
        self.store.register_rank(self.ep_rank, {"pid": os.getpid(), "actor": self.actor, **(info or {})})
        self.store.heartbeat(self.ep_rank, live_plan_id=placement.plan_id,
                             routing_digest=routing_digest(self.backend.phy2log))
        self.store.emit_event("rank_ready", rank=self.ep_rank, plan_id=placement.plan_id)
        self.log.info("ready", plan_id=placement.plan_id, load_s=round(time.perf_counter() - t0, 3))

    # ---- loop ---------------------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None, block_ms: int = 1_000) -> None:
        """Reconcile until :attr:`stop_event` is set or ``until()`` is true. A lost Redis connection is logged
        and retried every 0.5 s; another :class:`FdeplbError` out of a step raises an ``alarm`` event and is
        retried after 1 s. The worker's live experts keep serving either way."""
        if self.backend is None:
            self.start()
        cursor = self.store.cursor()
        while not self.stop_event.is_set():
            try:
                try:
                    progressed = self.step()
                except (StaleStateError, GuardError) as err:
                    self.log.info("retry", error=str(err))
                    progressed = True
                if until is not None and until():
                    return
                if not progressed:
                    self.store.heartbeat(self.ep_rank)
                    self.store.wait(cursor, block_ms)
            except RedisUnavailableError as err:  # Redis away: the live experts keep serving
                self.log.warning("redis unavailable", error=str(err))
                self.stop_event.wait(0.5)
            except FdeplbError as err:  # typed but unexpected (a missing plan, a corrupt record): keep serving
                self.log.error("step failed", error=str(err), error_type=type(err).__name__)
                try:
                    self.store.emit_event("alarm", rank=self.ep_rank, message=f"agent step failed: {err}")
                except FdeplbError:
                    pass
                self.stop_event.wait(1.0)

    def step(self) -> bool:
        """One reconcile step; True if it changed something (the caller loops without waiting)."""
        cluster = self.store.read_cluster()
        me = self.rank.read()
        failpoint("rank.hang", me.state,
                  lambda: self.store.emit_event("failpoint", name="rank.hang", state=me.state, rank=self.ep_rank))
        if cluster.state is ClusterState.COLLECTING and self._publish_load(cluster):
            return True
        return ENTRY_WORK[me.state](self, me, cluster)

    # ---- collecting -----------------------------------------------------------------------------------------------
    def _publish_load(self, cluster: ClusterRecord) -> bool:
        round_ = cluster.round
        published = self.store.load_round(self.ep_rank)
        if (published is not None and published >= round_) or self._load_failed_round == round_:
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
        self.store.publish_load(self.ep_rank, round_, window)
        return True

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _plan_alive(self, plan_id: str, cluster: ClusterRecord) -> bool:
        """The plan is the cluster's round in progress (not aborted, not superseded)."""
        return cluster.plan_id == plan_id and cluster.state in (ClusterState.LOADING, ClusterState.LOAD_SUCC,
                                                                ClusterState.SWAPPING)

    def _new_phy2log(self, plan_id: str) -> np.ndarray:
        new = self.store.plan_phy2log(plan_id)
        if new is None:
            raise WeightError(f"plan {plan_id} has no new_phy2log")
        return new

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
                       changes={"plan_id": plan_id, "round": cluster.round, "reason": ""})
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
        self.rank.fire("staged", record=me, changes=info)
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
        except WeightError as err:
            self._drop_staging()
            self.rank.fire("fail", record=me, reason=str(err), changes={"reason": str(err)})
            return True
        return False

    def _on_swapping(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        plan_id = me.plan_id
        new = self._new_phy2log(plan_id)
        t0 = time.perf_counter()
        report: dict[str, Any] = {}
        if not np.array_equal(self.backend.phy2log, new):
            for attempt in (1, 2):
                try:
                    info = self._stage(plan_id)
                except WeightError as err:  # past the commit point: report and retry on the next wake-up
                    self.log.error("staging failed after the commit point", error=str(err))
                    self.rank.update(reason=f"staging failed after commit: {err}")
                    self.store.emit_event("alarm", rank=self.ep_rank, message=f"staging failed: {err}")
                    return False
                try:
                    swap = self.backend.swap(self.staged.staged, new)
                    break
                except VerificationError as err:
                    # past the commit point: no abort. Restore the old placement from the checkpoint, stage
                    # again from disk and retry once; then stay SWAPPING and let the deadline raise the alarm.
                    self.log.error("swap verification failed", attempt=attempt, error=str(err))
                    self.store.emit_event("alarm", rank=self.ep_rank, message=f"swap verification failed: {err}")
                    self._drop_staging()
                    self.backend.reload()
                    if attempt == 2:
                        self.rank.update(reason=f"swap verification failed twice: {err}")
                        return False
            report.update(info)
            report.update({k: v for k, v in swap.items() if k in _REPORT_FIELDS})
            self._drop_staging()
        total = self.backend.slots_total
        if self.verify_all:
            verified, total = self.backend.verify()
        else:  # swap() verified every changed slot; the kept ones were verified when they were written
            verified = total
        self.live_plan_id = plan_id
        report.update({"swap_ms": round((time.perf_counter() - t0) * 1000, 3), "slots_verified": verified,
                       "slots_total": total, "live_plan_id": plan_id, "verified_all": int(self.verify_all),
                       "routing_digest": routing_digest(self.backend.phy2log)})
        if verified != total:
            self.log.error("verification failed", verified=verified, total=total)
            report["reason"] = f"{total - verified} of {total} slots do not match the checkpoint"
            self.rank.update(**report)
            self.store.emit_event("alarm", rank=self.ep_rank, message=report["reason"])
            return False
        self.rank.fire("swapped", record=me, changes=report)
        return True

    def _on_swapped(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        if cluster.state is ClusterState.SWAPPING and cluster.plan_id == me.plan_id:
            return False  # the other ranks are still swapping
        self.rank.fire("finish", record=me)
        return True

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
