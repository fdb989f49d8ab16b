"""Membership as the leading coordinator drives it: heartbeats observed at every loop pass (one round trip,
:meth:`fdeplb.store.Store.member_view`) turned into fenced transitions of the ranks' membership records
(ACTIVE -> SUSPECT when a heartbeat is past its TTL, or when an engine a round waits on passed no safe point for
``deadlines.exclude_ms`` (a hung engine, :func:`hung_ranks`), SUSPECT -> ACTIVE when it is fresh again, SUSPECT ->
EXCLUDED once still stale at the record's ``deadline_ms``, set to ``deadlines.exclude_ms`` after the suspicion;
DRAINING -> EXCLUDED while no round is in flight), each audited and raising the cluster's generation in the same
step.

An observation alone never excludes: the coordinator commits the exclusion only with its fence, after the deadline
stored in the member record; the operator's commands (:func:`operator_fire`) are the other way.

The pure rules a round applies to the members (live mask, re-placement, participants) are
:mod:`fdeplb.rounds.members`'s.
"""

from __future__ import annotations

from typing import Any, Collection

from fdeplb.errors import (CorruptRecordError, GuardError, IllegalTransitionError, NotFoundError, StaleStateError,
                           StateError)
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState, entry_work
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.rounds import reasons
from fdeplb.rounds.members import waited_on
from fdeplb.store import MemberRecord, Store
from fdeplb.store.liveness import MemberView, stale_of

M = MemberState

__all__ = ["MEMBER_WORK", "MembershipWatch", "Rejoin", "hung_ranks", "hung_reason", "operator_fire"]


