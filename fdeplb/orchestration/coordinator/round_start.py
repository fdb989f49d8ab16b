"""The coordinator's entry work in FREE: start a requested round (the start guard: stale ranks refuse it, audited once),
expire an old request; and the abort every phase ends a failed round with."""

from __future__ import annotations

from fdeplb.errors import ContentionError, FenceError, GuardError, StateError
from fdeplb.machines.tables import CLUSTER, MemberState
from fdeplb.orchestration.coordinator.entry_step import Step
from fdeplb.orchestration.housekeeping import prune_after_round
from fdeplb.rounds import reasons
from fdeplb.rounds.members import participants_text
from fdeplb.store import ClusterRecord
from fdeplb.store.liveness import stale_of


class RoundStart:
    """Entry work in FREE, the round's deadline and its abort. It uses, of its host
    (:class:`~fdeplb.orchestration.coordinator.Coordinator`): ``store``, ``config``, ``log``, ``holder``, ``lease``,
    ``audit_dir``, ``_now_ms``, ``_fire`` and the other phases' helpers."""

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
                                            reason=why.text[:2000], fence=self.lease or "", detail=why.detail,
                                            drop_supplied="operator")  # else FREE would request it again
            except FenceError:
                raise
            except ContentionError as err:  # other writers won every attempt: not withdrawn, the next pass retries
                self.log.warning("request expiry contended", round=rec.requested, age_ms=age, ttl_ms=ttl,
                                 error=str(err))
                return True, None
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

