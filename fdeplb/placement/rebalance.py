"""``rebalance_experts``: the one entry point of every placement policy."""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np

from fdeplb.errors import InputError, RedundancyError
from fdeplb.placement._validate import check_expert_load, check_int, check_phy2log, check_source_load, \
    check_topology
from fdeplb.placement.core import Placement, derive_maps, replica_rank
from fdeplb.placement.balanced import balanced_phy2log
from fdeplb.placement.deepseek import deepseek_placement
from fdeplb.placement.greedy import greedy_phy2log
from fdeplb.placement.live_ranks import check_live_ranks, live_slots, replace_orphans
from fdeplb.placement.metrics import moved_experts
from fdeplb.placement.move_aware import move_aware_phy2log
from fdeplb.placement.slots import align_slots
from fdeplb.placement.topology import topology_aware_phy2log


#: the largest per-layer load that is no load: float32's smallest normal (2**-126). DeepSeek's EPLB computes in
#: float32, which flushes smaller loads (1e-300) to zero, and a layer without load has nothing to balance: any plan
#: of it gains nothing, and the tie order alone decided which experts it moved (:func:`keep_unloaded`)
NO_LOAD = float(np.finfo(np.float32).tiny)
#: the default ``tolerance`` of "move_aware" and "topology_aware" (max/mean GPU load units): the balance a plan may
#: give up for fewer moved experts or fewer cross-node tokens; the gain gate lets a "topology_aware" round give up
#: this much balancedness for fewer cross-node tokens (:attr:`fdeplb.rounds.gating.GateDecision.goes_on`)
TOLERANCE = 0.0005