class MembershipWatch:
    """The coordinator's membership driver: :meth:`observe` once per loop pass while it leads."""

    def __init__(self, store: Store, holder: str, log: Any) -> None:
        self.store = store
        self.holder = holder
        self.log = log
        self.view: MemberView | None = None
        self._handles: dict[int, RecordHandle] = {}

    def _handle(self, r: int, fence: str) -> RecordHandle:
        h = self._handles.get(r)
        if h is None or h.fence != fence:
            h = self._handles[r] = RecordHandle(self.store, MEMBERSHIP, r, actor=self.holder, fence=fence)
        return h

    def observe(self, fence: str, exclude_ms: int, cluster_state: ClusterState,
                round_members: str = "") -> tuple[bool, int | None]:
        """Read heartbeats and members (one round trip) and commit what they call for, fenced with ``fence``.
        ``round_members``: the cluster record's ``members`` (a round in flight waits on them,
        :func:`~fdeplb.rounds.members.waited_on`): one whose engine passed no safe point for ``exclude_ms`` is
        suspected as a lapsed heartbeat is (:func:`hung_ranks`). Returns (changed, ms until the next exclusion
        deadline or None); :attr:`view` is the view as read (with the states this pass committed)."""
        view = self._read_view(fence)
        changed, due = False, None
        states = view.states()
        waiting = waited_on(cluster_state, round_members, len(view.members))
        stale_ranks, hung = hung_ranks(view, waiting, exclude_ms)
        for r, rec in enumerate(view.members):
            if rec is None:  # a cluster made before membership: every rank counts, nothing to drive
                continue
            age, ttl = view.heartbeats.get(r, (0, 0))
            stale = r in stale_ranks
            work = MEMBER_WORK[rec.state]
            step = work(self, r, rec, stale=stale, age=age, ttl=ttl, now=view.now_ms, exclude_ms=exclude_ms,
                        cluster_state=cluster_state, fence=fence, hung_ms=hung.get(r),
                        safe_point_ms=view.safe_points.get(r))
            if step is None:
                continue
            dest, left = step
            if dest is not None:
                states[r], changed = dest, True
            if left is not None:
                due = left if due is None else min(due, left)
        self.view = MemberView(view.now_ms, view.heartbeats, [
            m if m is None or m.state == st else _with_state(m, st) for m, st in zip(view.members, states)],
            view.safe_points)
        return changed, due

    def _read_view(self, fence: str) -> MemberView:
        """:meth:`Store.member_view`, with every member record that does not parse, or is missing and not "a
        cluster made before membership" (deleted, :meth:`Store.to_restore`), repaired first from the audit
        (:meth:`Store.repair_member`, audited ``record_repaired``, fenced with ``fence``): a corrupt record never
        blocks the rounds and a deleted one never readmits its rank. So after one pass no record is missing (but in
        a cluster made before membership), and readers walk the audit for a missing one no more. Another corrupt
        value (the registry) raises its :class:`CorruptRecordError`."""
        for _ in range(self.store.ep_size() + 1):
            try:
                view = self.store.member_view()
            except CorruptRecordError as err:
                r = self.store.member_of(err.key)
                if r is None:
                    raise
                self._repair(r, fence)
                continue
            missing = self.store.to_restore(view.members)
            if not missing:
                return view
            for r in missing:
                self._repair(r, fence)
        return self.store.member_view()

    def _repair(self, r: int, fence: str) -> None:
        fixed = self.store.repair_member(r, fence=fence, actor=self.holder)
        if fixed is not None:
            self.log.warning("member record repaired", ep_rank=r, state=fixed.record.state,
                             version=fixed.record.version, source=fixed.source)
            self.store.emit_event("membership", ep_rank=r, trigger="record_repaired", state=fixed.record.state)

    def _fire(self, r: int, rec: MemberRecord, trigger: str, fence: str, reason: reasons.Reason,
              changes: dict[str, Any]) -> MemberState | None:
        try:
            fired = self._handle(r, fence).fire(trigger, record=rec, reason=reason.text, detail=reason.detail,
                                                changes={"actor": self.holder, **changes})
        except (StaleStateError, GuardError) as err:  # an operator or another pass moved it: next pass sees it
            self.log.info("membership retry", ep_rank=r, trigger=trigger, error=str(err))
            return None
        self.log.warning("membership", ep_rank=r, trigger=trigger, to=fired.state, reason=reason.text)
        self.store.emit_event("membership", ep_rank=r, trigger=trigger, state=fired.state)
        return fired.state

    # ---- work per membership state (what an observation calls for) ------------------------------------------------
    def _on_active(self, r: int, rec: MemberRecord, *, stale: bool, age: int, ttl: int, now: int,
                   exclude_ms: int, fence: str, hung_ms: int | None, **_: Any):
        if not stale:
            return None
        if hung_ms is not None:
            why = hung_reason(r, hung_ms, age, ttl, exclude_ms)
        else:
            why = reasons.Reason(f"heartbeat of rank {r} {age} ms old, past its TTL of {ttl} ms",
                                 {"ranks": [r], "heartbeat_age_ms": age, "ttl_ms": ttl})
        return self._fire(r, rec, "suspect", fence, why, {"deadline_ms": now + exclude_ms}), exclude_ms

    def _on_suspect(self, r: int, rec: MemberRecord, *, stale: bool, age: int, ttl: int, now: int,
                    fence: str, hung_ms: int | None, safe_point_ms: int | None, **_: Any):
        if not stale:
            why = reasons.Reason(f"heartbeat of rank {r} fresh again ({age} ms old, TTL {ttl} ms)",
                                 {"ranks": [r], "heartbeat_age_ms": age, "ttl_ms": ttl})
            if safe_point_ms is not None:  # an engine: its safe points go on too
                why = reasons.Reason(f"{why.text}; its last safe point {safe_point_ms} ms before it",
                                     {**why.detail, "safe_point_age_ms": safe_point_ms})
            return self._fire(r, rec, "recover", fence, why, {"deadline_ms": 0}), None
        if rec.deadline_ms and now < rec.deadline_ms:
            return None, rec.deadline_ms - now
        if hung_ms is not None:
            why = reasons.Reason(f"rank {r} still hung at its exclusion deadline (no safe point for {hung_ms} ms)",
                                 {"ranks": [r], "safe_point_age_ms": hung_ms, "heartbeat_age_ms": age,
                                  "ttl_ms": ttl})
        else:
            why = reasons.Reason(f"rank {r} still stale at its exclusion deadline (heartbeat {age} ms old)",
                                 {"ranks": [r], "heartbeat_age_ms": age, "ttl_ms": ttl})
        return self._fire(r, rec, "exclude", fence, why, {"deadline_ms": 0}), None

    def _on_draining(self, r: int, rec: MemberRecord, *, cluster_state: ClusterState, fence: str, **_: Any):
        if cluster_state is not ClusterState.FREE:  # it leaves between rounds
            return None
        why = reasons.Reason(f"rank {r} drained", {"ranks": [r]})
        return self._fire(r, rec, "drained", fence, why, {"deadline_ms": 0}), None

    def _on_idle(self, *_: Any, **__: Any):
        return None


