"""The coordinator's entry work in COLLECTING (sum the ranks' windows, or take a supplied load, into the round's
snapshot; for a policy that plans per source rank, also keep the windows unsummed) and PLANNING (plan over the
round's members, gate the gain: :mod:`fdeplb.rounds.gating`)."""

from __future__ import annotations

import numpy as np

from fdeplb.errors import CorruptRecordError, FdeplbError
from fdeplb.orchestration import rollback
from fdeplb.orchestration.coordinator.entry_step import Step
from fdeplb.placement import MAX_LOAD, orphaned_experts, plan_digest
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import decide, plan_round, round_source, source_fact, split_of
from fdeplb.rounds.members import live_planner, participants, replacement
from fdeplb.store import ClusterRecord, PlanEntry


class RoundPlanning:
    """Entry work in COLLECTING and PLANNING. It uses, of its host
    (:class:`~fdeplb.orchestration.coordinator.Coordinator`): ``store``, ``config``, ``log``, ``holder``, ``lease``,
    ``audit_dir``, ``_now_ms``, ``_fire`` and the other phases' helpers."""

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
            if not self.store.freeze_windows(round_, total, split_of(loads, self.config)):
                return True, None  # a load was supplied for this round meanwhile: the next step freezes it
        self._fire(rec, "plan", plan_id="",
                   changes={"deadline_ms": self.store.now_ms() + self.config.deadlines.collecting_ms})
        return True, None

    def _on_planning(self, rec: ClusterRecord) -> Step:
        cfg = self.config
        round_ = rec.round
        if self._deadline(rec)[0]:
            return self._abort(rec, "planning deadline passed")
        try:  # and its split per source rank, kept for a policy that plans from it
            snapshot, split = self.store.read_snapshot(round_), self.store.read_source_load(round_)
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
        # what a policy that plans per source rank is given (None for any other, over some ranks only, or a round
        # to a supplied placement); an input of the plan, so its digest is a fact of the plan_id's topology
        source = None if supplied is not None else round_source(cfg, split, live)
        topology = {**topology, **source_fact(source)}
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
                                      live_planner(self.planner, live), live, source)
            else:  # content-addressed: a retried round reuses the stored plan
                decision = decide(snapshot, old, new, cfg, live, source)
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

