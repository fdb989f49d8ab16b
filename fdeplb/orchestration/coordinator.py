"""The coordinator: drives the cluster rearrangement machine while it holds the lease.

One coordinator leads per cluster (lease ``SET NX PX`` + monotonic fence, see ``store/lua/lease.lua``); others stand
by and take over when the leader's lease lapses. Every cluster commit carries the leader's fence, so a deposed
leader that wakes up later commits nothing.

The coordinator is a reconcile loop: read the cluster record, run the *entry work* of its state, which is
idempotent and may fire the next trigger; otherwise block on the audit and events streams (``XREAD BLOCK``) until
something changes or a deadline or the lease renewal is due. A replacement coordinator therefore re-runs the entry
work of whatever state it finds, which is how a kill at any point converges.

This module owns the loop and the round's entry work per cluster state (with the periodic trigger, gated by
:mod:`~fdeplb.rounds.gating`); the lease is :mod:`~fdeplb.orchestration.leadership`'s, the rounds nobody asked for (re-placement, periodic)
:mod:`~fdeplb.orchestration.periodic`'s, membership :mod:`~fdeplb.orchestration.membership`'s, retention and the
weights watchdog are :mod:`~fdeplb.orchestration.housekeeping`'s.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import structlog

from fdeplb.errors import CorruptRecordError, FdeplbError, FenceError, GuardError, InputError, \
    NotFoundError, RedisUnavailableError, StaleStateError, StateError
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import CLUSTER, RANK, ClusterState, MemberState, RankState, entry_work
from fdeplb.orchestration import membership, rollback
from fdeplb.orchestration.housekeeping import WeightsWatchdog, prune_after_round
from fdeplb.orchestration.leadership import Leadership
from fdeplb.orchestration.periodic import UnaskedRounds
from fdeplb.orchestration.reconcile import run_until_stopped
from fdeplb.placement import MAX_LOAD, orphaned_experts, plan_digest
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import Planner, decide, default_planner, plan_round
from fdeplb.rounds.members import live_planner, lost_participants, participants, participants_text, replacement
from fdeplb.store import ClusterConfig, ClusterRecord, PlanEntry, Store
from fdeplb.store.liveness import stale_of

log = structlog.get_logger("fdeplb.coordinator")

#: what a state's entry work returns: (progressed, ms until the next deadline or None)
Step = tuple[bool, "int | None"]

#: states the ``abort`` trigger leaves (before the commit point): a failing step there ends in an abort
ABORTABLE = frozenset(CLUSTER.spec(ClusterState.COLLECTING, "abort").sources)
#: how long a failing step waits before it is retried (ms); at most a third of the lease (:meth:`Coordinator._retry_ms`)
RETRY_MS = 1_000


__all__ = ["ABORTABLE", "ENTRY_WORK", "RETRY_MS", "Coordinator", "Step"]


class Coordinator(UnaskedRounds, Leadership):
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
            self._alarm(rec, f"a stored value is corrupt, the coordinator cannot go on until it is repaired: "
                             f"{problem}"[:2000])
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

    # ---- entry work per state (idempotent) ------------------------------------------------------------------------
    def _deadline(self, rec: ClusterRecord) -> tuple[bool, int | None]:
        """(passed, ms left) of the round's deadline at the server time the step read ``rec`` with."""
        if not rec.deadline_ms:
            return False, None
        left = rec.deadline_ms - self._now_ms
        return left <= 0, max(left, 0)

    def _abort(self, rec: ClusterRecord, reason: str | reasons.Reason) -> Step:
        """Fire ``abort`` with ``reason`` (audited; a :class:`~fdeplb.rounds.reasons.Reason` also writes its
        detail). A gated skip (its detail has the gate's figures) is logged as an info "skip": not a failure."""
        why = reason if isinstance(reason, reasons.Reason) else reasons.Reason(reason)
        text = why.text[:2000]
        if "gate" in why.detail:
            self.log.info("skip", round=rec.round, state=rec.state, reason=text, **why.detail["gate"])
        else:
            self.log.warning("abort", round=rec.round, state=rec.state, reason=text)
        prune_after_round(self.store, self.config, rec, self.log, self.holder, self.lease or "", self.audit_dir)
        self._fire(rec, "abort", reason=text, detail=why.detail, changes={"deadline_ms": 0, "reason": text})
        return True, None

    def _on_free(self, rec: ClusterRecord) -> Step:
        self.config = self.store.read_config(fresh=True)  # between rounds: `fdeplb config set` applies from here
        self._weights_watch.watch(rec, self.config, self.lease or "")
        view = self._members.view
        if rec.requested <= rec.round:
            return self._replace_or_periodic(rec)
        ttl = self.config.deadlines.request_ttl_ms
        age = self._now_ms - rec.requested_ms
        if rec.requested_ms and age > ttl:  # nothing waits without a deadline: the request expires, audited
            why = reasons.request_expired(rec.requested, age, ttl, self._start_waits or rec.reason)
            try:
                self.store.withdraw_request(rec.requested, trigger="request_expired", actor=self.holder,
                                            reason=why.text[:2000], fence=self.lease or "", detail=why.detail)
            except FenceError:
                raise
            except StateError:  # started or withdrawn meanwhile: the next pass sees which
                return True, None
            self.log.warning("request expired", round=rec.requested, age_ms=age, ttl_ms=ttl)
            self._refused_ranks, self._start_waits = None, None
            return True, None
        beats = self.store.heartbeats() if view is None else view.heartbeats
        gone = set() if view is None else {r for r, st in enumerate(view.states()) if st is MemberState.EXCLUDED}
        # every rank of ep_size counts, registered or not (an agent whose records Redis lost is not registered)
        stale = {r: age for r, age in stale_of(beats, self.config.ep_size).items() if r not in gone}
        if stale:
            refused = reasons.refusal(stale)
            if sorted(stale) != self._refused_ranks:  # audited once per set of stale ranks
                self._refused_ranks = sorted(stale)
                self.log.warning("start refused", stale=stale)
                self.store.update(CLUSTER, reason=refused.text)  # first: whoever sees the audit note sees the reason
                self.store.append_note(rec, trigger="start_refused", actor=self.holder, reason=refused.text,
                                       detail=refused.detail)
                self.store.emit_event("start_refused", reason=refused.text)
            return False, self._until_expiry(rec)
        self._refused_ranks = None
        # after a refusal (also one by a previous leader: it is the record's reason), the start shows why it may go
        why = reasons.fresh(beats) if rec.reason.startswith(reasons.REFUSED) else reasons.Reason("")
        deadline = self.store.now_ms() + self.config.deadlines.collecting_ms
        round_ = rec.round + 1
        try:
            active = list(range(self.config.ep_size)) if view is None else view.active()
            members = participants_text(active, self.config.ep_size)
            self._fire(rec, "start", plan_id="", round_=round_, reason=why.text, detail=why.detail,
                       changes={"round": round_, "plan_id": "", "reason": "", "deadline_ms": deadline, "alarm": "",
                                "members": members})
        except GuardError as err:  # ranks still finishing the previous round, or weights not NORMAL
            if str(err) != self._start_waits:  # logged once per reason, not at every retry
                self._start_waits = str(err)
                self.log.info("start waits", reason=str(err))
            return False, self._until_expiry(rec)
        self._start_waits = None
        return True, None

    def _until_expiry(self, rec: ClusterRecord) -> int:
        """How long a waiting start sleeps: a third of the lease, or less when the request expires sooner."""
        if not rec.requested_ms:
            return self.lease_ms // 3
        left = rec.requested_ms + self.config.deadlines.request_ttl_ms - self._now_ms + 1
        return max(1, min(self.lease_ms // 3, left))

    def _on_collecting(self, rec: ClusterRecord) -> Step:
        round_ = rec.round
        try:
            frozen = self.store.read_snapshot(round_) is not None
        except CorruptRecordError as err:
            self.store.drop_snapshot(round_)
            return self._abort(rec, f"load snapshot of round {round_} is corrupt: {err}")
        # ---- a supplied load replaces the windows (the operator's, over the HTTP API: recv_expert_weight)
        if not frozen:
            supplied = self.store.supplied_load(round_)
            if supplied is not None:
                expected = (self.config.num_layers, self.config.num_logical_experts)
                if supplied.shape != expected:  # the API checks the shape: only a value written otherwise
                    return self._abort(rec, f"the load supplied for round {round_} has shape {supplied.shape}, "
                                            f"expected {expected}")
                self.store.save_snapshot(round_, supplied)
                frozen = True
        # ---- end of the supplied load
        if not frozen:
            # which windows are there: one field per rank (the windows themselves are read once, when all are);
            # an entry is a round (int), a LoadWindow, None (never published) or a CorruptRecordError
            part = set(participants(rec.members, self.config.ep_size))  # only members' windows count
            found: list = self.store.load_rounds()
            if all(isinstance(at, int) and at >= round_ for r, at in enumerate(found) if r in part):
                found = self.store.read_loads()
            found = [at if r in part else 0 for r, at in enumerate(found)]  # 0: not counted
            corrupt = [(r, err) for r, err in enumerate(found) if isinstance(err, CorruptRecordError)]
            if corrupt:  # the agent publishes a fresh window next round
                self.store.drop_load(corrupt[0][0])
                return self._abort(rec, f"load window of rank {corrupt[0][0]} is corrupt: {corrupt[0][1]}")
            missing = [r for r, at in enumerate(found) if r in part and (
                at is None or (at if isinstance(at, int) else at.round) < round_)]
            if missing:
                expired, left = self._deadline(rec)
                if expired:
                    return self._abort(rec, reasons.Reason(f"collecting deadline passed: no load from ranks {missing}",
                                                           {"ranks": missing}))
                return False, left
            loads = [(r, window.expert_load) for r, window in enumerate(found) if r in part]
            total = np.zeros_like(loads[0][1], dtype=np.int64)
            for r, load in loads:  # every window is in [0, 2**53] and so is the sum so far: exact in int64
                total += load
                if (total > MAX_LOAD).any():
                    at = np.argwhere(total > MAX_LOAD)[0]
                    return self._abort(rec, f"load windows of ranks 0..{r} sum above 2**53 at [layer {at[0]}, "
                                            f"expert {at[1]}]: loads are refused, not wrapped")
            if not self.store.freeze_windows(round_, total):
                return True, None  # a load was supplied for this round meanwhile: the next step freezes it
        self._fire(rec, "plan", plan_id="",
                   changes={"deadline_ms": self.store.now_ms() + self.config.deadlines.collecting_ms})
        return True, None

    def _on_planning(self, rec: ClusterRecord) -> Step:
        cfg = self.config
        round_ = rec.round
        if self._deadline(rec)[0]:
            return self._abort(rec, "planning deadline passed")
        try:
            snapshot = self.store.read_snapshot(round_)
        except CorruptRecordError as err:
            self.store.drop_snapshot(round_)
            return self._abort(rec, f"load snapshot of round {round_} is corrupt: {err}")
        if snapshot is None:
            return self._abort(rec, f"load snapshot of round {round_} is missing")
        current = self.store.current_placement()
        old = current.phy2log
        live = np.zeros(cfg.ep_size, dtype=bool)
        live[participants(rec.members, cfg.ep_size)] = True
        # the members are part of what a plan is computed from (with every rank a member: the topology alone)
        # a round whose members differ from those the placement is routed over is a membership round: never gated
        # (it switches the routing to the members even when nothing moves). One whose members only shrank is a
        # re-route: the orphaned experts get a live replica and nothing else moves (``reroute`` in the topology,
        # which the replay reads); one a rank rejoined plans over every member.
        routed, members = current.live_ranks(cfg.ep_size), tuple(np.flatnonzero(live).tolist())
        regrouped = routed != members
        reroute = regrouped and set(members) < set(routed)
        topology = cfg.topology() if live.all() else {**cfg.topology(), "live_ranks": list(members),
                                                      **({"reroute": True} if reroute else {})}
        supplied = None if regrouped else rollback.supplied_for_planning(self.store, cfg.num_logical_experts, live)
        if supplied is not None:
            topology = {**topology, "supplied": supplied[1]}
        plan_id = plan_digest(snapshot, old, cfg.policy, topology)
        try:
            new = self.store.plan_phy2log(plan_id)
        except CorruptRecordError as err:  # computed again next round
            self.store.drop_plan(plan_id)
            return self._abort(rec, f"stored plan {plan_id} is corrupt: {err}")
        replaced, closed = (None, None) if live.all() else replacement(
            old, cfg.num_logical_experts, cfg.ep_size, live, snapshot)
        if replaced is None and closed is None and reroute:  # nothing orphaned: only the routing changes
            replaced = old.copy()
        if supplied is not None and new is None:  # supplied, not computed: decided as a stored plan, never gated
            new = supplied[0]
        if closed is not None:  # fail closed: no placement drops an expert; audited alarm, placement intact
            self._failed_closed = ",".join(map(str, np.flatnonzero(live)))
            self.store.append_alarm(rec, actor=self.holder, reason=closed.text[:2000], detail=closed.detail)
            return self._abort(rec, closed)
        try:
            if replaced is not None:  # a re-placement: only the orphaned experts move, no gate
                decision = decide(snapshot, old, replaced if new is None else new, cfg, live)
            elif new is None:  # figures over the members (gating.mean_balancedness), as is the plan
                decision = plan_round(snapshot, old, cfg, self.planner if live.all() else
                                      live_planner(self.planner, live), live)
            else:  # content-addressed: a retried round reuses the stored plan
                decision = decide(snapshot, old, new, cfg, live)
        except FdeplbError as err:  # a topology the policy cannot place, a malformed plan: abort, audited
            return self._abort(rec, f"planning failed: {err}")
        new = decision.new_phy2log  # its figures over the round's members, as the gate judged it
        gated = replaced is None and not regrouped and supplied is None
        skip = reasons.gated(decision) if gated else None  # unless it moves and gains
        if skip:
            return self._abort(rec, skip)
        self.store.save_plan(PlanEntry(
            plan_id=plan_id, round=round_, policy=cfg.policy, old_plan_id=current.plan_id, topology=topology,
            generation=rec.generation,
            expert_load=snapshot, old_phy2log=old, new_phy2log=new, balancedness_before=decision.balancedness_before,
            balancedness_after=decision.balancedness_after, moved_experts=decision.moved_experts))
        deadline = self.store.now_ms() + cfg.deadlines.loading_ms
        if supplied is not None:
            why = reasons.supplied_round(**supplied[1])
        elif gated:
            why = reasons.gate_passed(decision)
        else:
            why = reasons.Reason("") if replaced is None else reasons.replacement_round(
                [r for r in routed if r not in members],
                orphaned_experts(old, cfg.num_logical_experts, cfg.ep_size, live))
        self._fire(rec, "load", plan_id=plan_id, reason=why.text, detail=why.detail,
                   changes={"plan_id": plan_id, "deadline_ms": deadline})
        return True, None

    def _rank_states(self, rec: ClusterRecord) -> list[tuple[RankState, str]]:
        """Every rank's (state, plan_id) (:meth:`fdeplb.store.Store.rank_states`: two fields per rank at each
        wake-up). Once the ranks have been awaited in this round's state for ``RETRY_MS``, and then at most every
        ``RETRY_MS``, their whole records are parsed too: a rank record corrupt in another field (its agent cannot
        read it, so the rank never moves) raises its :class:`CorruptRecordError` naming the key, which aborts the
        round before the commit point (:meth:`_step_failed`) instead of letting it wait for its deadline."""
        states = self.store.rank_states()
        now = time.monotonic()
        phase = (rec.round, rec.state.value)
        if self._whole_look[0] != phase:
            self._whole_look = (phase, now + RETRY_MS / 1000)
        elif now >= self._whole_look[1]:
            self._whole_look = (phase, now + RETRY_MS / 1000)
            self.store.read_all(RANK)  # raises for the first missing or corrupt record
        return states

    def _failed(self, states: list[tuple[RankState, str]], plan_id: str) -> list[tuple[int, str]]:
        """Ranks that failed to load ``plan_id``, with their reasons (their whole records are read only then)."""
        if not any(st is RankState.LOAD_FAILED and pid == plan_id for st, pid in states):
            return []
        return self._load_failures(plan_id)

    def _load_failures(self, plan_id: str) -> list[tuple[int, str]]:
        """(rank, reason) of every rank LOAD_FAILED for ``plan_id``, from the ranks' whole records (one corrupt in
        any field raises its :class:`CorruptRecordError` naming the key)."""
        return [(r, x.reason) for r, x in enumerate(self.store.read_all(RANK))
                if x.state is RankState.LOAD_FAILED and x.plan_id == plan_id]

    @staticmethod
    def _not_in(states: list[tuple[RankState, str]], state: RankState, plan_id: str, members: str = "",
                view=None) -> list[int]:
        """The round's participants (``members``, :func:`~fdeplb.rounds.members.participants`) not in
        ``state`` for ``plan_id``; with ``view`` (past the commit point), only those still ACTIVE members: the
        round completes among the members."""
        part = set(participants(members, len(states)))
        if view is not None:
            part &= set(view.active())
        return [r for r, (st, pid) in enumerate(states) if r in part and not (st is state and pid == plan_id)]

    def _check_plan(self, rec: ClusterRecord, *, whole: bool) -> str | None:
        """The round's stored plan is there and valid (what the agents stage); else why not, with the plan
        dropped so that the next round computes it again. Unless ``whole`` (LOAD_SUCC: the last look before the
        commit point), a plan this coordinator validated before is only checked to exist (LOADING wakes once
        per rank transition)."""
        if not whole and rec.plan_id == self._plan_checked:
            return None if self.store.has_plan(rec.plan_id) else f"plan {rec.plan_id} is no longer stored"
        try:
            if self.store.plan_phy2log(rec.plan_id) is None:
                return f"plan {rec.plan_id} is no longer stored"
        except CorruptRecordError as err:
            self.store.drop_plan(rec.plan_id)
            return f"stored plan {rec.plan_id} is corrupt: {err}"
        self._plan_checked = rec.plan_id
        return None

    def _on_loading(self, rec: ClusterRecord) -> Step:
        plan_id = rec.plan_id
        problem = self._check_plan(rec, whole=False)
        if problem:
            return self._abort(rec, problem)
        states = self._rank_states(rec)
        failed = self._failed(states, plan_id)
        if failed:
            return self._abort(rec, "; ".join(f"rank {r} failed to load: {why}" for r, why in failed))
        late = self._not_in(states, RankState.LOADED, plan_id, rec.members)
        if not late:
            deadline = self.store.now_ms() + self.config.deadlines.commit_ms if self.config.cordoned else 0
            self._fire(rec, "loaded", changes={"deadline_ms": deadline})
            return True, None
        expired, left = self._deadline(rec)
        if expired:
            return self._abort(rec, reasons.Reason(f"loading deadline passed: ranks {late} not LOADED",
                                                   {"ranks": late}))
        return False, left

    def _on_load_succ(self, rec: ClusterRecord) -> Step:
        plan_id = rec.plan_id
        problem = self._check_plan(rec, whole=True)
        if problem:
            return self._abort(rec, problem)
        # the last look before the commit point reads whole records: one corrupt in any field aborts the round
        # (_step_failed) before it is committed
        failed = self._load_failures(plan_id)
        if failed:  # a rank lost its staging after LOAD_SUCC (e.g. restarted and could not stage again)
            return self._abort(rec, "; ".join(f"rank {r} failed after loading: {why}" for r, why in failed))
        if self.config.cordoned and rec.commit_requested != plan_id:
            expired, left = self._deadline(rec)
            if expired:
                return self._abort(rec, "commit deadline passed: no external commit for the cordoned cluster")
            return False, left
        deadline = self.store.now_ms() + self.config.deadlines.swapping_ms
        # switch_step 0 and no chunk layout: not fixed yet; the ranks fix both once all are armed for this swap
        # (Store.arm_switch)
        why = reasons.external_commit(rec.commit_requested_by) if self.config.cordoned else reasons.Reason("")
        self._fire(rec, "commit", reason=why.text, detail=why.detail,
                   changes={"deadline_ms": deadline, "switch_step": 0, "switch_chunks": ""})
        return True, None

    def _on_swapping(self, rec: ClusterRecord) -> Step:
        plan_id = rec.plan_id
        late = self._not_in(self._rank_states(rec), RankState.SWAPPED, plan_id, rec.members,
                            self._members.view)
        if not late:  # every probe's verdict is audited with the swap: a failed one is a probe_mismatch
            why = rollback.probe_outcome(self.store, plan_id)
            self._fire(rec, "swapped", reason=why.text, detail=why.detail,
                       changes={"deadline_ms": 0, "probe_mismatch": why.text[:2000]})
            return True, None
        expired, left = self._deadline(rec)
        if expired:
            self._alarm(rec, f"swapping deadline passed; rolling forward; ranks {late} not SWAPPED")
            return False, self.lease_ms // 3
        return False, left

    def _alarm(self, rec: ClusterRecord, alarm: str) -> None:
        """Raise ``alarm`` once (after the commit point the round rolls forward; the alarm makes it visible)."""
        if rec.alarm != alarm:
            self.log.error("alarm", round=rec.round, plan_id=rec.plan_id, alarm=alarm)
            self.store.update(CLUSTER, alarm=alarm)
            self.store.append_alarm(rec, actor=self.holder, reason=alarm)
            self.store.emit_event("alarm", round=rec.round, plan_id=rec.plan_id, message=alarm)

    def _on_done(self, rec: ClusterRecord) -> Step:
        alarm = rollback.after_round(self.store, rec)  # before pruning: the placement a rollback goes back to
        if alarm:
            self._alarm(rec, alarm)
        prune_after_round(self.store, self.config, rec, self.log, self.holder, self.lease or "", self.audit_dir)
        self._fire(rec, "release", changes={"deadline_ms": 0, "alarm": ""})
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
