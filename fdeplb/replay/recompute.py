"""Recomputing what a recording claims, on top of :mod:`fdeplb.rounds.gating` (the gate and planner the
coordinator uses): :func:`check_plans` re-derives every ``load`` plan from its snapshot, :func:`check_gates` every
gated round's numbers, and :func:`whatif` replans every recorded round with another policy. :class:`Recorded` is
what a recording holds, read like a :class:`~fdeplb.store.Store`.

Pure computation over a :class:`~fdeplb.replay.report.ReplayReport`; no Redis unless a live store is passed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from fdeplb.array_json import array_from_json
from fdeplb.errors import CorruptRecordError, InputError, ReplayError
from fdeplb.placement import POLICIES, check_live_ranks, plan_digest
from fdeplb.placement.digest import routing_digest
from fdeplb.replay.header_checks import check_passed_gates, configs
from fdeplb.replay.report import ReplayReport
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import configured_topology, decide, default_planner, plan_round, round_source, \
    source_fact
from fdeplb.rounds.members import live_planner, replacement
from fdeplb.rounds.reasons import RoundOutcome
from fdeplb.store import ClusterConfig

__all__ = ["Recorded", "check_gates", "check_plans", "whatif"]


# ---- plans ---------------------------------------------------------------------------------------------------------
class Recorded:
    """What a recording holds, with the read methods of :class:`~fdeplb.store.Store` that :func:`check_plans`
    uses (a plan or snapshot not in the recording is None)."""

    def __init__(self, report: ReplayReport) -> None:
        if report.header is None:
            raise InputError("this export has no header (written before schema 1): its plans can only be checked "
                             "against the live cluster (--redis-url, --cluster)")
        self.report = report
        self.config = ClusterConfig.from_json(report.header["config"])
        self.missing = set((report.header.get("missing") or {}).get("plans", []))
        self._timeline = None

    def read_config(self):
        return self.config

    def config_at(self, round_: int):
        """The configuration round ``round_`` ran with (:meth:`fdeplb.replay.header_checks.ConfigTimeline.at`:
        the configuration where the recording starts, changed by every ``config_changed`` note made before it)."""
        if self._timeline is None:
            self._timeline = configs(self.report)
        return self._timeline.at(round_)

    def read_plan(self, plan_id: str):
        return self.report.stored_plans.get(plan_id)

    def read_snapshot(self, round_: int):
        return self.report.snapshots.get(round_)

    def read_source_load(self, round_: int):
        return self.report.source_loads.get(round_)

    def start_placement(self) -> tuple[str, np.ndarray] | None:
        placement = self.report.header["start"].get("placement")
        if not placement:
            return None
        return str(placement.get("plan_id", "")), array_from_json(placement.get("phy2log"), "line 1: placement")


def check_plans(source: Any, report: ReplayReport) -> list[str]:
    """Recompute every ``load`` plan of ``report`` from what ``source`` holds (a :class:`Recorded` or a live
    :class:`~fdeplb.store.Store`) and compare; returns the plan_ids checked.

    For each plan: it is stored (a plan the recording's header lists as pruned is noted in
    ``report.plans_unchecked``, on both paths; a plan the live store pruned after the export is checked from the
    recording's copy), its round and previous placement match the audit (:func:`_check_round`), its load snapshot
    is the round's frozen snapshot,
    :func:`~fdeplb.placement.plan_digest` of (snapshot, old placement, policy, topology) is the plan_id, and the
    coordinator's planner on that snapshot gives the stored ``new_phy2log``; a round to a supplied placement (the
    topology's ``supplied``) is not planned: a rollback's ``new_phy2log`` is the placement it names when the
    recording holds that one, an operator's plan's has the routing digest its facts name. A plan made from its
    round's load per source rank (the topology's ``source_load`` digest) is recomputed from that split, which must
    have that digest; where the split is not held (its snapshot pruned) the plan is noted in
    ``report.plans_unchecked``.
    Raises :class:`ReplayError` at the first plan that does not reproduce.
    """
    config = source.read_config()
    new_of: dict[str, np.ndarray] = {}
    start = source.start_placement() if isinstance(source, Recorded) else None
    if start is not None:
        new_of[start[0]] = start[1]
    recomputed: set[str] = set()
    missing = set(((report.header or {}).get("missing") or {}).get("plans", []))
    planned_in: dict[str, set[int]] = {}
    for plan in report.plans:
        planned_in.setdefault(plan.plan_id, set()).add(plan.round)
    last_round = max((seen.round for seen in report.rounds), default=0)
    for plan in report.plans:
        where = f"{plan.where}: plan {plan.plan_id or '(empty)'} of round {plan.round}"
        try:
            stored = source.read_plan(plan.plan_id)
        except CorruptRecordError as exc:
            raise ReplayError(f"{where}: {exc}") from None
        if stored is None and not isinstance(source, Recorded):  # the live store pruned it after the export
            stored = report.stored_plans.get(plan.plan_id)
        if stored is None:
            if plan.plan_id in missing:  # pruned before the export: the recording says so in its header
                if plan.plan_id not in report.plans_unchecked:
                    report.plans_unchecked.append(plan.plan_id)
                continue
            raise ReplayError(f"{where}: not stored")
        load, old, new = stored.expert_load, stored.old_phy2log, stored.new_phy2log
        _check_round(where, stored.round, plan.round, planned_in[plan.plan_id], last_round)
        # plans are content-addressed: a round that meets the same (snapshot, old placement) as an earlier one
        # reuses that plan, whose stored round and old_plan_id are the earlier one's; compare contents instead
        if plan.previous_plan_id in new_of and not np.array_equal(old, new_of[plan.previous_plan_id]):
            raise ReplayError(f"{where}: old_phy2log is not the placement it started from "
                              f"({plan.previous_plan_id or 'initial'})")
        snapshot = source.read_snapshot(plan.round)
        if snapshot is not None and not np.array_equal(snapshot, load):
            raise ReplayError(f"{where}: expert_load differs from round {plan.round}'s snapshot")
        policy = stored.policy or config.policy
        digest = plan_digest(load, old, policy, stored.topology)
        if digest != plan.plan_id:
            raise ReplayError(f"{where}: (snapshot, old placement, policy, topology) hash to {digest}")
        topology = stored.topology
        supplied = _supplied(topology.get("supplied"), where)  # a round to a given placement: not planned
        live_ranks = topology.get("live_ranks")  # a round with some rank not a member
        reroute = bool(topology.get("reroute", False))  # its members only shrank: the orphans move, nothing else
        if configured_topology(topology) != config.topology():
            raise ReplayError(f"{where}: planned for topology {stored.topology}, the cluster has "
                              f"{config.topology()}")
        if supplied is not None and supplied["kind"] == "operator":  # names its placement by routing digest
            if routing_digest(new) != supplied["plan_id"]:
                raise ReplayError(f"{where}: an operator's plan {supplied['plan_id']}, but its new_phy2log's routing "
                                  f"digest is {routing_digest(new)}")
        elif supplied is not None:  # a rollback goes back to the placement it names, when the recording holds it
            target = new_of.get(supplied["plan_id"])
            if target is not None and not np.array_equal(target, new):
                raise ReplayError(f"{where}: a {supplied['kind']} to placement {supplied['plan_id'] or 'initial'}, "
                                  f"but its new_phy2log is another placement")
        elif plan.plan_id not in recomputed and (split := _plan_source(
                topology, source.read_source_load(plan.round), where, snapshot is not None)) is not _NOT_HELD:
            # (not held: noted unchecked below)
            again = np.asarray(_planned(load if split is None else split, old, replace(config, policy=policy),
                                        live_ranks, where, reroute), dtype=np.int64)
            if not np.array_equal(again, new):
                diff = int(np.count_nonzero(again != new)) if again.shape == new.shape else new.size
                raise ReplayError(f"{where}: recomputing the {policy!r} plan gives a different new_phy2log "
                                  f"({diff} of {new.size} slots differ)")
            recomputed.add(plan.plan_id)
        _check_figures(where, stored, [decide(load, old, new, config, live_ranks)] + (
            [] if live_ranks is None else [decide(load, old, new, config)]))
        new_of[plan.plan_id] = new
        if supplied is None and plan.plan_id not in recomputed:  # made from a split the recording does not hold
            if plan.plan_id not in report.plans_unchecked:
                report.plans_unchecked.append(plan.plan_id)
            continue
        report.plans_checked.append(plan.plan_id)
    return list(report.plans_checked)


def _supplied(facts: Any, where: str) -> dict[str, Any] | None:
    """The ``supplied`` facts of a stored plan's topology, checked (:func:`fdeplb.rounds.reasons.
    supplied_of`); None for a planned round."""
    if facts is None:
        return None
    try:
        return reasons.supplied_of({"supplied": facts})
    except (ValueError, KeyError, TypeError, InputError) as exc:
        raise ReplayError(f"{where}: topology's supplied placement is malformed: {exc}") from None


#: :func:`_plan_source`'s answer for a plan made from a split the recording does not hold
_NOT_HELD = object()


def _plan_source(topology: dict, split: np.ndarray | None, where: str, snapshot_held: bool) -> Any:
    """The load per source rank a plan was made from: None when its ``topology`` names none (no ``source_load``
    fact), the round's ``split`` when it does and the digest matches (:func:`fdeplb.rounds.gating.source_fact`),
    :data:`_NOT_HELD` when the split is not held because the round's snapshot is not (pruned: the split goes with
    it). :class:`ReplayError` for a split of another digest, or none beside a held snapshot (a recording edited, or
    written without it)."""
    if "source_load" not in topology:
        return None
    if split is None and snapshot_held:
        raise ReplayError(f"{where}: planned from a load per source rank of digest {topology['source_load']}, but "
                          f"its round's snapshot holds no load per source rank")
    if split is None:
        return _NOT_HELD
    if source_fact(split) != {"source_load": topology["source_load"]}:
        raise ReplayError(f"{where}: planned from a load per source rank of digest {topology['source_load']}; its "
                          f"round's split has digest {source_fact(split)['source_load']}")
    return split


def _planned(load: np.ndarray, old: np.ndarray, config: Any, live_ranks: Any, where: str,
             reroute: bool = False) -> np.ndarray:
    """What the coordinator plans for ``load`` (int64 [L, E], or the split [L, ep_size, E] a plan names) from
    ``old``: the policy over every rank, or with ``live_ranks``
    (the round's members) the re-placement of the orphaned experts when there are any, else, for a ``reroute``
    (a round whose members only shrank), ``old`` itself (only the routing changes), else the policy over the
    members' slots (:mod:`fdeplb.rounds.members`)."""
    if live_ranks is None:
        return default_planner(load, old, config)
    try:
        live = check_live_ranks(live_ranks, config.ep_size)
    except InputError as exc:
        raise ReplayError(f"{where}: live_ranks {live_ranks!r}: {exc}") from None
    replaced, closed = replacement(old, config.num_logical_experts, config.ep_size, live, load)
    if closed is not None:
        raise ReplayError(f"{where}: a stored plan whose re-placement fails closed: {closed.text}")
    if replaced is not None:
        return replaced
    return old.copy() if reroute else default_planner(load, old, config, live_ranks=live)


def _check_round(where: str, stored: int, referenced: int, planned_in: set[int], last_round: int) -> None:
    """The round a stored plan names against a round whose ``load`` refers to it. Plans are content-addressed and
    written once, so the stored copy's round is the round that wrote it: the reference's own round, an earlier one
    (a round that meets the same load and placement again, e.g. retrying an aborted round, reuses the stored plan),
    or a later one when retention pruned the copy this round used and a later round planned it again (the same
    load and starting placement recurred). The later round must then be one the recording shows planning it (a
    ``load`` of it), or past the recording's last round (a copy written after the export's range).

    The round is the copy's, not the plan's meaning: plan_id, new_phy2log and the figures are recomputed from the
    contents anyway, and the expert_load is compared with the snapshot of every round that refers to it."""
    if stored <= 0:
        raise ReplayError(f"{where}: stored for round {stored}")
    if stored > referenced and stored not in planned_in and stored <= last_round:
        raise ReplayError(f"{where}: stored for round {stored}, which did not plan it (its rounds: "
                          f"{', '.join(map(str, sorted(planned_in)))})")


def _check_figures(where: str, stored: Any, decisions: list[Any]) -> None:
    """A plan line's figures (what ``status`` shows of a staged plan; the line is not chained) against its arrays:
    those of the first of ``decisions`` (over the plan's members), or of the second (over every rank: a plan of a
    round some rank was not a member of, written by fdeplb before schema 3). The store keeps balancedness to 6
    decimals (``PlanEntry.to_fields``), moved experts exactly."""
    names = ("balancedness_before", "balancedness_after", "moved_experts")
    for decision in decisions:
        if all(math.isclose(getattr(stored, n), getattr(decision, n), rel_tol=0.0, abs_tol=1e-6) for n in names):
            return
    bad = next(n for n in names if not math.isclose(getattr(stored, n), getattr(decisions[0], n), rel_tol=0.0,
                                                    abs_tol=1e-6))
    raise ReplayError(f"{where}: {bad} is {getattr(stored, bad)}, its arrays give {getattr(decisions[0], bad)}")


def _round_planner(members: tuple[int, ...] | None, ep_size: int) -> tuple[Any, np.ndarray | None]:
    """(planner, live mask) of a round with ``members`` (its ACTIVE members at its start, as replayed): the
    coordinator's planner over them (:func:`fdeplb.rounds.members.live_planner`) and the mask its
    figures are over; (default planner, None) with every rank a member."""
    if members is None or len(members) == ep_size:
        return default_planner, None
    live = np.isin(np.arange(ep_size), members)
    return live_planner(default_planner, live), live


def _gate_over(recorded: dict[str, Any] | None, live: Any) -> Any:
    """The members a recorded gate's figures are over: ``live`` when its detail names them (``live_ranks``, from
    schema 3 on whenever some rank is not a member), else every rank (None: an older record)."""
    return live if recorded is not None and "live_ranks" in recorded else None


# ---- gated rounds --------------------------------------------------------------------------------------------------
def check_gates(report: ReplayReport) -> list[int]:
    """Recompute every gated round of ``report`` (an abort whose reason starts ``gated:``): replan its snapshot
    from the placement it started from with the cluster's policy and check that the gate skips it with exactly the
    recorded numbers: the abort's structured ``detail.gate`` figures (mean balancedness before and after, gain,
    moved experts, min_gain) compared exactly, and its text as :func:`fdeplb.rounds.reasons.gated` derives
    it (a schema 1 recording has the text only; from schema 2 on a gated abort without ``detail.gate`` fails). Rounds whose snapshot or starting placement the
    recording lacks are left out. The plan is made over the round's members (its ACTIVE members at its start, as
    replayed) and the figures are over them when the detail names them (``live_ranks``, schema 3), else over every
    rank (an older record). From schema 3 on a round the gate let through carries the figures in its ``load``
    record's ``detail.gate``: they are recomputed from its stored plan (over the plan's members) and compared
    exactly too, with the text of :func:`fdeplb.rounds.reasons.gate_passed`. A round planned from its load per
    source rank (:func:`fdeplb.rounds.gating.round_source`) is replanned from the split the recording holds, and
    its figures include the cross-node fractions. Returns the rounds checked
    (also in ``report.gates_checked``).

    Raises :class:`ReplayError` naming the abort's line when the numbers differ or the gate would have let the round
    through; :class:`InputError` for a recording without header.
    """
    source = Recorded(report)
    check_passed_gates(report, configs(report))  # the header's min_gain first: a round it skips went on
    placements = _placements(report, source)
    for seen in report.rounds:
        if seen.end is not RoundOutcome.SKIPPED:  # an abort whose reason is the gate's
            continue
        load, old = report.snapshots.get(seen.round), placements.get(seen.placement_plan)
        if load is None or old is None:
            continue
        cfg = source.config_at(seen.round)  # min_gain and policy as `fdeplb config set` left them for this round
        try:
            recorded = reasons.gate_figures(seen.last or {})
        except ValueError as exc:
            raise ReplayError(f"{seen.where}: detail is not a gated abort's: {exc}") from None
        planner, live = _round_planner(seen.members, cfg.ep_size)
        split = round_source(cfg, report.source_loads.get(seen.round), live)  # as the coordinator planned it
        decision = plan_round(load, old, cfg, planner, _gate_over(recorded, live), split)
        before, after, moved = decision.balancedness_before, decision.balancedness_after, decision.moved_experts
        expected = reasons.gated(decision)
        if expected is None:
            raise ReplayError(f"{seen.where}: round {seen.round} was gated, but its {cfg.policy!r} plan goes from "
                              f"balancedness {before:.4f} to {after:.4f} moving {moved} experts: a gain above "
                              f"min_gain {cfg.min_gain}, which the gate lets through")
        if recorded is None and int(report.header.get("schema", 1)) >= 2:  # the figures are the detail's
            raise ReplayError(f"{seen.where}: gated round {seen.round} without its gate's figures (detail.gate); a "
                              f"schema {report.header['schema']} recording carries them")
        if recorded is not None and recorded != expected.detail["gate"]:
            raise ReplayError(f"{seen.where}: gated round {seen.round} records the gate's figures {recorded}; "
                              f"recomputing its {cfg.policy!r} plan gives {expected.detail['gate']}")
        if expected.text != seen.reason:
            raise ReplayError(f"{seen.where}: gated round {seen.round} says {seen.reason!r}; recomputing its "
                              f"{cfg.policy!r} plan gives {expected.text!r}")
        report.gates_checked.append(seen.round)
    _check_passed_gates(report, source)
    return list(report.gates_checked)


def _check_passed_gates(report: ReplayReport, source: Recorded) -> None:
    """The gate's figures a ``load`` record carries (a round the gate let through), recomputed from its stored plan
    over the plan's members (see :func:`check_gates`); a plan the recording lacks (pruned), or one made from a split
    it lacks, is left out."""

    for loaded in report.plans:
        try:
            recorded = reasons.gate_figures(loaded.record or {})
        except ValueError as exc:
            raise ReplayError(f"{loaded.where}: detail is not a load's: {exc}") from None
        plan = report.stored_plans.get(loaded.plan_id)
        split = None if plan is None else _plan_source(plan.topology, report.source_loads.get(loaded.round),
                                                       loaded.where, loaded.round in report.snapshots)
        if recorded is None or plan is None or split is _NOT_HELD:
            continue
        cfg = source.config_at(loaded.round)
        decision = decide(plan.expert_load, plan.old_phy2log, plan.new_phy2log, cfg,
                          _gate_over(recorded, plan.live_ranks(cfg.ep_size)), split)
        expected = reasons.gate_passed(decision)
        if not decision.goes_on or recorded != expected.detail["gate"]:
            raise ReplayError(f"{loaded.where}: round {loaded.round} went on with the gate's figures {recorded}; "
                              f"recomputing its plan {loaded.plan_id} gives {expected.detail['gate']}"
                              f"{'' if decision.goes_on else ', which the gate skips'}")
        if (loaded.record or {}).get("reason", "") != expected.text:
            raise ReplayError(f"{loaded.where}: round {loaded.round}'s load says "
                              f"{(loaded.record or {}).get('reason', '')!r}; its figures give {expected.text!r}")
        report.gates_checked.append(loaded.round)


def _placements(report: ReplayReport, source: Recorded) -> dict[str, np.ndarray]:
    """plan_id -> phy2log of every placement the recording holds: its start placement and every plan's new one."""
    placements: dict[str, np.ndarray] = {}
    start = source.start_placement()
    if start is not None:
        placements[start[0]] = start[1]
    for p in report.stored_plans.values():
        placements.setdefault(p.plan_id, p.new_phy2log)
    return placements


# ---- what-if -------------------------------------------------------------------------------------------------------
def whatif(report: ReplayReport, policy: str) -> list[dict[str, Any]]:
    """Replan every recorded round that has a snapshot with ``policy`` (a name of
    :data:`fdeplb.placement.POLICIES`), from the placement the round started from.

    Returns one dict per round: round, outcome, recorded plan_id, balancedness (mean over layers, over the round's
    members) of the placement before, of the recorded plan (the placement before when the round had none) and of
    the new policy's plan, and moved experts of both. :class:`InputError` for an unknown policy or a recording
    without header.
    """
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    source = Recorded(report)
    cfg = replace(source.config, policy=policy)
    placements = _placements(report, source)
    rows = []
    for seen in report.rounds:
        load = report.snapshots.get(seen.round)
        plan = report.stored_plans.get(seen.plan_id) if seen.plan_id else None
        old = plan.old_phy2log if plan is not None else placements.get(seen.placement_plan)
        if load is None or old is None:
            continue
        planner, live = _round_planner(seen.members, cfg.ep_size)  # over the round's members, as it ran
        recorded = decide(load, old, plan.new_phy2log if plan is not None else old, cfg, live)
        new = plan_round(load, old, cfg, planner, live, round_source(cfg, report.source_loads.get(seen.round), live))
        rows.append({
            "round": seen.round, "outcome": seen.outcome, "recorded_plan": seen.plan_id,
            "recorded_policy": plan.policy if plan is not None else source.config.policy, "policy": policy,
            "balancedness_before": new.balancedness_before, "balancedness_recorded": recorded.balancedness_after,
            "balancedness_new": new.balancedness_after,
            "moved_recorded": recorded.moved_experts, "moved_new": new.moved_experts,
        })
    return rows
