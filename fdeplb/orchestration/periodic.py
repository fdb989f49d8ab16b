"""The coordinator's rounds nobody asked for, while the cluster is FREE: the re-placement round a lost rank calls
for (the current placement leaves a logical expert without a replica on an ACTIVE member) and the periodic trigger
(``interval_s``), skipped and audited with its numbers when it is not worth a round; before the periodic
trigger, the round a supplied placement waits for (a rollback, :mod:`~fdeplb.orchestration.rollback`). The periodic
trigger judges the load windows of the members the current placement is routed over, its figures over those members
(and planned from them per source rank where a round would be: :func:`fdeplb.rounds.gating.round_source`).

:class:`UnaskedRounds` is mixed into :class:`~fdeplb.orchestration.coordinator.Coordinator`; it uses, of its host:
``store``, ``config``, ``holder``, ``log``, ``planner``, ``interval_s``, ``min_balancedness``,
``_next_periodic_ms``, ``_members`` and ``_failed_closed``.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import FdeplbError
from fdeplb.machines.tables import CLUSTER
from fdeplb.orchestration import rollback
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import mean_balancedness, plan_round, round_source, split_of
from fdeplb.rounds.members import live_mask, live_planner, routed_members
from fdeplb.store import ClusterRecord

#: (progressed, ms until the next deadline or None), as the coordinator's entry work returns
Step = tuple[bool, "int | None"]


class UnaskedRounds:
    """The re-placement request and the periodic trigger (see the module doc)."""

    def _replace_or_periodic(self, rec: ClusterRecord) -> Step:
        """In FREE with no round asked for: a membership round when the current placement is routed over other
        ranks than the ACTIVE members (a rank left: its orphaned experts are re-placed and its slots leave the
        routes; a rank rejoined: the round plans with it and routes to it), once per set of members it failed
        closed for; else the periodic trigger."""
        live = live_mask(self._members.view, self.config.ep_size)
        active = tuple(np.flatnonzero(live).tolist())
        key = ",".join(map(str, active))
        if key != self._failed_closed:
            routed = self.store.current_placement().live_ranks(self.config.ep_size)
            target = routed_members(routed, self._members.view, self.config.ep_size)
            if routed != target:  # an EXCLUDED rank is still routed to, or an admitted one is not yet
                lost, back = sorted(set(routed) - set(target)), sorted(set(target) - set(routed))
                why = [f"ranks {lost} are not members" if lost else "", f"ranks {back} rejoined" if back else ""]
                self.store.request_round("replacement: " + "; ".join(w for w in why if w))
                return True, None
        if rollback.request_supplied(self.store):  # a round to a supplied placement (a rollback): at once
            return True, None
        return self._periodic(rec)

    def _periodic(self, rec: ClusterRecord) -> Step:
        """The periodic trigger (``interval_s``): skip, audited with its numbers, or request a round."""
        if self.interval_s is None:
            return False, None
        now = self.store.now_ms()
        if self._next_periodic_ms is None:
            self._next_periodic_ms = now + int(self.interval_s * 1000)
        if now < self._next_periodic_ms:
            return False, self._next_periodic_ms - now
        self._next_periodic_ms = now + int(self.interval_s * 1000)
        cfg = self.config
        current = self.store.current_placement()  # judged over the members it is routed over, as a round plans
        members = current.live_ranks(cfg.ep_size)
        live = np.isin(np.arange(cfg.ep_size), members)
        windows = [self.store.read_load(r) for r in members]
        if any(w is None for w in windows):  # no window to judge by: the round collects them and gates itself
            self.store.request_round("interval")
            return True, None
        load = np.sum(np.stack([w.expert_load for w in windows]), axis=0, dtype=np.int64)
        if not load.any():
            return self._skip(rec, "skipped: no tokens in the ranks' load windows")
        old = current.phy2log
        before = mean_balancedness(load, old, cfg.ep_size, live)
        if self.min_balancedness is not None and before >= self.min_balancedness:
            return self._skip(rec, f"skipped: balancedness {before:.4f} >= threshold {self.min_balancedness}")
        split = split_of([(r, w.expert_load) for r, w in zip(members, windows)], cfg)  # as the round would plan
        try:
            decision = plan_round(load, old, cfg, self.planner if live.all() else
                                  live_planner(self.planner, live), live, round_source(cfg, split, live))
        except FdeplbError as err:
            return self._skip(rec, f"skipped: planning failed: {err}")
        skip = reasons.skipped(decision)  # the gate's one rule and words (GateDecision.why_skipped)
        if skip is not None:
            return self._skip(rec, skip.text, skip.detail)
        self.store.request_round(f"interval: balancedness {before:.4f}, planned {decision.balancedness_after:.4f}")
        return True, None

    def _skip(self, rec: ClusterRecord, reason: str, detail: dict | None = None) -> Step:
        """A periodic round not worth running: a normal outcome, audited (trigger ``skip``) with its numbers
        (``detail``: the gate's figures when it planned)."""
        self.log.info("skip", reason=reason)
        self.store.update(CLUSTER, reason=reason)  # first: whoever sees the audit note sees the reason
        self.store.append_note(rec, trigger="skip", actor=self.holder, reason=reason, detail=detail)
        self.store.emit_event("skipped", reason=reason)
        return False, int(self.interval_s * 1000)

