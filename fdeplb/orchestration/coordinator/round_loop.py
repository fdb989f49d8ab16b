"""The coordinator: drives the cluster rearrangement machine while it holds the lease.

One coordinator leads per cluster (lease ``SET NX PX`` + monotonic fence, see ``store/lua/lease.lua``); others stand
by and take over when the leader's lease lapses. Every cluster commit carries the leader's fence, so a deposed
leader that wakes up later commits nothing.

The coordinator is a reconcile loop: read the cluster record, run the *entry work* of its state, which is
idempotent and may fire the next trigger; otherwise block on the audit and events streams (``XREAD BLOCK``) until
something changes or a deadline or the lease renewal is due. A replacement coordinator therefore re-runs the entry
work of whatever state it finds, which is how a kill at any point converges.

This module owns the loop and the table of entry work per cluster state (:data:`ENTRY_WORK`); the entry work
itself is per phase beside it: :mod:`~fdeplb.orchestration.coordinator.round_start` (FREE, the abort),
:mod:`~fdeplb.orchestration.coordinator.round_planning` (COLLECTING, PLANNING, gated by :mod:`~fdeplb.rounds.gating`),
:mod:`~fdeplb.orchestration.coordinator.round_switch` (LOADING to DONE). The lease is
:mod:`~fdeplb.orchestration.leadership`'s, the rounds nobody asked for (re-placement, periodic)
:mod:`~fdeplb.orchestration.periodic`'s, membership :mod:`~fdeplb.orchestration.membership`'s, retention and the
weights watchdog are :mod:`~fdeplb.orchestration.housekeeping`'s.
"""

from __future__ import annotations

import threading
from typing import Callable

import structlog

from fdeplb.errors import (CorruptRecordError, FenceError, GuardError, InputError, NotFoundError,
                           RedisUnavailableError, StaleStateError, StateError)
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import CLUSTER, ClusterState, entry_work
from fdeplb.orchestration import membership
from fdeplb.orchestration.coordinator.entry_step import ABORTABLE, RETRY_MS, Step
from fdeplb.orchestration.coordinator.round_planning import RoundPlanning
from fdeplb.orchestration.coordinator.round_start import RoundStart
from fdeplb.orchestration.coordinator.round_switch import RoundSwitch
from fdeplb.orchestration.housekeeping import WeightsWatchdog
from fdeplb.orchestration.leadership import Leadership
from fdeplb.orchestration.periodic import UnaskedRounds
from fdeplb.orchestration.reconcile import run_until_stopped
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import Planner, default_planner
from fdeplb.rounds.members import lost_participants
from fdeplb.store import ClusterConfig, ClusterRecord, Store

log = structlog.get_logger("fdeplb.coordinator")

__all__ = ["ABORTABLE", "ENTRY_WORK", "RETRY_MS", "Coordinator", "Step"]


