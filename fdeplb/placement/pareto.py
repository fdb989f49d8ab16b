"""The Pareto option of the "move_aware" policy: the least mean max/mean a budget of moved experts buys.

One concern: given a move budget (``max_moved_experts``, a sum over layers), choose for every layer one plan among
candidates that do not depend on the budget, so that the mean over layers of the heaviest GPU's excess is least.

Candidates (:func:`plan_within_budget`): every layer's old placement (no move) and every point of the batched
repair's trajectory (:func:`fdeplb.placement.repair.repair_rows`) toward each target of a ladder of tolerances
(:func:`ladder`: the policy's own ``tolerance`` and a geometric ladder from ``_LADDER_LOW`` to ``_LADDER_HIGH``),
plus, for a layer the tightest target leaves above twice it, the trajectory from bulk replica counts. A tight
target spends moves on precision (every GPU within ~0.0005 of the mean costs ~2 moves per GPU on the DeepSeek-V3
drift pairs); a loose one spends them where the heaviest GPU is, so a small budget is best spent on the early
points of loose trajectories, a large one on the late points of tight ones.

Hierarchical mode (:func:`plan_nodes_within_budget`): the same ladder over the (layer, node) rows of each of a
layer's group-to-node maps, with the relocation of groups that change node counted in every candidate's moves.

Choice (:func:`fdeplb.placement.stops.choose_within_budget`): an exact multiple-choice knapsack over the candidates
(dynamic programming over the integer budget). The candidate set is the same for every budget and the choice is
optimal over it, so a larger budget never gives a larger mean excess (monotone by construction).
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError
from fdeplb.placement.deepseek import replicate_experts
from fdeplb.placement.fill import fill_rows, forced_copies
from fdeplb.placement.metrics import raw_gpu_loads
from fdeplb.placement.node_maps import group_loads, nearest_maps, node_rows, old_group_slots, swap_map
from fdeplb.placement.repair import repair_rows
from fdeplb.placement.stops import block_candidates, choose_within_budget, replay_stops

#: the ladder of repair targets (excess over the reference heaviest GPU, max/mean units): a geometric ladder from
#: _LADDER_LOW to _LADDER_HIGH by factors of _LADDER_STEP, plus the policy's own tolerance
_LADDER_LOW, _LADDER_HIGH, _LADDER_STEP = 0.00025, 0.26, 2.0


def ladder(tolerance: float) -> np.ndarray:
    """float64 [K] increasing, distinct: the repair targets of the candidates (excess over the reference heaviest
    GPU, max/mean units): ``_LADDER_LOW * _LADDER_STEP ** k`` up to ``_LADDER_HIGH`` and ``tolerance`` (>= 0)."""
    k = int(np.floor(np.log(_LADDER_HIGH / _LADDER_LOW) / np.log(_LADDER_STEP) + 1e-9))
    rungs = _LADDER_LOW * _LADDER_STEP ** np.arange(k + 1)
    return np.unique(np.append(rungs, tolerance))


def plan_within_budget(load: np.ndarray, old: np.ndarray, ref_peak: np.ndarray, num_gpus: int, tolerance: float,
                       budget: int, *, bulk_copies: int, stuck_fill: float) -> np.ndarray:
    """The plan of every layer (global mode) with the least mean excess within ``budget`` moved experts.

    Args:
        load: float64 [L, E] expert_load of the new window (tokens).
        old: int64 [L, P] old phy2log (every expert at least once).
        ref_peak: float64 [L] tokens, the reference heaviest GPU the excess is measured from
            (``fdeplb.placement.move_aware.reference_peak``).
        num_gpus: GPUs (P a multiple of it).
        tolerance: the policy's tolerance (max/mean units, >= 0): one rung of the ladder.
        budget: moved experts allowed in all, >= 0.
        bulk_copies: a layer whose experts need at least this many more replicas to get every per-replica load
            under twice a rung gets its replica counts in bulk before that rung's repair.
        stuck_fill: a layer the tightest rung leaves above twice it is also planned from bulk replica counts with
            no per-replica load above this many times the largest one at DeepSeek's counts.

    Returns:
        phy2log int64 [L, P] with at most ``budget`` moved experts (:func:`fdeplb.placement.moved_experts`). Slots
        of experts that stay on a GPU may have been permuted by swaps (the caller aligns them). Deterministic.
    """
    L = load.shape[0]
    mean = load.sum(axis=1) / num_gpus
    safe_mean = np.where(mean > 0, mean, 1.0)
    old_peak = raw_gpu_loads(load, old, num_gpus).max(axis=1)
    # candidate 0 of every layer: the old placement; then every trajectory point of every rung
    c_rung, c_it = [np.full(L, -1)], [np.zeros(L, dtype=np.int64)]
    c_layer, c_moves, c_peak = [np.arange(L)], [np.zeros(L, dtype=np.int64)], [old_peak]
    rungs = ladder(tolerance)
    runs = [_rung_run(load, old, ref_peak, safe_mean, rung, num_gpus, bulk_copies) for rung in rungs]
    # layers the tightest rung leaves above twice it (an expert needs several more replicas at once, and one more
    # only lifts another GPU to the heaviest's level): also from bulk replica counts, then the repair
    reach = np.full(L, np.inf)
    for _, (rows, _, peak) in runs[0][2]:  # every row's last point is its end
        reach[rows] = peak
    stuck = np.flatnonzero(reach > ref_peak + 2 * max(rungs[0], _LADDER_LOW) * safe_mean)
    if stuck.size:
        runs.append(_refill_run(load, old, ref_peak, safe_mean, rungs[0], num_gpus, stuck, stuck_fill))
    for r, (_, _, points) in enumerate(runs):
        for t, (rows, moved, peak) in points:
            c_rung.append(np.full(rows.size, r))
            c_it.append(np.full(rows.size, t, dtype=np.int64))
            c_layer.append(rows)
            c_moves.append(moved)
            c_peak.append(peak)
    rung_of, it_of = np.concatenate(c_rung), np.concatenate(c_it)
    layer_of = np.concatenate(c_layer)
    excess = (np.concatenate(c_peak) - ref_peak[layer_of]) / safe_mean[layer_of]
    pick = choose_within_budget(layer_of, np.concatenate(c_moves), excess, L, budget)
    out = old.copy()
    for r, (start, log, _) in enumerate(runs):
        mine = pick[rung_of[pick] == r]
        if mine.size == 0:
            continue
        stops = np.zeros(L, dtype=np.int64)
        stops[layer_of[mine]] = it_of[mine]
        layers = layer_of[mine]
        out[layers] = replay_stops(start, log, stops)[layers]
    return out


def _rung_run(load: np.ndarray, old: np.ndarray, ref_peak: np.ndarray, safe_mean: np.ndarray, rung: float,
              num_gpus: int, bulk_copies: int) -> tuple[np.ndarray, list, list]:
    """Every layer's repair toward ``ref_peak + rung x mean`` from the old placement (bulk replica counts first
    where the layer needs ``bulk_copies`` or more copies to get under twice the rung): (start int64 [L, P], log,
    [(iteration, (layers, moved, peak))]) of :func:`fdeplb.placement.repair.repair_rows`."""
    cap = ref_peak + 2 * rung * safe_mean
    start = old.copy()
    bulk = forced_copies(old, load, cap) >= bulk_copies
    if bulk.any():
        start[bulk] = fill_rows(old[bulk], load[bulk], num_gpus, cap[bulk])
    points, log = repair_rows(start.copy(), load, old, ref_peak + rung * safe_mean, num_gpus)
    return start, log, list(enumerate(points))


def _refill_run(load: np.ndarray, old: np.ndarray, ref_peak: np.ndarray, safe_mean: np.ndarray, rung: float,
                num_gpus: int, layers: np.ndarray, stuck_fill: float) -> tuple[np.ndarray, list, list]:
    """``layers`` int64 [k] planned again from bulk replica counts (no per-replica load above ``stuck_fill`` times
    the largest at DeepSeek's counts, :func:`fdeplb.placement.fill.fill_rows`) and repaired toward ``rung``; as
    :func:`_rung_run`, the start and the log over all L layers (the others kept as old, never replayed)."""
    sub_load, sub_old = load[layers], old[layers]
    logcnt = replicate_experts(sub_load, old.shape[1])[2]
    sub_start = fill_rows(sub_old, sub_load, num_gpus, stuck_fill * (sub_load / logcnt).max(axis=1))
    points, log = repair_rows(sub_start.copy(), sub_load, sub_old, (ref_peak + rung * safe_mean)[layers], num_gpus)
    start = old.copy()
    start[layers] = sub_start
    log = [None if e is None else (layers[e[0]], *e[1:]) for e in log]
    return start, log, [(t, (layers[rows], moved, peak)) for t, (rows, moved, peak) in enumerate(points)]


def check_reserve(reserve: np.ndarray, budget: int) -> None:
    """Raise when ``budget`` moved experts cannot pay ``reserve`` float64 [L], the moves per layer no hierarchical
    plan avoids (an old placement that spreads expert groups over nodes).

    Raises:
        InputError: ``reserve.sum() > budget``, naming the layers and the moves.
    """
    if reserve.sum() > budget:
        layers = np.flatnonzero(reserve > 0)
        raise InputError(
            f"max_moved_experts={budget} cannot be met: old_phy2log spreads expert groups over nodes "
            f"(layers {layers[:8].tolist()}{' ...' if layers.size > 8 else ''}) and putting every group on one "
            f"node moves {int(reserve.sum())} experts"
        )


def plan_nodes_within_budget(load: np.ndarray, old: np.ndarray, ref_peak: np.ndarray, old_maps: np.ndarray,
                             fresh_maps: np.ndarray, num_nodes: int, num_gpus: int, tolerance: float, budget: int,
                             *, bulk_copies: int, free_item: float) -> np.ndarray:
    """The plan of every layer (hierarchical mode) with the least mean excess within ``budget`` moved experts.

    Candidates of a layer, none depending on the budget: its old placement when it keeps every group on one node (no
    move), and for each of its group-to-node maps (the old placement's, the old one with one swap of two groups,
    :func:`fdeplb.placement.node_maps.swap_map`, the one relocating the fewest old slots with its heaviest node within
    ``tolerance`` of the reference, :func:`fdeplb.placement.node_maps.nearest_maps`, and the "balanced" plan's; each
    where it differs from those before it) and each rung of :func:`ladder`, the levels of the node rows' repair trajectories toward the rung
    (:func:`fdeplb.placement.stops.block_candidates`): the rows of :func:`fdeplb.placement.node_maps.node_rows`
    (the relocation of the groups that change node is part of every point's moved experts, so it is charged to
    the budget), repaired with 2-2 swaps as in the uncapped path. Choice: the exact multiple-choice knapsack
    (:func:`fdeplb.placement.stops.choose_within_budget`), so a larger budget never does worse.

    Args:
        load: float64 [L, E] expert_load (tokens); old: int64 [L, P] old phy2log.
        ref_peak: float64 [L] tokens, the reference heaviest GPU (``move_aware.reference_peak``).
        old_maps, fresh_maps: int64 [L, num_groups] node of every group (:mod:`fdeplb.placement.node_maps`).
        num_nodes, num_gpus: the topology (num_groups a multiple of num_nodes).
        tolerance: the policy's tolerance (max/mean units, >= 0): one rung of the ladder.
        budget: moved experts allowed in all, >= 0.
        bulk_copies: a row whose experts need this many more replicas to get under twice a rung gets them in bulk.
        free_item: share of the mean GPU load above which a relocated row re-assigns replicas.

    Returns:
        phy2log int64 [L, P], every group on one node, at most ``budget`` moved experts; slots of experts that stay
        on a GPU may be permuted (the caller aligns them). Deterministic.

    Raises:
        InputError: ``budget`` below the moves no plan avoids (:func:`check_reserve`).
    """
    L, E = load.shape
    P = old.shape[1]
    Pn = P // num_nodes
    mean = load.sum(axis=1) / num_gpus
    safe_mean = np.where(mean > 0, mean, 1.0)
    group_size = E // old_maps.shape[1]
    # (layer, map) pairs: every layer's old map, then its one-swap, nearest and balanced maps where each differs from
    # the maps before it
    group_load = group_loads(load, old_maps.shape[1])
    near = nearest_maps(old_maps, group_load, old_group_slots(old, old_maps.shape[1], E), num_nodes,
                        (ref_peak + tolerance * safe_mean) * (num_gpus // num_nodes))
    candidates = [old_maps, swap_map(old_maps, group_load, num_nodes)] + ([] if near is None else [near]) + [fresh_maps]
    sel, maps = [], []
    for k, cand in enumerate(candidates):
        new = np.flatnonzero(np.all([(cand != earlier).any(axis=1) for earlier in candidates[:k]], axis=0)
                             if k else np.ones(L, dtype=bool))
        sel.append(new)
        maps.append(cand[new])
    sel, maps = np.concatenate(sel), np.concatenate(maps)
    rungs = ladder(tolerance)
    starts, targets = [], []
    for rung in rungs:  # the rows of every (rung, layer, map), stacked for one batched repair
        experts_of, old_local, row_load, start = node_rows(
            load[sel], old[sel], maps, free_item * mean[sel], ref_peak[sel] + 2 * rung * safe_mean[sel], num_nodes,
            num_gpus, bulk_copies)
        starts.append(start)
        targets.append(np.repeat(ref_peak[sel] + rung * safe_mean[sel], num_nodes))
    K = rungs.size
    start = np.concatenate(starts)
    points, log = repair_rows(start.copy(), np.tile(row_load, (K, 1)), np.tile(old_local, (K, 1)),
                              np.concatenate(targets), num_gpus // num_nodes, pair_swaps=True)
    block, moves, excess, stops = block_candidates(points, num_nodes, np.tile(ref_peak[sel], K),
                                                   np.tile(safe_mean[sel], K))
    layer_of = np.tile(sel, K)[block]
    # the old placement of layers that keep every group on one node: no move
    keeps = (old_maps[np.arange(L)[:, None], old // group_size] == np.arange(P) // Pn).all(axis=1)
    old_peak = raw_gpu_loads(load, old, num_gpus).max(axis=1)
    kept = np.flatnonzero(keeps)
    layer_of = np.concatenate([kept, layer_of])
    moves = np.concatenate([np.zeros(kept.size, dtype=np.int64), moves])
    excess = np.concatenate([((old_peak - ref_peak) / safe_mean)[kept], excess])
    reserve = np.full(L, np.inf)
    np.minimum.at(reserve, layer_of, moves.astype(np.float64))
    check_reserve(reserve, budget)
    pick = choose_within_budget(layer_of, moves, excess, L, budget) - kept.size
    pick = pick[pick >= 0]  # the layers that move: candidate pick of block block[pick]
    all_stops = np.zeros(start.shape[0], dtype=np.int64)
    rows = block[pick][:, None] * num_nodes + np.arange(num_nodes)
    all_stops[rows] = stops[pick]
    replayed = replay_stops(start, log, all_stops)
    out = old.copy()
    m = block[pick] % sel.size  # the (layer, map) pair of every chosen block
    out[sel[m]] = np.take_along_axis(experts_of[m], replayed[rows].reshape(m.size, num_nodes, Pn),
                                     axis=2).reshape(m.size, P)
    return out
