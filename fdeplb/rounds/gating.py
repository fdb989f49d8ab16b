"""Gating: whether a planned round is worth running. The one rule, used by the coordinator (its periodic trigger
and PLANNING) and by the replay (plan, gate and what-if checks), so the live cluster and a recording's check
cannot disagree.

A round goes on when its plan moves at least one expert **and** gains more than the cluster's ``min_gain`` in mean
balancedness (``after - before``, balancedness as :func:`fdeplb.placement.balancedness`: per layer mean GPU load /
max GPU load, averaged over layers, over the round's members: the ranks the plan is routed over). Otherwise it is
*skipped*: a normal, audited outcome with its numbers, not a failure. This is the gain gate of SGLang's
``eplb_min_rebalancing_utilization_threshold`` turned into a planned comparison: the plan is computed first, so
the gate judges the placement the round would actually commit.

A policy that plans from the load per source rank (:data:`SOURCE_POLICIES`) is given the round's snapshot split
per source rank when the round has one and plans over every rank (:func:`round_source`); the gate's figures then
also name the share of tokens that leave their source rank's node before and after
(:func:`fdeplb.placement.cross_node_fraction`, mean over layers), and such a round also goes on when it lowers that
share by more than ``min_gain`` while giving up at most :data:`fdeplb.placement.TOLERANCE` of balancedness
(:attr:`GateDecision.for_locality`).

Pure numpy, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fdeplb.placement import TOLERANCE, balancedness, check_live_ranks, check_phy2log, cross_node_fraction, \
    load_digest, moved_experts, rebalance_experts
from fdeplb.store import ClusterConfig

__all__ = ["ROUND_FACTS", "SOURCE_POLICIES", "GateDecision", "Planner", "configured_topology", "cross_node_figures",
           "decide", "default_planner", "keeps_source_load", "mean_balancedness", "plan_round", "round_source",
           "source_fact", "split_of"]

#: what a stored plan's topology (hashed into its plan_id) holds of its round beside the configuration's topology:
#: the round's members when some rank is not one, a re-route (the members only shrank), a supplied placement, the
#: digest of the load per source rank it was planned from (:func:`source_fact`)
ROUND_FACTS = ("live_ranks", "reroute", "supplied", "source_load")
#: policies that plan from the load per source rank ([L, ep_size, E]) rather than its sum
SOURCE_POLICIES = frozenset({"topology_aware"})


def keeps_source_load(cfg: ClusterConfig) -> bool:
    """Whether a round of ``cfg`` keeps its snapshot per source rank: its policy plans from the split
    (:data:`SOURCE_POLICIES`) and it has several nodes (on one node no token crosses one)."""
    return cfg.policy in SOURCE_POLICIES and cfg.num_nodes > 1


def split_of(windows: list[tuple[int, np.ndarray]], cfg: ClusterConfig) -> np.ndarray | None:
    """The counted ranks' ``windows`` ((ep_rank, int64 [L, E]) each) unsummed, int64 [L, ep_size, E], when a round
    of ``cfg`` keeps them (:func:`keeps_source_load`); None otherwise. A rank not counted (not a member) has a zero
    row: its tokens did come from it, but its window is not in the round's sum either, so the split always sums
    over ranks to the round's snapshot."""
    if not keeps_source_load(cfg) or not windows:
        return None
    L, E = windows[0][1].shape
    split = np.zeros((L, cfg.ep_size, E), dtype=np.int64)
    for r, load in windows:
        split[:, r] = load
    return split


def round_source(cfg: ClusterConfig, source_load: np.ndarray | None, live_ranks: object = None
                 ) -> np.ndarray | None:
    """The one rule of what a round plans from besides its snapshot: ``source_load`` (its snapshot per source rank,
    int64 [L, ep_size, E], or None) when the round keeps it (:func:`keeps_source_load`) and every rank is a member
    (``live_ranks`` None or all; over some ranks only the policy plans on the summed load, as
    :func:`fdeplb.placement.rebalance_experts` does); else None."""
    if source_load is None or not keeps_source_load(cfg) or not check_live_ranks(live_ranks, cfg.ep_size).all():
        return None
    return source_load


def source_fact(source_load: np.ndarray | None) -> dict[str, str]:
    """The topology fact of a plan made from ``source_load`` (int64 [L, ep_size, E]): ``{"source_load": digest}``
    (:func:`fdeplb.placement.load_digest`, 16 hex digits), so that the plan_id names the split too; {} for None."""
    return {} if source_load is None else {"source_load": load_digest(np.asarray(source_load, np.int64))[:16]}