def keep_unloaded(load: np.ndarray, planned: np.ndarray, base: np.ndarray, rank: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """The one rule for a layer without load (every expert's load below :data:`NO_LOAD`, all-zero included): it
    keeps ``base`` (the old placement, or the trivial one), whatever the policy planned: nothing moves for no gain.

    ``load`` [L, E], ``planned`` / ``base`` int64 [L, P]; ``rank`` (a policy's replica ranks, int64 [L, P], or
    None) gets phy_id order on the kept layers. Returns (phy2log, rank), new arrays when a layer is kept."""
    idle = load.max(axis=1) < NO_LOAD
    if not idle.any():
        return planned, rank
    planned = planned.copy()
    planned[idle] = base[idle]
    if rank is not None:
        rank = rank.copy()
        rank[idle] = replica_rank(derive_maps(base[idle], load.shape[1])[0], base.shape[1])
    return planned, rank


def _deepseek(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, **_):
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    phy2log, phyrank, _ = deepseek_placement(load, num_replicas, num_groups, num_nodes, num_gpus)
    return phy2log, phyrank


def _greedy(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, **_):
    phy2log = greedy_phy2log(load, num_replicas, num_gpus)
    return phy2log if old is None else align_slots(old, phy2log, num_gpus)


def _balanced(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, **_):
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    phy2log = balanced_phy2log(load, num_replicas, num_groups, num_nodes, num_gpus)
    return phy2log if old is None else align_slots(old, phy2log, num_gpus)


def _move_aware(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, *, tolerance=TOLERANCE,
                max_moved_experts=None):
    if old is None:
        raise InputError("policy 'move_aware' needs old_phy2log (the current placement)")
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    # a layer without load keeps its placement whatever is planned (keep_unloaded): planned as all-zero, it is
    # within any tolerance at once, spends none of a move cap, and its sub-normal loads cost the repair no time
    load = np.where((load.max(axis=1) < NO_LOAD)[:, None], 0, load)
    return move_aware_phy2log(load, old, num_replicas, num_groups, num_nodes, num_gpus, tolerance=tolerance,
                              max_moved_experts=max_moved_experts)


def _topology_aware(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, *, tolerance=TOLERANCE,
                    source=None):
    if source is None or num_nodes == 1:  # nothing to keep on a node: "balanced"'s plan
        return _balanced(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old)
    phy2log = topology_aware_phy2log(source, num_replicas, num_nodes, num_gpus, tolerance)
    return phy2log if old is None else align_slots(old, phy2log, num_gpus)


#: policy name -> function(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, **options)
#: returning phy2log int64 [L, P], or ``(phy2log, replica_rank)`` when the policy orders each expert's slots itself
#: in log2phy (see :meth:`Placement.from_phy2log`).
POLICIES: dict[str, Callable[..., np.ndarray]] = {
    "deepseek": _deepseek,
    "greedy": _greedy,
    "balanced": _balanced,
    "move_aware": _move_aware,
    "topology_aware": _topology_aware,
}
#: policies that reproduce another project's output exactly (DeepSeek's eplb.py, TensorRT-LLM's greedy), layers
#: without load included: :func:`keep_unloaded` does not apply to them (the gain gate judges their plans)
REFERENCE_POLICIES = frozenset({"deepseek", "greedy"})


def _ndim(value: object) -> int:
    """Dimensions of an array-like; 2 when it is not rectangular (check_expert_load then says what is wrong)."""
    try:
        return int(np.ndim(value))
    except (TypeError, ValueError):
        return 2


def rebalance_experts(
    expert_load: object,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    policy: str = "deepseek",
    old_phy2log: object = None,
    tolerance: float = TOLERANCE,
    max_moved_experts: int | None = None,
    live_ranks: object = None,
) -> Placement:
    """Compute a placement of ``num_replicas`` slots per layer for the given expert loads.

    Args:
        expert_load: [num_layers, num_logical_experts] int or float, non-negative, finite: tokens routed to every
            logical expert (token x top-k assignments) over the recording window. Or per source rank,
            [num_layers, num_gpus, num_logical_experts]: the tokens every EP rank routed to every expert; every
            policy plans on its sum over source ranks, "topology_aware" also uses the split.
        num_replicas: P, slots per layer (= num_physical_experts), a multiple of ``num_gpus`` and >= E.
        num_groups: expert groups (contiguous logical experts; DeepSeek-V3: 8). The hierarchical policy (groups
            packed onto nodes, replicas kept inside their group's node) applies when ``num_groups % num_nodes == 0``;
            otherwise the global policy (one group, one node) does, as in DeepSeek's EPLB.
        num_nodes: server nodes; GPUs of a node are contiguous EP ranks.
        num_gpus: EP size, a multiple of ``num_nodes``.
        policy: one of :data:`POLICIES`:
            "deepseek": DeepSeek's EPLB (github.com/deepseek-ai/EPLB): phy2log, log2phy (replica-rank order) and
            logcnt identical to ``eplb.py`` on torch CPU, ties included;
            "greedy": TensorRT-LLM's flat replication + placement (groups and nodes ignored by the plan, though the
            topology is still checked as for "deepseek");
            "balanced": "deepseek" improved by an exchange local search (1-1, then 2-2 swaps) inside nodes,
            never worse on any layer (see :mod:`fdeplb.placement.balanced`);
            "move_aware": needs ``old_phy2log``; moves as few experts as it can while the mean over layers of
            its max/mean GPU load stays within ``tolerance`` of its reference's (global: a lower bound on any
            plan's, hierarchical: the same at "balanced"'s node packing, with a move cap "balanced" with 1-1 swaps
            only; :func:`fdeplb.placement.move_aware.reference_peak`),
            and no layer exceeds it by more
            than twice that (with ``max_moved_experts``: see below); a layer
            already within it (all-zero loads included) keeps its placement, unless hierarchical mode must first
            put its groups on whole nodes. See :mod:`fdeplb.placement.move_aware`.
            "topology_aware": with a per-source-rank ``expert_load`` and ``num_nodes`` > 1, "balanced"'s global plan
            with replicas swapped across nodes so that fewer tokens leave their source rank's node, every layer
            within ``tolerance`` of "balanced"'s max/mean (groups ignored; see :mod:`fdeplb.placement.topology`);
            otherwise "balanced"'s plan. With ``live_ranks`` it plans on the summed load.
            "balanced", "move_aware" and "topology_aware" keep the old placement (the trivial one without ``old_phy2log``) of a
            layer without load (:func:`keep_unloaded`): nothing moves for no gain; "deepseek" and "greedy"
            (:data:`REFERENCE_POLICIES`) give their reference's output there (DeepSeek's float32 arithmetic plans
            loads below 2**-126 as all-zero, in tie order), which the gain gate then judges.
        old_phy2log: int [L, P] current placement (or a :class:`Placement`). "deepseek" ignores it; "greedy" and
            "balanced" use it only to keep experts that stay on their GPU in their old slot.
        tolerance: "move_aware": allowed excess of max/mean GPU load over its reference (>= 0, default 0.0005):
            of the mean over layers, each layer at most twice it; with ``max_moved_experts``, global mode: one
            target of the ladder the budget chooses from (a large budget may go below it), hierarchical mode: the
            per-layer aim.
            "topology_aware": the balance slack every layer may spend on keeping tokens on their node.
        max_moved_experts: "move_aware" only: cap on moved experts (sum over layers): the best balance the cap
            buys (global mode: a larger cap never gives a worse mean max/mean); the plan may stay above the
            tolerance once the cap is reached. Always
            ``moved_experts(old_phy2log, result) <= max_moved_experts``; 0 returns the old placement (one that
            spreads a group over nodes in hierarchical mode needs moves: see Raises). In
            hierarchical mode (num_nodes > 1 and num_groups % num_nodes == 0) moving groups to another node is
            charged to the cap too: when the cap cannot pay for "balanced"'s node packing, the old group-to-node
            map is kept and only moves inside nodes are made.
        live_ranks: which EP ranks serve (bool [num_gpus] or a list of ep_rank ints; default None: all). With some
            rank not live, the policy plans on the live ranks' slots only (see :mod:`fdeplb.placement.live_ranks`):
            experts orphaned in ``old_phy2log`` first take a redundant live slot (:func:`replace_orphans`), then
            the policy runs over the live GPUs (hierarchically when every node keeps the same number of live
            GPUs, else the global policy) and its result fills the live slots; slots of the other ranks keep
            their old entries (the initial placement's without ``old_phy2log``) and are never routed to. log2phy
            is then in phy_id order. With ``max_moved_experts`` the orphans' re-placement is charged to the cap
            (a cap below it raises InputError).

    Returns:
        A :class:`Placement` (phy2log int64 [L, P], log2phy, logcnt) tagged with the policy and topology.

    Raises:
        InputError: bad ``expert_load`` (ndim, dtype, NaN/inf, negative; per source rank: not num_gpus source
            ranks), bad ``old_phy2log``, unknown policy,
            "move_aware" without ``old_phy2log``, negative ``tolerance`` or ``max_moved_experts``, or (hierarchical)
            a ``max_moved_experts`` below the moves needed to put every group on one node when ``old_phy2log``
            spreads a group over several nodes.
        TopologyError: a topology that cannot hold the placement (see :func:`check_topology`).
        RedundancyError: (a TopologyError) with ``live_ranks``, some logical expert cannot get a live slot.
    """
    source = check_source_load(expert_load) if _ndim(expert_load) == 3 else None
    load = check_expert_load(expert_load if source is None else source.sum(axis=1))
    L, E = load.shape
    num_replicas, num_groups, num_nodes, num_gpus, hierarchical = check_topology(
        E, num_replicas, num_groups, num_nodes, num_gpus
    )
    if source is not None and source.shape[1] != num_gpus:
        raise InputError(f"expert_load must be 2-D [num_layers, num_logical_experts] or, per source rank, 3-D "
                         f"[num_layers, num_gpus, num_logical_experts]: got {source.shape[1]} source ranks for "
                         f"num_gpus {num_gpus}")
    fn = POLICIES.get(policy) if isinstance(policy, str) else None
    if fn is None:
        raise InputError(f"unknown placement policy {policy!r}; choose one of {sorted(POLICIES)}")
    old = None
    if old_phy2log is not None:
        raw = old_phy2log.phy2log if isinstance(old_phy2log, Placement) else old_phy2log
        old = check_phy2log(raw, E, name="old_phy2log", shape=(L, num_replicas))
    options = {}
    if policy in ("move_aware", "topology_aware"):
        tol = float(tolerance) if isinstance(tolerance, numbers.Real) and not isinstance(tolerance, bool) else -1.0
        if not tol >= 0 or not np.isfinite(tol):
            raise InputError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        options = {"tolerance": tol}
    if policy == "move_aware":
        cap = None if max_moved_experts is None else check_int(max_moved_experts, "max_moved_experts", minimum=0)
        options["max_moved_experts"] = cap
    live = check_live_ranks(live_ranks, num_gpus)
    if not live.all():
        phy2log = _plan_live(fn, load, num_replicas, num_groups, num_nodes, num_gpus, old, live, options,
                             keep=policy not in REFERENCE_POLICIES)
        return Placement.from_phy2log(phy2log, E, policy=policy, num_groups=num_groups, num_nodes=num_nodes,
                                      num_gpus=num_gpus)
    if policy == "topology_aware":
        options["source"] = source
    phy2log = fn(load, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, old, **options)
    rank = None
    if isinstance(phy2log, tuple):
        phy2log, rank = phy2log
    if policy not in REFERENCE_POLICIES:
        base = np.tile(np.arange(num_replicas, dtype=np.int64) % E, (L, 1)) if old is None else old
        phy2log, rank = keep_unloaded(load, np.asarray(phy2log, dtype=np.int64), base, rank)
    return Placement.from_phy2log(
        phy2log, E, policy=policy, num_groups=num_groups, num_nodes=num_nodes, num_gpus=num_gpus, replica_rank=rank
    )


def _plan_live(fn, load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
               old: np.ndarray | None, live: np.ndarray, options: dict, keep: bool) -> np.ndarray:
    """phy2log int64 [L, P] planned by ``fn`` over the live ranks' slots only (see ``live_ranks`` above);
    ``keep``: layers without load keep their base (:func:`keep_unloaded`)."""
    L, E = load.shape
    slots = live_slots(num_replicas, num_gpus, live)
    n_live = int(live.sum())
    p_live = int(slots.sum())
    if p_live < E:
        raise RedundancyError(f"redundancy insufficient: the {n_live} live ranks hold {p_live} slots per layer, "
                              f"fewer than the {E} logical experts", [(l, e) for l in range(L) for e in range(E)])
    base = (np.tile(np.arange(num_replicas, dtype=np.int64) % E, (L, 1)) if old is None
            else replace_orphans(old, E, num_gpus, live, load))
    per_node = live.reshape(num_nodes, -1).sum(axis=1)
    groups, nodes = (num_groups, num_nodes) if (per_node == per_node[0]).all() else (1, 1)
    p_live, groups, nodes, n_live, hierarchical = check_topology(E, p_live, groups, nodes, n_live)
    cap = options.get("max_moved_experts")
    if cap is not None and old is not None:  # the orphans' re-placement is charged to the cap
        lost = moved_experts(old, base, num_gpus)
        if lost > cap:
            raise InputError(f"max_moved_experts={cap} cannot be met: giving the experts of the ranks not live a "
                             f"live slot moves {lost} experts")
        options = {**options, "max_moved_experts": cap - lost}
    try:
        planned = fn(load, p_live, groups, nodes, n_live, hierarchical, None if old is None else base[:, slots],
                     **options)
    except InputError as exc:
        if cap is None or old is None:
            raise
        raise InputError(f"max_moved_experts={cap}: {lost} of it give the experts of the ranks not live a live "
                         f"slot, and with the rest {exc}") from None
    if isinstance(planned, tuple):
        planned = planned[0]
    new = base.copy()
    new[:, slots] = planned
    return keep_unloaded(load, new, base)[0] if keep else new