def hung_ranks(view: MemberView, waiting: Collection[int], exclude_ms: int) -> tuple[dict[int, int], dict[int, int]]:
    """(every stale rank of ``view``, the hung ones among them), ``ep_rank -> age ms``, by the one rule
    (:func:`~fdeplb.store.liveness.stale_of`, without ep_size: a rank never registered is not suspected). A rank
    is hung when its heartbeat is fresh but its engine passed no safe point for more than ``exclude_ms`` while a
    round waits on it (``waiting``) or while it is SUSPECT already (it recovers only once its safe points go on:
    a round that aborted for it no longer waits on it, and an ACTIVE hung rank would hold the next one)."""
    suspected = {r for r, st in enumerate(view.states()) if st is M.SUSPECT}
    lapsed = stale_of(view.heartbeats)
    stale = stale_of(view.heartbeats, safe_points=view.safe_points, waited_on=set(waiting) | suspected,
                     hang_ms=exclude_ms)
    return stale, {r: age for r, age in stale.items() if r not in lapsed}


def hung_reason(r: int, hung_ms: int, age: int, ttl: int, exclude_ms: int) -> reasons.Reason:
    """The audited reason of a hung engine's suspicion: its heartbeat is fresh, its safe points stopped."""
    return reasons.Reason(f"no safe point for {hung_ms} ms from rank {r} (a hung engine: its heartbeat is {age} ms "
                          f"old, TTL {ttl} ms), past deadlines.exclude_ms {exclude_ms} while a round waits on it",
                          {"ranks": [r], "safe_point_age_ms": hung_ms, "heartbeat_age_ms": age, "ttl_ms": ttl,
                           "exclude_ms": exclude_ms})


def _with_state(rec: MemberRecord, state: MemberState) -> MemberRecord:
    import dataclasses

    return dataclasses.replace(rec, state=state)


#: membership state -> the coordinator's work on an observation (checked complete against the MEMBERSHIP table)
MEMBER_WORK = entry_work(MEMBERSHIP, {
    M.ACTIVE: MembershipWatch._on_active,
    M.SUSPECT: MembershipWatch._on_suspect,
    M.DRAINING: MembershipWatch._on_draining,
    M.EXCLUDED: MembershipWatch._on_idle,  # comes back only by rejoin / readmit
    M.REJOINING: MembershipWatch._on_idle,  # admitted by the rank's own rejoin (not driven here)
})

#: operator command -> the trigger it fires
OPERATOR_TRIGGERS = {"exclude": "exclude", "drain": "drain", "readmit": "readmit"}