def configured_topology(topology: dict) -> dict:
    """A stored plan's ``topology`` without its round's facts (:data:`ROUND_FACTS`): what it must share with the
    configuration it was planned under (``ClusterConfig.topology()``)."""
    return {k: v for k, v in topology.items() if k not in ROUND_FACTS}

#: (expert_load int64 [L, E] or, from :func:`round_source`, per source rank [L, ep_size, E], old phy2log int64
#: [L, P], config) -> new phy2log int64 [L, P]
Planner = Callable[[np.ndarray, np.ndarray, ClusterConfig], np.ndarray]


def default_planner(expert_load: np.ndarray, old_phy2log: np.ndarray, cfg: ClusterConfig,
                    live_ranks: object = None) -> np.ndarray:
    """The cluster's policy applied by :func:`fdeplb.placement.rebalance_experts` to the round's snapshot
    (int64 [L, E], or per source rank [L, ep_size, E]) and the current placement (int64 [L, P]); returns the new phy2log, int64 [L, P].
    ``live_ranks``: the ACTIVE members (None: every rank), planned on their slots only.

    Raises :class:`~fdeplb.errors.InputError` / :class:`~fdeplb.errors.TopologyError` for a load or topology the
    policy cannot place."""
    placement = rebalance_experts(expert_load, cfg.num_physical_experts, cfg.num_groups, cfg.num_nodes,
                                  cfg.ep_size, policy=cfg.policy, old_phy2log=old_phy2log, live_ranks=live_ranks)
    return placement.phy2log


def mean_balancedness(expert_load: np.ndarray, phy2log: np.ndarray, ep_size: int,
                      live_ranks: object = None) -> float:
    """Mean over layers of :func:`fdeplb.placement.balancedness` (``expert_load`` [L, E], ``phy2log`` int64
    [L, P]) over ``live_ranks``, the members the placement is routed over (a placement's
    ``PlacementEntry.live_ranks``, a plan's ``PlanEntry.live_ranks``; None: every rank): the one figure the gate,
    ``status``, ``/metrics``, ``/ui`` and the replay compare. A float in (0, 1]. InputError for bad input."""
    return float(np.mean(balancedness(expert_load, phy2log, ep_size, live_ranks)))


def _members_of(live_ranks: object, ep_size: int) -> tuple[int, ...] | None:
    """``live_ranks`` (see :func:`mean_balancedness`) as the ep_ranks in order; None when every rank is one."""
    live = check_live_ranks(live_ranks, ep_size)
    return None if live.all() else tuple(np.flatnonzero(live).tolist())


@dataclass(frozen=True)
class GateDecision:
    """A planned round and the gate's verdict on it.

    ``new_phy2log``: int64 [L, P], the plan; ``balancedness_before`` / ``balancedness_after``: mean balancedness of
    the current placement and of the plan on the round's load; ``moved_experts``: experts the plan puts on a GPU
    that did not hold them (:func:`fdeplb.placement.moved_experts`); ``min_gain``: the cluster's threshold;
    ``live_ranks``: the members both figures are over (None: every rank); ``cross_node_before`` /
    ``cross_node_after``: mean over layers of the share of tokens that leave their source rank's node, of both
    placements, when the round planned from its load per source rank (None otherwise).
    """

    new_phy2log: np.ndarray
    balancedness_before: float
    balancedness_after: float
    moved_experts: int
    min_gain: float
    live_ranks: tuple[int, ...] | None = None
    cross_node_before: float | None = None
    cross_node_after: float | None = None

    @property
    def gain(self) -> float:
        return self.balancedness_after - self.balancedness_before

    @property
    def cross_node_gain(self) -> float | None:
        """How much lower the cross-node fraction of the plan is than the current placement's (None without the
        round's load per source rank)."""
        if self.cross_node_before is None or self.cross_node_after is None:
            return None
        return self.cross_node_before - self.cross_node_after

    @property
    def for_locality(self) -> bool:
        """The plan goes on for locality: it lowers the cross-node fraction by more than ``min_gain`` and gives up
        at most :data:`fdeplb.placement.TOLERANCE` of balancedness ("topology_aware"'s slack)."""
        cross = self.cross_node_gain
        return cross is not None and cross > self.min_gain and self.gain >= -TOLERANCE

    @property
    def goes_on(self) -> bool:
        """The rule: the plan moves an expert, and gains more than ``min_gain`` of balancedness or goes on for
        locality (:attr:`for_locality`: only a round planned from its load per source rank)."""
        return self.moved_experts != 0 and (self.gain > self.min_gain or self.for_locality)

    @property
    def why_skipped(self) -> str | None:
        """None when the round goes on; else why not, with the numbers (4 decimals)."""
        if self.goes_on:
            return None
        if self.gain > self.min_gain or self.for_locality:
            return "the plan moves no expert"
        why = f"planned gain {self.gain:.4f} <= min_gain {self.min_gain}"
        cross = self.cross_node_gain
        if cross is None:
            return why
        if cross <= 0:
            return f"{why}, cross-node fraction not lower ({self.cross_node_before:.4f} -> {self.cross_node_after:.4f})"
        if cross <= self.min_gain:
            return f"{why}, cross-node fraction lower by {cross:.4f} <= min_gain"
        return f"{why}, balancedness given up {-self.gain:.4f} > {TOLERANCE} for cross-node fraction lower by {cross:.4f}"

    def detail(self) -> dict[str, Any]:
        """The gate's figures as JSON-able values (the structured detail an audit record carries), with
        ``live_ranks`` when some rank is not a member and the cross-node fractions when the round has them."""
        members = {} if self.live_ranks is None else {"live_ranks": list(self.live_ranks)}
        cross = {} if self.cross_node_before is None else {"cross_node_fraction_before": self.cross_node_before,
                                                           "cross_node_fraction_after": self.cross_node_after}
        return {"balancedness_before": self.balancedness_before, "balancedness_after": self.balancedness_after,
                "gain": self.gain, "min_gain": self.min_gain, "moved_experts": self.moved_experts, **members,
                **cross}


