"""The coordinator's entry work from LOADING to DONE: wait for every rank to load, commit, wait for every rank to
swap (alarms for a rank that failed past the commit point), then release the round (its rollback hook:
:mod:`~fdeplb.orchestration.rollback`)."""

from __future__ import annotations

import time

from fdeplb.errors import CorruptRecordError
from fdeplb.machines.tables import CLUSTER, RANK, RankState
from fdeplb.orchestration import rollback
from fdeplb.orchestration.coordinator.entry_step import RETRY_MS, Step
from fdeplb.orchestration.housekeeping import prune_after_round
from fdeplb.rounds import reasons
from fdeplb.rounds.members import participants
from fdeplb.store import ClusterRecord


class RoundSwitch:
    """Entry work in LOADING, LOAD_SUCC, SWAPPING and DONE. It uses, of its host
    (:class:`~fdeplb.orchestration.coordinator.Coordinator`): ``store``, ``config``, ``log``, ``holder``, ``lease``,
    ``audit_dir``, ``_now_ms``, ``_fire`` and the other phases' helpers."""

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