def operator_fire(store: Store, ep_rank: int, command: str, *, who: str, reason: str) -> Any:
    """An operator's membership command on ``ep_rank`` (``exclude`` a SUSPECT rank at once, ``drain`` an ACTIVE
    one, ``readmit`` an EXCLUDED or DRAINING one), audited with ``who`` (the actor) and ``reason``. Raises
    :class:`IllegalTransitionError` (nothing written) when the command is not legal from the rank's state;
    :class:`StateError` when the rank's member record was deleted (the leading coordinator restores it at its next
    pass, :meth:`MembershipWatch._read_view`; the command applies to the restored record);
    :class:`NotFoundError` in a cluster made before membership (no member record at all)."""
    if command not in OPERATOR_TRIGGERS:
        raise IllegalTransitionError(f"membership: no operator command {command!r}")
    handle = RecordHandle(store, MEMBERSHIP, ep_rank, actor=who)
    try:
        rec = handle.read()
    except NotFoundError:
        if int(ep_rank) not in store.to_restore(store.read_each(MEMBERSHIP)):
            raise
        raise StateError(f"the membership record of rank {ep_rank} is missing (deleted): the leading coordinator "
                         f"restores it from the audit at its next pass (`fdeplb status` shows the rank as it will "
                         f"be restored); run `rank {command}` again then") from None
    trigger = OPERATOR_TRIGGERS[command]
    legal = [src.value for spec in MEMBERSHIP.transitions if spec.trigger == trigger for src in spec.sources]
    if rec.state.value not in legal:
        raise IllegalTransitionError(f"rank {ep_rank} is {rec.state.value}: `rank {command}` applies to a rank that "
                                     f"is {' or '.join(legal)}")
    if command == "drain":  # the last member never leaves: with no member nothing serves and no round can start
        others = [r for r in store.restored_view().active() if r != int(ep_rank)]
        if not others:
            raise IllegalTransitionError(f"rank {ep_rank} is the last ACTIVE member: draining it would leave the "
                                         f"cluster with none; readmit or rejoin another rank first")
    why = reasons.Reason(f"operator {command}: {reason}" if reason else f"operator {command}",
                         {"ranks": [int(ep_rank)], "by": who})
    return handle.fire(trigger, record=rec, reason=why.text, detail=why.detail,
                       changes={"actor": who, "deadline_ms": 0})


class Rejoin:
    """A rank agent's way back (EXCLUDED -> REJOINING -> ACTIVE): :meth:`begin` once its agent has loaded the
    cluster's current placement for its slots (``RankAgent.start``), :meth:`step` at every reconcile pass until
    it is admitted, which the table allows only while the cluster is FREE (the next round plans with it)."""

    def __init__(self, store: Store, ep_rank: int, actor: str, log: Any) -> None:
        self.handle = RecordHandle(store, MEMBERSHIP, ep_rank, actor=actor)
        self.store, self.ep_rank, self.actor, self.log = store, ep_rank, actor, log
        self.pending = False
        self._unread: str | None = None  # the plan_id of a begin() that found the member record corrupt

    def begin(self, plan_id: str, back: str = "") -> None:
        """After the agent loaded placement ``plan_id``: an EXCLUDED rank fires ``rejoin``; one left REJOINING by
        an earlier agent carries on. ``back``: why an agent that lived on through the exclusion was away (its
        reason says so, :mod:`~fdeplb.orchestration.comeback`; "" = the agent registered again). A member record
        that does not parse is left to the leading coordinator, which repairs it
        (:meth:`MembershipWatch._read_view`): :meth:`step` asks again until it parses."""
        try:
            rec = self.handle.read()
        except NotFoundError:  # a cluster made before membership
            return
        except CorruptRecordError as err:
            if self._unread is None:
                self.log.warning("member record corrupt: the coordinator repairs it", error=str(err))
            self._unread = plan_id
            return
        self._unread = None
        if rec.state is M.EXCLUDED:
            how = f"is back ({back})" if back else "registered again"
            why = reasons.Reason(f"agent {self.actor} of rank {self.ep_rank} {how} and loaded placement "
                                 f"{plan_id or 'initial'} for its slots", {"ranks": [self.ep_rank]})
            try:
                self.handle.fire("rejoin", record=rec, reason=why.text, detail=why.detail,
                                 changes={"actor": self.actor})
            except StaleStateError:
                return
            rec = self.handle.read()
        self.pending = rec.state is M.REJOINING

    def step(self, cluster_state: ClusterState) -> bool:
        """Admit the rank if it is rejoining and the cluster is FREE; True when it was admitted now."""
        if self._unread is not None:
            self.begin(self._unread)
        if not self.pending or cluster_state is not ClusterState.FREE:
            return False
        why = reasons.Reason(f"rank {self.ep_rank} admitted", {"ranks": [self.ep_rank]})
        try:
            self.handle.fire("admit", reason=why.text, detail=why.detail, changes={"actor": self.actor})
        except (GuardError, StaleStateError) as err:  # a round started meanwhile: after it
            self.log.info("admit waits", error=str(err))
            return False
        except IllegalTransitionError:  # the operator acted meanwhile (readmit, exclude)
            self.pending = False
            return False
        self.pending = False
        self.log.info("admitted", ep_rank=self.ep_rank)
        return True