def cross_node_figures(source_load: np.ndarray, old_phy2log: object, new_phy2log: object, ep_size: int,
                       num_nodes: int) -> dict[str, float]:
    """``{"cross_node_before", "cross_node_after"}``: the mean over layers of
    :func:`fdeplb.placement.cross_node_fraction` of ``source_load`` ([L, ep_size, E]) under the current placement
    and the plan (phy2log int [L, P] or :class:`~fdeplb.placement.Placement`), as :class:`GateDecision` takes them."""
    return {f"cross_node_{when}": float(np.mean(cross_node_fraction(source_load, p2l, ep_size, num_nodes)))
            for when, p2l in (("before", old_phy2log), ("after", new_phy2log))}


def decide(expert_load: np.ndarray, old_phy2log: np.ndarray, new_phy2log: np.ndarray,
           cfg: ClusterConfig, live_ranks: object = None, source_load: np.ndarray | None = None) -> GateDecision:
    """The gate on an already planned ``new_phy2log`` (int64 [L, P]) for ``expert_load`` [L, E] from
    ``old_phy2log`` (int64 [L, P]), with ``cfg.min_gain``, both figures over ``live_ranks`` (the round's members,
    see :func:`mean_balancedness`); with ``source_load`` (the round's :func:`round_source`, [L, ep_size, E]) the
    cross-node fractions too. No error for well-formed arrays and members."""
    members = _members_of(live_ranks, cfg.ep_size)
    cross = {} if source_load is None else cross_node_figures(source_load, old_phy2log, new_phy2log, cfg.ep_size,
                                                              cfg.num_nodes)
    return GateDecision(new_phy2log=new_phy2log,
                        balancedness_before=mean_balancedness(expert_load, old_phy2log, cfg.ep_size, members),
                        balancedness_after=mean_balancedness(expert_load, new_phy2log, cfg.ep_size, members),
                        moved_experts=int(moved_experts(old_phy2log, new_phy2log, cfg.ep_size)),
                        min_gain=cfg.min_gain, live_ranks=members, **cross)


def plan_round(expert_load: np.ndarray, old_phy2log: np.ndarray, cfg: ClusterConfig,
               planner: Planner = default_planner, live_ranks: object = None,
               source_load: np.ndarray | None = None) -> GateDecision:
    """Plan ``expert_load`` (int64 [L, E]) from ``old_phy2log`` (int64 [L, P]) with ``planner`` and gate the plan
    over ``live_ranks`` (:func:`decide`; the planner must plan over them: ``fdeplb.rounds.members.live_planner``).
    With ``source_load`` (the round's :func:`round_source`, int64 [L, ep_size, E] summing to ``expert_load``) the
    planner is given that instead and the gate's figures include the cross-node fractions.

    The planner's output is checked (:func:`fdeplb.placement.check_phy2log`: shape [L, P], every logical expert
    present): a planner bug is an :class:`~fdeplb.errors.InputError`, never a committed malformed placement.
    Raises what ``planner`` raises (an :class:`~fdeplb.errors.FdeplbError` for a load or topology it refuses)."""
    planned = planner(expert_load if source_load is None else source_load, old_phy2log, cfg)
    new = check_phy2log(planned, cfg.num_logical_experts, name="planned phy2log", shape=old_phy2log.shape)
    return decide(expert_load, old_phy2log, np.asarray(new, dtype=np.int64), cfg, live_ranks, source_load)
