"""The "move_aware" policy: move as few experts as it can while staying within a tolerance of a reference plan.

What it optimises: the number of moved experts (a replica on a GPU that did not hold it before, the unit of weight
traffic; :func:`fdeplb.placement.moved_experts`), subject to a bound on the GPU-load max/mean excess over a
reference heaviest GPU (``tolerance``, absolute max/mean units), :func:`reference_peak`: in global mode a lower
bound on any plan's heaviest GPU (the mean, or the largest per-replica load at the best replica counts), so that
"within tolerance of the reference" is never looser than "within tolerance of balanced" and no balanced plan is
computed on the hot path ("balanced" ends 2e-5 to 1.1e-4 above the bound on the DeepSeek-V3 drift pairs); in
hierarchical mode the same bound at the node packing and replica counts "balanced" starts from and keeps
(over the nodes, the node's load over its GPUs or its largest per-replica load; "balanced" ends 6e-5 above it on
average on the DeepSeek-V3 4-node pair). Below, "balanced" means this reference.

Without a move cap (the default):

- Guarantee: the mean over layers of (max/mean of the plan - max/mean of "balanced") is at most ``tolerance``, and
  no layer exceeds it by more than ``LAYER_CAP`` tolerances. A forward pass costs the sum over layers of each
  layer's heaviest GPU, so the mean is what a step pays; the per-layer bound keeps any one layer close.
- How: every (layer, node) row is repaired from the old placement by :func:`fdeplb.placement.repair.repair_rows`
  (swaps and replica-count changes, chosen by excess above the target ``balanced + tolerance`` removed per moved
  expert; in hierarchical mode a row no such action helps tries 2-2 swaps, which the 8-GPU node rows need to get
  near the bound), recording each row's trajectory; then :func:`fdeplb.placement.stops.choose_stops` stops every row at
  the point of its trajectory that minimises the total moved experts under the two bounds above (a layer that
  is cheap to balance goes below the tolerance so that an expensive one may stop above it).
- Layers the repair cannot bring within ``LAYER_CAP`` tolerances (and, when the mean bound cannot be met otherwise,
  the layers of largest excess until it is) are planned again, ending within one tolerance: in global mode first from
  bulk replica counts (:func:`fdeplb.placement.fill.fill_rows`) and the batched repair again (the repair adds one
  replica at a time and gets stuck when an expert needs several), then, for layers still out, by the per-layer
  repair below (then its fallback) against the "balanced" plan's heaviest GPU, computed for those layers only;
  in hierarchical mode directly by the fallback (step 3) against the "balanced" plan of those layers; both live in
  :mod:`fdeplb.placement.row_repair`. The stop choice counts a layer it cannot bring within the cap at one
  tolerance, so that the other layers do not pay for it.

With a move cap (``max_moved_experts``), the Pareto option: the best balance (mean over layers of max/mean) the
budget buys. Every layer takes its old placement or a point of the batched repair's trajectory toward one of a
ladder of targets (``tolerance`` and 0.00025 to 0.256 by factors of 2 above the reference: loose targets spend a
small budget on the heaviest GPUs, tight ones a large budget on precision), the choice being the exact least mean
excess within the cap over these budget-independent candidates (a multiple-choice knapsack:
:mod:`fdeplb.placement.pareto`), so a larger cap never does worse. In global mode a layer the tightest target
leaves above twice it also gets a trajectory from bulk replica counts, as without a cap. In hierarchical mode the
trajectories are those of the layer's node rows (:func:`fdeplb.placement.node_maps.node_rows`, as without a cap)
under each of its group-to-node maps (below), a point of the layer being every node row stopped at its
cheapest point under a level (:func:`fdeplb.placement.stops.block_candidates`); relocating the groups that change
node is part of every point's moved experts, so it is charged to the cap like any other move (DeepSeek-V3 4-node
drift pair, 10% of a fresh plan's moves: 1.3229 mean max/mean, 1.5253 by the per-layer repair it replaced). The
per-layer repair below serves only as the guard should that plan move more than the cap:

1. Target: the GPU-load max/mean that "balanced" reaches on the new loads, plus ``tolerance``.
2. Repair (from the old placement; experts stay in their slots unless moved): while the heaviest GPU is above the
   target, apply the action with the best gain per moved expert, gain capped at what the target needs:
   - *replace*: one slot gets another expert (a replica of an expert with >= 2 replicas is given to an expert that
     needs one), with the slot on the heaviest GPU or the new expert taken from it; costs one moved expert
     (zero when it restores an expert that was there in the old placement);
   - *swap*: a slot of the heaviest GPU trades experts with a slot of another GPU; costs up to two.
   An action is allowed only if it lowers the heaviest GPU and lifts no GPU to its level, so the loop ends.
3. Fallback when the repair gets stuck above the target (no cap only): the "balanced" plan (computed for those
   layers only in global mode) with its GPUs
   renumbered to match the old GPUs (``scipy.optimize.linear_sum_assignment`` on shared experts), then every slot
   that can go back to its old expert without leaving the target does so.

In hierarchical mode every layer has group-to-node maps to choose from: the old placement's (as it is when the old
placement keeps every group on one node; otherwise the packing with num_groups / num_nodes groups per node that
keeps the most old slots) and the node packing of the "balanced" plan, with nodes renumbered to match the old
placement. Without a cap a layer takes, among the maps whose heaviest node, spread over its GPUs, is within the
target, the one that relocates the fewest old slots (:func:`fdeplb.placement.node_maps.nearest_maps`, exhaustive
over the maps: 2,520 for 8 groups on 4 nodes; the old map when it is within the target; with more maps than that
search tries, the old map or else the balanced one); experts of groups that change node are placed first
(:func:`fdeplb.placement.fill.fill_rows`).
With a cap, the candidates of the old, the nearest and the balanced map enter the choice, and those of a fourth,
the old map with the one swap of two groups that lowers its heaviest node most
(:func:`fdeplb.placement.node_maps.swap_map`: on the DeepSeek-V3 4-node pair it brings the heaviest node nearly as low as the balanced map, 1.3117 against 1.3098 mean over
layers, where the balanced map relocates 2-4 of the 8 groups). Moves that no candidate avoids (an old placement that
spreads groups over nodes) must fit in the cap: a cap below them is an error. With the cap at 0 (and groups on
nodes) the old placement comes back unchanged. Deterministic: ties keep the first candidate in slot / expert
order.

Sources: spreading the tolerance over layers by a price per unit of excess is Everett's generalized Lagrange
multiplier method for allocating a resource ("Generalized Lagrange multiplier method for solving problems of
optimum allocation of resources", Operations Research 11(3), 1963); the repair's objective (total load above the
target instead of the heaviest GPU alone), its actions and move weighting, and the slot bookkeeping are fdeplb's.
The global reference is the classic makespan lower bound max(mean load, largest item) (R. L. Graham, "Bounds on
multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969) with the items at the replica counts that
minimise the largest one.
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement._validate import check_expert_load, check_topology
from fdeplb.placement.balanced import balanced_plan, balanced_start
from fdeplb.placement.deepseek import replicate_experts
from fdeplb.placement.fill import fill_rows, forced_copies
from fdeplb.placement.metrics import moved_experts, raw_gpu_loads
from fdeplb.placement.node_maps import (group_loads, nearest_maps, node_loads, node_of_groups, node_rows,
                                        old_group_slots, old_node_of_groups)
from fdeplb.placement.pareto import check_reserve, plan_nodes_within_budget, plan_within_budget
from fdeplb.placement.repair import repair_rows
from fdeplb.placement.row_repair import best_layer_plan, layer_candidates, plan_layer
from fdeplb.placement.slots import align_slots
from fdeplb.placement.stops import choose_stops, replay_stops

#: without a move cap one layer may exceed "balanced" by this many tolerances (the mean over layers by one)
LAYER_CAP = 2.0
#: the uncapped repair aims every row at "balanced" + this share of the tolerance (its trajectory then offers the
#: stop choice points below the tolerance as well; on the drift pairs 0.9 moved 0.05-0.2 points fewer than 1.0)
_REPAIR_SHARE = 0.9
#: "move_aware" re-assigns replicas (changes replica counts) while an expert's per-replica load exceeds this share
#: of the mean GPU load
_MAX_ITEM_SHARE = 0.3
#: a row whose experts need at least this many more replicas in all to bring every per-replica load under the
#: layer cap (``LAYER_CAP`` tolerances above "balanced": no stop above it is chosen while the layer can get under
#: it) gets its replica counts in bulk (:func:`fdeplb.placement.fill.fill_rows`) before the repair, which spends one
#: iteration per copy.
#: No row of the drift pairs of benchmarks/placement.py needs more than 3; under the zipf(1.5) loads of
#: benchmarks/control_plane.py (4 layers x 64 experts, 128 slots, 64 GPUs) every row needs 30-55.
_BULK_COPIES = 8
#: a layer the batched repair leaves above the cap is first planned again from bulk replica counts with no
#: per-replica load above this many times the largest one at DeepSeek's counts (a random lognormal(1) layer with
#: one expert at 0.997 x the mean GPU load on a single replica, 0.30 at the best counts: 78 moved experts at 1.5,
#: 85 at 1.0001, 235 for the fallback it needed before)
_STUCK_FILL = 1.5


def move_aware_phy2log(
    expert_load: np.ndarray,
    old_phy2log: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    tolerance: float = 0.0005,
    max_moved_experts: int | None = None,
) -> np.ndarray:
    """Move-aware plan on checked inputs (``num_groups``/``num_nodes`` = 1 for global); returns phy2log [L, P].

    A ``tolerance`` above ``num_gpus`` is taken as ``num_gpus``: no plan's max/mean exceeds it (one GPU carrying
    every token), so the two mean the same, and larger ones would overflow float64 on the way.

    Raises:
        InputError: in hierarchical mode, ``max_moved_experts`` below the moves needed to bring every group of an
            old placement that spreads groups over nodes onto one node.
    """
    tolerance = min(float(tolerance), float(num_gpus))
    lay = _Layers(expert_load, old_phy2log, num_replicas, num_groups, num_nodes, num_gpus, tolerance)
    if max_moved_experts is None:  # no cap: plan all (layer, node) rows at once, then spread the tolerance
        out, excess = _plan_all(lay.load, lay.old, lay.fresh_peak, lay.mean, tolerance, lay.old_maps, lay.group_node,
                                num_nodes, num_gpus)
        _replan_stuck(lay, out, excess, tolerance)
        return _align_where_needed(lay.old, out, num_gpus)
    within = _plan_within(lay, tolerance, max_moved_experts)  # the Pareto option: the budgeted choice
    return within if within is not None else _plan_capped(lay, max_moved_experts)


def reference_peak(expert_load: object, num_replicas: int, num_groups: int, num_nodes: int,
                   num_gpus: int) -> np.ndarray:
    """float64 [L] tokens: the heaviest-GPU load "move_aware"'s ``tolerance`` is measured against, never above the
    "balanced" plan's on the same loads (so "within tolerance of it" is never looser than "within tolerance of
    balanced").

    Global mode: a lower bound on any plan's heaviest GPU, the larger of the mean GPU load and the largest
    per-replica load at DeepSeek's replica counts (:func:`fdeplb.placement.deepseek.replicate_experts`, which
    minimise the largest per-replica load; every expert has a replica on some GPU). "balanced" ends within 1.1e-4
    of it (max/mean units) on the DeepSeek-V3 drift pairs. Hierarchical mode (``num_groups % num_nodes == 0``): the
    same bound at the node packing and replica counts "balanced" starts from and keeps
    (:func:`fdeplb.placement.balanced.balanced_start`; its swaps stay inside nodes), or at DeepSeek's where that is
    lower (a layer with a lighter node packing may end on DeepSeek's): over the nodes, the larger of the node's
    load over its GPUs and its largest per-replica load ("balanced" ends 6e-5 above it on average, 2.4e-4 at most, on the DeepSeek-V3 4-node drift
    pair of /work/exp/harness.py).

    Raises:
        InputError, TopologyError: as :func:`fdeplb.placement.rebalance_experts`.
    """
    load = check_expert_load(expert_load)
    P, groups, nodes, gpus, hierarchical = check_topology(load.shape[1], num_replicas, num_groups, num_nodes,
                                                          num_gpus)
    if hierarchical:
        return _start_peak_bound(load, P, groups, nodes, gpus)[1]
    return _peak_bound(np.asarray(load, dtype=np.float64), P, gpus)


def _start_peak_bound(expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Hierarchical mode: (the start of "balanced", int64 [L, P], and float64 [L] tokens: the bound of
    :func:`_node_peak_bound` at its node packing and replica counts, or at DeepSeek's where that is lower: a layer
    whose start took a lighter node packing may end on DeepSeek's (:func:`fdeplb.placement.balanced.balanced_plan`),
    and its reference must not exceed where it ends). ``expert_load`` [L, E] checked."""
    start, logcnt, deepseek, deepseek_logcnt = balanced_start(expert_load, num_replicas, num_groups, num_nodes,
                                                              num_gpus)
    load = np.asarray(expert_load, dtype=np.float64)
    bound = _node_peak_bound(load, start, logcnt, num_nodes, num_gpus)
    rows = np.flatnonzero((start != deepseek).any(axis=1))
    if rows.size:
        bound[rows] = np.minimum(bound[rows], _node_peak_bound(load[rows], deepseek[rows], deepseek_logcnt[rows],
                                                               num_nodes, num_gpus))
    return start, bound


def _peak_bound(load: np.ndarray, num_replicas: int, num_gpus: int) -> np.ndarray:
    """float64 [L] tokens: max(mean GPU load, largest per-replica load at DeepSeek's replica counts) of ``load``
    float64 [L, E] (see :func:`reference_peak`)."""
    logcnt = replicate_experts(load, num_replicas)[2]
    return np.maximum(load.sum(axis=1) / num_gpus, (load / logcnt).max(axis=1, initial=0.0))


def _node_peak_bound(load: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_nodes: int,
                     num_gpus: int) -> np.ndarray:
    """float64 [L] tokens: a lower bound on the heaviest GPU of any plan with the node packing and replica counts
    of ``phy2log`` int64 [L, P] / ``logcnt`` int64 [L, E] (a start of "balanced", which keeps them):
    over the nodes, the larger of the node's load over its GPUs and its largest per-replica load. ``load``
    float64 [L, E]."""
    L, P = phy2log.shape
    layers = np.arange(L)[:, None]
    node_of = np.zeros(load.shape, dtype=np.int64)
    node_of[layers, phy2log] = np.arange(P) // (P // num_nodes)  # every expert's replicas share one node
    node_load = np.zeros((L, num_nodes))
    np.add.at(node_load, (layers, node_of), load)
    return np.maximum(node_load.max(axis=1) / (num_gpus // num_nodes), (load / logcnt).max(axis=1, initial=0.0))


class _Layers:
    """What every path of the policy shares: the loads, the old placement, the "balanced" plan and its heaviest
    GPU, the per-layer targets (absolute load) and every layer's group-to-node maps."""

    def __init__(self, expert_load: np.ndarray, old_phy2log: np.ndarray, num_replicas: int, num_groups: int,
                 num_nodes: int, num_gpus: int, tolerance: float):
        self.load = load = np.asarray(expert_load, dtype=np.float64)
        self.old = old = np.asarray(old_phy2log, dtype=np.int64)
        L, E = load.shape
        P = num_replicas
        if num_nodes > 1:  # the start of "balanced": its node packing and replica counts (its search only swaps
            # inside nodes), and the bound at them; the balanced plan only for layers that need it
            self.fresh, fresh_peak = _start_peak_bound(expert_load, P, num_groups, num_nodes, num_gpus)
        else:  # global: the bound (no plan on the hot path); the plan only for layers that need the fallback
            self.fresh, fresh_peak = np.zeros((L, P), dtype=np.int64), _peak_bound(load, P, num_gpus)
        self._have = np.zeros(L, dtype=bool)
        self.num_groups = num_groups
        self.fresh_peak = fresh_peak
        self.num_nodes, self.num_gpus = num_nodes, num_gpus
        self.gpus_per_node = num_gpus // num_nodes
        self.S = P // num_gpus
        self.mean = load.sum(axis=1) / num_gpus
        self.tolerance = tolerance
        self.target = self._target(slice(None))
        self.group_size = group_size = E // num_groups
        # every layer's group-to-node maps: the old one (kept as is when the old placement keeps groups on nodes) and
        # the balanced plan's packing renumbered to match old
        if num_nodes > 1:
            self.group_node = node_of_groups(self.fresh, old, num_groups, num_nodes, group_size)
            self.old_maps = np.stack([old_node_of_groups(old[layer], num_groups, num_nodes, group_size)
                                      for layer in range(L)])
        else:
            self.group_node = self.old_maps = np.zeros((L, num_groups), dtype=np.int64)

    def prepare(self, layers: np.ndarray) -> None:
        """Make the "balanced" plan (``fresh`` int64 [L, P]) of ``layers`` available: in global mode it is computed
        only for the layers that need it (the per-layer repair and its fallback), in one call, and those layers'
        reference becomes its heaviest GPU (at or above the bound; the bound may be out of reach, e.g. when a
        replica of an unloaded expert must take a slot); in hierarchical mode their balanced map (``group_node``)
        becomes the plan's, which may be DeepSeek's packing rather than the start's
        (:func:`fdeplb.placement.balanced.balanced_plan`)."""
        need = layers[~self._have[layers]]
        if need.size:
            groups = self.num_groups if self.num_nodes > 1 else 1
            self.fresh[need], self.fresh_peak[need] = balanced_plan(self.load[need], self.old.shape[1], groups,
                                                                    self.num_nodes, self.num_gpus)
            if self.num_nodes > 1:  # the plan keeps DeepSeek's node packing where its start's packs worse
                self.group_node[need] = node_of_groups(self.fresh[need], self.old[need], groups, self.num_nodes,
                                                       self.group_size)
            self.target[need] = self._target(need)
            self._have[need] = True

    def _target(self, layers: np.ndarray | slice) -> np.ndarray:
        """float64: the reference's heaviest GPU plus the tolerance (a hair under it, so that the ratio recomputed
        from scratch stays within it) of ``layers``, in tokens."""
        peak, mean = self.fresh_peak[layers], self.mean[layers]
        return np.maximum(peak, (peak / np.where(mean > 0, mean, 1) + self.tolerance * (1 - 1e-9)) * mean)

    def candidates(self, layer: int) -> list:
        """The layer's :class:`fdeplb.placement.row_repair._Candidate` list (old map first, then the balanced one)."""
        return layer_candidates(self.load[layer], self.old[layer], self.fresh[layer], self.old_maps[layer],
                                self.group_node[layer], self.num_nodes, self.gpus_per_node, self.group_size)

    def best_plan(self, layer: int, cands: list, budget: float) -> tuple[np.ndarray, int, float]:
        """:func:`fdeplb.placement.row_repair.best_layer_plan` of ``layer`` within ``budget`` moved experts."""
        return best_layer_plan(cands, self.fresh[layer], self.load[layer], self.target[layer], budget,
                               self.gpus_per_node, self.S)


def layers_to_replan(excess: np.ndarray, tolerance: float) -> np.ndarray:
    """bool [L]: the layers the uncapped policy plans again, given every layer's excess float64 [L] (max/mean over
    the reference's) at its chosen stop: those above ``LAYER_CAP`` tolerances, then, while the mean over layers
    (a replanned layer counted at ``tolerance``, where it ends) is above ``tolerance``, the layers of largest
    excess in turn (ties: lower index first)."""
    stuck = excess > LAYER_CAP * tolerance * (1 + 1e-9)
    rest = np.where(stuck, tolerance, excess)
    if rest.mean() > tolerance:
        order = np.argsort(-rest, kind="stable")
        removed = np.cumsum(np.maximum(rest[order] - tolerance, 0.0))  # by replanning the first ones
        reached = removed >= rest.sum() - tolerance * rest.size
        k = int(np.argmax(reached)) + 1 if reached.any() else rest.size
        stuck[order[:k]] |= rest[order[:k]] > tolerance
    return stuck


def _replan_stuck(lay: _Layers, out: np.ndarray, excess: np.ndarray, tolerance: float) -> None:
    """Plan again, in place in ``out``, the layers the batched repair leaves above ``LAYER_CAP`` tolerances and,
    when the mean cannot be met otherwise, the layers of largest excess until it is (each counted at one tolerance,
    where it ends): by the per-layer repair and its fallback (global), by the fallback alone (hierarchical)."""
    stuck = layers_to_replan(excess, tolerance)
    if lay.num_nodes == 1 and stuck.any():  # first: bulk replica counts, then the batched repair again
        idx = np.flatnonzero(stuck)
        stuck[idx[_refill_stuck(lay, out, idx)]] = False
    lay.prepare(np.flatnonzero(stuck))
    for layer in np.flatnonzero(stuck):
        if lay.num_nodes > 1:  # the balanced plan's nodes, GPUs matched to the old ones, then reverted
            out[layer] = plan_layer(lay.candidates(layer)[-1], lay.fresh[layer], lay.load[layer], lay.target[layer],
                                    np.inf, lay.gpus_per_node, lay.S, repair=False)[0]
            continue
        # one row just above the cap: the exact per-layer repair usually closes it in a few moves
        out[layer] = lay.best_plan(layer, lay.candidates(layer), np.inf)[0]


def _refill_stuck(lay: _Layers, out: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """Global mode: plan ``layers`` int64 [k] again from the old placement with bulk replica counts
    (:func:`fdeplb.placement.fill.fill_rows`, no per-replica load above ``_STUCK_FILL`` times the largest one at
    DeepSeek's counts) followed by the batched repair; writes the layers that end within their target into ``out``
    and returns bool [k], True for those. The repair alone gets stuck when an expert needs several more replicas
    at once (one more only lifts another GPU to the heaviest's level)."""
    load, old, target = lay.load[layers], lay.old[layers], lay.target[layers]
    logcnt = replicate_experts(load, old.shape[1])[2]
    start = fill_rows(old, load, lay.num_gpus, _STUCK_FILL * (load / logcnt).max(axis=1))
    row = start.copy()
    repair_rows(row, load, old, target, lay.num_gpus)
    done = raw_gpu_loads(load, row, lay.num_gpus).max(axis=1) <= target
    out[layers[done]] = row[done]
    return done


def _plan_capped(lay: _Layers, max_moved_experts: int) -> np.ndarray:
    """The guard of the capped plan (should the Pareto plan move more than the cap): every layer by the per-layer
    repair, worst layers first, each within what is left of ``max_moved_experts`` after the moves no plan avoids
    are reserved; int64 [L, P]."""
    lay.prepare(np.arange(lay.load.shape[0]))
    candidates = [lay.candidates(layer) for layer in range(lay.load.shape[0])]
    # moves no plan can avoid (groups spread over nodes in the old placement) are reserved first
    reserve = np.array([min(c.fill_cost for c in cands) for cands in candidates], dtype=np.float64)
    check_reserve(reserve, max_moved_experts)
    budget = float(max_moved_experts) - reserve.sum()
    out = np.empty_like(lay.old)
    # worst layers first, so that a move budget goes where it helps most
    old_peak = raw_gpu_loads(lay.load, lay.old, lay.num_gpus).max(axis=1)
    for layer in np.argsort(-(old_peak - lay.target), kind="stable"):
        layer_budget = budget + reserve[layer]
        best = lay.best_plan(layer, candidates[layer], layer_budget)
        out[layer] = best[0]
        budget = layer_budget - best[1]
    return align_slots(lay.old, out, lay.num_gpus)


def _global_trajectories(load: np.ndarray, old: np.ndarray, target: np.ndarray, cap: np.ndarray,
                         num_gpus: int) -> tuple[np.ndarray, list, list]:
    """Global mode: every layer's start (the old placement; bulk replica counts where a layer needs many copies to
    get under ``cap``) and its repair trajectory toward ``target`` (float64 [L] tokens): (start int64 [L, P],
    points, log) of :func:`fdeplb.placement.repair.repair_rows`."""
    start = old.copy()
    bulk = forced_copies(old, load, cap) >= _BULK_COPIES
    if bulk.any():
        start[bulk] = fill_rows(old[bulk], load[bulk], num_gpus, cap[bulk])
    points, log = repair_rows(start.copy(), load, old, target, num_gpus)
    return start, points, log


def _plan_within(lay: _Layers, tolerance: float, max_moved_experts: int) -> np.ndarray | None:
    """With a move cap, the Pareto option: every layer's plan chosen among the old placement and the repair's
    trajectories toward a ladder of targets so that the mean excess over layers is least within
    ``max_moved_experts`` (:func:`fdeplb.placement.pareto.plan_within_budget`, in hierarchical mode
    :func:`fdeplb.placement.pareto.plan_nodes_within_budget`); int64 [L, P], or None in the unexpected case that
    the aligned plan moves more (the caller then takes the per-layer repair).

    Raises:
        InputError: hierarchical mode, a cap below the moves no plan avoids."""
    if lay.num_nodes == 1:
        plan = plan_within_budget(lay.load, lay.old, lay.fresh_peak, lay.num_gpus, tolerance, max_moved_experts,
                                  bulk_copies=_BULK_COPIES, stuck_fill=_STUCK_FILL)
    else:
        plan = plan_nodes_within_budget(lay.load, lay.old, lay.fresh_peak, lay.old_maps, lay.group_node,
                                        lay.num_nodes, lay.num_gpus, tolerance, max_moved_experts,
                                        bulk_copies=_BULK_COPIES, free_item=_MAX_ITEM_SHARE)
    plan = _align_where_needed(lay.old, plan, lay.num_gpus)
    return plan if moved_experts(lay.old, plan, lay.num_gpus) <= max_moved_experts else None


def _plan_all(load: np.ndarray, old: np.ndarray, fresh_peak: np.ndarray, mean: np.ndarray, tolerance: float,
              old_maps: np.ndarray, fresh_maps: np.ndarray, num_nodes: int,
              num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """The uncapped plan of every layer: :func:`fdeplb.placement.repair.repair_rows` on all (layer, node) rows,
    stopped by :func:`fdeplb.placement.stops.choose_stops`. Returns (phy2log int64 [L, P], excess float64 [L]:
    max/mean GPU load minus the "balanced" plan's, per layer).

    A layer takes the group-to-node map that relocates the fewest old slots among those whose heaviest node, spread
    evenly over its GPUs, is within the target (:func:`fdeplb.placement.node_maps.nearest_maps`: the old map when
    it is, so a layer already within it whose groups sit on whole nodes keeps its placement; DeepSeek-V3 4-node
    drift pair: 22.6% of a fresh plan's moves, 29.5% by the balanced plan's map); experts of groups that change
    node fill the freed slots
    (:func:`fdeplb.placement.fill.fill_rows`) before the repair."""
    L, P = old.shape
    num_groups = old_maps.shape[1]
    Pn, Gn = P // num_nodes, num_gpus // num_nodes
    layers = np.arange(L)
    safe_mean = np.where(mean > 0, mean, 1.0)
    # rows are repaired a little below the tolerance, so that the stop choice can let expensive layers stop above it
    target = fresh_peak + _REPAIR_SHARE * tolerance * safe_mean
    cap = fresh_peak + LAYER_CAP * tolerance * (1 - 1e-9) * safe_mean
    if num_nodes == 1:  # global: one row per layer, the layer's own ids
        start, points, log = _global_trajectories(load, old, target, cap, num_gpus)
        stops, excess = choose_stops(points, layers, fresh_peak, safe_mean, tolerance * (1 - 1e-9),
                                     LAYER_CAP * tolerance * (1 - 1e-9), replanned_at_tolerance=True)
        return replay_stops(start, log, stops), excess
    group_load = group_loads(load, num_groups)
    maps = nearest_maps(old_maps, group_load, old_group_slots(old, num_groups, load.shape[1]), num_nodes, target * Gn)
    if maps is None:  # too many maps to try: the old one when within the target, else the balanced plan's
        heaviest = node_loads(old_maps, group_load, num_nodes).max(axis=1)
        maps = np.where((heaviest / Gn <= target)[:, None], old_maps, fresh_maps)
    experts_of, old_local, row_load, start = node_rows(load, old, maps, _MAX_ITEM_SHARE * mean, cap, num_nodes,
                                                       num_gpus, _BULK_COPIES)
    work = start.copy()
    points, log = repair_rows(work, row_load, old_local, np.repeat(target, num_nodes), Gn, pair_swaps=True)
    stops, excess = choose_stops(points, np.repeat(layers, num_nodes), fresh_peak, safe_mean,
                                 tolerance * (1 - 1e-9), LAYER_CAP * tolerance * (1 - 1e-9),
                                 replanned_at_tolerance=True)
    rows = replay_stops(start, log, stops)
    out = np.take_along_axis(experts_of, rows.reshape(L, num_nodes, Pn), axis=2).reshape(L, P)
    return out, excess


def _align_where_needed(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """:func:`align_slots` on the GPUs where an expert that stays on its GPU is not in its old slot (the repair keeps
    slots otherwise: a swap or a copy rewrites only the slots it names); int64 [L, P]."""
    L, P = old.shape
    S = P // num_gpus
    o2, n2 = old.reshape(L * num_gpus, S), new.reshape(L * num_gpus, S)
    # a slot whose new expert differs from its old one while the GPU held that expert before
    held = (n2[:, :, None] == o2[:, None, :]).any(axis=2)
    gpus = np.flatnonzero(((o2 != n2) & held).any(axis=1))
    if gpus.size == 0:
        return new
    out = new.copy().reshape(L * num_gpus, S)
    out[gpus] = _align_gpus(o2[gpus], n2[gpus])
    return out.reshape(L, P)


def _align_gpus(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """:func:`align_slots` of GPUs ``old``/``new`` int64 [k, S] (one GPU's slots a row), all at once: an expert
    keeps its old slot for as many of its old replicas (first slots first) as the GPU still holds; the other new
    replicas fill the other slots in their order. int64 [k, S]."""
    S = old.shape[1]
    before = np.tri(S, k=-1, dtype=bool)  # [s, s']: s' < s
    same_old = old[:, :, None] == old[:, None, :]
    old_new = old[:, :, None] == new[:, None, :]  # [k, s, t]
    same_new = new[:, :, None] == new[:, None, :]
    keep = (same_old & before).sum(axis=2) < old_new.sum(axis=2)  # the expert's i-th old slot, i < new count
    kept = np.minimum(old_new.sum(axis=1), same_new.sum(axis=2))  # [k, t]: replicas of new[t]'s expert kept
    rest = (same_new & before).sum(axis=2) >= kept  # new[t] not one of its expert's first `kept` replicas
    out = np.where(keep, old, -1)
    out[~keep] = new[rest]
    return out