class Coordinator(RoundStart, RoundPlanning, RoundSwitch, UnaskedRounds, Leadership):
    """Leader-elected driver of one cluster's rearrangement machine.

    ``lease_ms``: lease time to live; renewed every ``lease_ms / 3``. ``planner`` maps (expert_load int64 [L, E],
    old phy2log int64 [L, P], config) to new phy2log int64 [L, P] (default: :func:`default_planner`).

    Periodic trigger: with ``interval_s`` the coordinator considers a round every ``interval_s`` seconds (besides
    requested ones), on the ranks' latest published windows. It is *skipped* (an audited outcome, trigger ``skip``,
    reason ``skipped: ...`` with its numbers, also in the cluster record's ``reason``) when the current mean
    balancedness is at or above ``min_balancedness`` (SGLang's ``eplb_min_rebalancing_utilization_threshold``)
    or the planned gain is at most the cluster's ``min_gain``; otherwise a round is requested (reason
    ``interval``).

    Switch step: the commit resets the cluster's ``switch_step`` to 0 (not fixed). The ranks fix it themselves once
    every one of them is armed for the swap (:meth:`fdeplb.store.Store.arm_switch`), from their current step
    counters: the coordinator takes no part (an estimate made here from lazily reported counters could lie behind a
    rank that has already passed it).

    Liveness: a round does not start while a rank is not registered or its heartbeat is stale (past its TTL,
    :func:`~fdeplb.store.liveness.stale_of` over every rank of ``ep_size``); the refusal is
    audited once (trigger ``start_refused``, with the ranks and their heartbeat ages) and the start waits. The start
    that follows a refusal names every registered rank's heartbeat age and TTL in its audit reason
    (:mod:`fdeplb.rounds.reasons`), so a replay sees the refused ranks fresh again. A request still not
    started ``deadlines.request_ttl_ms`` after it was made expires: withdrawn with a fenced ``request_expired`` note
    naming its age and what it waited on (:func:`fdeplb.rounds.reasons.request_expired`).

    Settings: the configuration is read again at every FREE step (``fdeplb config set`` bumps its version), so a
    change applies from the next round; a round in flight keeps the settings it started with. ``audit_dir``: the
    only directory the audit export (``audit_keep``) may write in (None: exporting, and trimming, is off).
    """

    def __init__(self, store: Store, holder: str | None = None, *, lease_ms: int = 3_000,
                 planner: Planner | None = None,
                 interval_s: float | None = None, min_balancedness: float | None = None,
                 audit_dir: str | None = None) -> None:
        self._init_leadership(holder, lease_ms)
        if interval_s is not None and not interval_s > 0:
            raise InputError(f"interval_s must be > 0, got {interval_s}")
        if min_balancedness is not None and not 0 < min_balancedness <= 1:
            raise InputError(f"min_balancedness must be in (0, 1], got {min_balancedness}")
        self.interval_s = interval_s
        self.min_balancedness = min_balancedness
        self.audit_dir = audit_dir
        self._next_periodic_ms: int | None = None
        self._refused_ranks: list[int] | None = None
        self._start_waits: str | None = None  # the last reason a requested start waited on (logged once)
        self.store = store
        self._now_ms = 0  # the server's clock as the current step read the cluster record (deadlines compare to it)
        self.planner = planner or default_planner
        self.stop_event = threading.Event()
        self.config: ClusterConfig | None = None
        self._plan_checked = ""  # the plan_id whose stored new_phy2log this coordinator has validated
        self._whole_look: tuple[tuple[int, str], float] = ((0, ""), 0.0)  # (round, state), next whole-record look
        self.log = log.bind(holder=self.holder, cluster=store.cluster)
        self._weights_watch = WeightsWatchdog(store, self.holder, self.log)
        self._members = membership.MembershipWatch(store, self.holder, self.log)
        self._failed_closed: str | None = None  # the members a re-placement last failed closed for

    # ---- loop ---------------------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Run until :attr:`stop_event` is set or ``until()`` is true (checked after every step).

        A lost Redis connection is logged and retried every 0.5 s (the lease lapses meanwhile; on return the
        coordinator competes for it again like any other). No other exception leaves the loop: one out of a state's
        entry work is handled by :meth:`step` (the round's deadline still fires); one anywhere else is logged,
        announced as a ``coordinator_error`` event and retried after 1 s."""
        cursor = None

        def iterate() -> bool:
            nonlocal cursor
            if cursor is None:
                cursor = self.store.cursor()
            return self._iterate(cursor, until)

        try:  # no value or bug may kill the loop: log, announce, retry
            run_until_stopped(self.stop_event, iterate, self.log, retry_s=lambda: self._retry_ms() / 1000,
                              deleted=self._stop_if_deleted,
                              announce=lambda err: self.store.emit_event("coordinator_error", holder=self.holder,
                                                                         error=str(err)[:500]))
        finally:
            self._release_leadership()

    def _retry_ms(self) -> int:
        """The back-off after a failed step: :data:`RETRY_MS`, but at most a third of the lease, so that the lease
        is renewed in time however short it is (a longer back-off let it lapse at every retry)."""
        return min(RETRY_MS, self.lease_ms // 3)

    def _iterate(self, cursor: dict, until: Callable[[], bool] | None) -> bool:
        """One pass of the loop: lead, step, wait. True when ``until()`` says to stop."""
        wait_ms = self.lease_ms // 3
        if self.ensure_leadership():
            try:
                progressed, due_ms = self.step()
            except FenceError as err:
                self.log.warning("fenced", error=str(err))
                self.store.emit_event("fenced", holder=self.holder, error=str(err))
                self.lease = None
                return False
            except (StaleStateError, GuardError) as err:
                self.log.info("retry", error=str(err))
                progressed, due_ms = True, None
            if until is not None and until():
                return True
            if progressed:
                return False
            if due_ms is not None:
                wait_ms = max(1, min(wait_ms, due_ms))
        elif until is not None and until():
            return True
        self.store.wait(cursor, wait_ms)
        return False

    def step(self) -> Step:
        """Run the entry work of the cluster's current state once (:data:`ENTRY_WORK`).

        Returns (progressed, ms until the next deadline or None). Raises StateError subclasses on lost races.
        """
        if self.config is None:
            self.config = self.store.read_config()
        try:
            rec, self._now_ms = self.store.read_cluster_at()
        except NotFoundError:  # the cluster is gone (Redis lost its data?): read its configuration again when back
            self.config = None
            self.store.read_config(fresh=True)  # drops the store's cached one; NotFoundError while there is none
            raise
        failpoint("coordinator.hang", rec.state,
                  lambda: self.store.emit_event("failpoint", name="coordinator.hang", state=rec.state,
                                                holder=self.holder))
        try:
            # membership first, at every pass (one round trip): a suspected rank aborts a round at once
            changed, member_due = self._members.observe(self.lease or "", self.config.deadlines.exclude_ms,
                                                        rec.state, rec.members)
            if changed:  # the generation moved: decide under the new one
                rec, self._now_ms = self.store.read_cluster_at()
            lost = lost_participants(rec.members, self._members.view, self.config.ep_size) \
                if rec.state in ABORTABLE else []
            if lost:
                return self._abort(rec, reasons.Reason(
                    f"membership changed in the round: ranks {lost} are not its ACTIVE members", {"ranks": lost}))
            progressed, due = ENTRY_WORK[rec.state](self, rec)
            return progressed, due if member_due is None else member_due if due is None else min(due, member_due)
        except (StateError, RedisUnavailableError):
            raise  # lost races and a lost connection: the loop handles them
        except Exception as err:  # noqa: BLE001 - a bad stored value or a bug: the round must still end
            return self._step_failed(rec, err)

    def _step_failed(self, rec: ClusterRecord, err: Exception) -> Step:
        """A state's entry work raised. Before the commit point a corrupt stored value aborts the round at once
        (the reason names the key and the problem) and any other error aborts it when its deadline passes; after
        the commit point the deadline raises the alarm. Meanwhile the step is retried every second."""
        problem = f"{type(err).__name__}: {err}"
        self.log.error("entry work failed", round=rec.round, state=rec.state, error=problem)
        self.store.emit_event("coordinator_error", holder=self.holder, state=rec.state, error=problem[:500])
        if rec.state in ABORTABLE and isinstance(err, (CorruptRecordError, InputError)):
            return self._abort(rec, f"{rec.state} failed: {problem}")
        if isinstance(err, CorruptRecordError):  # no round to abort (FREE) or past the commit point: say it, audited
            self._alarm(rec, f"a stored value is corrupt: {problem} (the coordinator retries this step every "
                             f"second until it succeeds)"[:2000])
        _, left = self._deadline(rec)
        # back off (not on the streams: this step's own event would wake it at once), then enforce the deadline
        retry = self._retry_ms()
        self.stop_event.wait((retry if left is None else max(1, min(retry, left))) / 1000)
        self._now_ms = self.store.now_ms()
        if self._deadline(rec)[0]:
            if rec.state in ABORTABLE:
                return self._abort(rec, f"{rec.state} failed until its deadline passed: {problem}")
            if rec.state is ClusterState.SWAPPING:
                self._alarm(rec, f"swapping deadline passed; rolling forward; entry work failing: {problem}")
        return True, None


#: cluster state -> the coordinator's entry work in that state (checked complete against the CLUSTER table)
ENTRY_WORK = entry_work(CLUSTER, {
    ClusterState.FREE: Coordinator._on_free,
    ClusterState.COLLECTING: Coordinator._on_collecting,
    ClusterState.PLANNING: Coordinator._on_planning,
    ClusterState.LOADING: Coordinator._on_loading,
    ClusterState.LOAD_SUCC: Coordinator._on_load_succ,
    ClusterState.SWAPPING: Coordinator._on_swapping,
    ClusterState.DONE: Coordinator._on_done,
})
