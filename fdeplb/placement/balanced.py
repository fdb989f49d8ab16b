"""The "balanced" policy: DeepSeek's plan improved by an exchange local search inside nodes.

The problem per (layer, node) row is cardinality-constrained multiprocessor scheduling (P||Cmax with exactly
``S = P / num_gpus`` items per GPU; "k-partitioning", Babel, Kellerer & Kotov, Math. Methods of OR 47, 1998;
Dell'Amico & Martello, "Bounds for the cardinality constrained P||Cmax problem", J. Scheduling 4, 2001).

1. Start: DeepSeek's plan (github.com/deepseek-ai/EPLB). Its replica counts (each redundant slot to the expert of
   largest load per replica, which minimises the largest per-replica load; changed only by step 3) and, in
   hierarchical mode, its group-to-node packing are kept, except that a layer whose groups have a packing onto
   nodes with a lighter heaviest node gets the lightest one (exhaustive over packings: DeepSeek's greedy is optimal
   with two groups a node, not with four: DeepSeek-V3 at 2 nodes, EP16, 1.0215-1.0590 mean max/mean -> 1.0061-1.0409;
   :func:`balanced_start`) and DeepSeek's replication inside its nodes; its greedy packing of replicas onto GPUs
   (heaviest first onto the lightest GPU with room) is the starting point. A layer with a lighter packing is
   searched from DeepSeek's plan too and keeps the lighter end (the lighter packing's replicas may pack worse onto
   GPUs: 575 against 556.67 tokens on a layer of 8 groups, tests/placement/test_node_packing.py).
2. Exchange local search, the pairwise-interchange neighbourhood of P||Cmax local search (Finn & Horowitz, "A linear
   time approximation algorithm for multiprocessor scheduling", BIT 19, 1979), restricted to swaps so that every GPU
   keeps exactly S slots. Every row cycles through three moves, each the best of its kind:
   a. 1-1: a replica of the heaviest GPU trades places with one of another GPU of the node, if that lowers the
      larger of the two loads;
   b. once (a) is stuck, 1-1 raising the lightest GPU instead (frees new swaps for the heaviest one); back to (a)
      when it helps;
   c. once both are stuck, 2-2: two replicas of the heaviest GPU trade places with two of one of its
      :data:`_PARTNERS` lightest GPUs (the best partner pair per GPU found by binary search over its sorted pair
      sums); back to (a) when it helps.
   A row ends when (c) is stuck too, or as soon as its heaviest GPU is within :data:`_GOOD_ENOUGH` of its mean.
3. Rows where the replica counts force an excess (some GPU must hold two replicas of hot experts: no exchange can
   help) are re-counted and packed again (:mod:`fdeplb.placement.recount`); no plan of the real dumps changes.
   Every accepted move strictly lowers the sum of squared GPU loads and never raises the maximum, so the search
   ends and the result is never worse than "deepseek" on any layer. Without (c) and the early stop
   (``pairs=False``) it is the search "balanced" ran before its 2-2 stage, kept as "move_aware"'s reference.

All rows are searched at once; each iteration evaluates the chosen move of every active row in one numpy expression
([rows, slots_per_gpu, slots_per_node] for 1-1; [rows, gpus, S(S-1)/2] searches for 2-2). Deterministic: ties take
the lowest index.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fdeplb.placement.deepseek import deepseek_placement, place_in_nodes
from fdeplb.placement.metrics import raw_gpu_loads
from fdeplb.placement.node_maps import group_loads, group_nodes, lightest_maps, node_loads
from fdeplb.placement.recount import recount_rows

#: relative gain below which a swap is not worth it (float64 noise on loads of ~1e8 tokens)
_RTOL = 1e-12
#: hard cap on iterations (each moves one swap per active row); real dumps converge in < 300
_MAX_ITER = 10_000
#: a row stops once its heaviest GPU is within this share above its mean GPU load (each 2-2 iteration costs about
#: as much as the whole 1-1 search of a row; the balance bar is 3e-4 on the mean over layers)
_GOOD_ENOUGH = 1e-5
#: 2-2 swaps of the heaviest GPU are searched with this many of the lightest GPUs of the row
_PARTNERS = 4
#: the three moves of a row's cycle
_MAX_1, _MIN_1, _MAX_2 = 0, 1, 2


def _best_swaps(item_load: np.ndarray, gpu_load: np.ndarray, rows: np.ndarray):
    """For every row, the swap of a slot of its heaviest GPU with a slot of another GPU that minimises the larger
    of the two new loads. Returns (gpu_a, slot_a, gpu_b, slot_b, gain, peak) per row."""
    _, G, S = item_load.shape
    n = rows.size
    r = np.arange(n)
    w = item_load[rows]
    load = gpu_load[rows]
    ga = load.argmax(axis=1)
    peak = load[r, ga]
    other = load.copy()
    other[r, ga] = np.inf  # no swap inside the GPU itself
    # new larger load of (ga, gb) after swapping items of loads x (on ga) and y (on gb):
    #   max(peak - (x - y), other + (x - y)) = (peak + other) / 2 + |x - y - (peak - other) / 2|
    centre = np.repeat(0.5 * (peak[:, None] + other), S, axis=1)
    shifted = (w + 0.5 * (peak[:, None] - other)[:, :, None]).reshape(n, G * S)
    cost = np.abs(w[r, ga][:, :, None] - shifted[:, None, :]) + centre[:, None, :]
    flat = cost.reshape(n, -1)
    best = flat.argmin(axis=1)
    gain = peak - flat[r, best]
    sa, b = np.divmod(best, G * S)
    gb, sb = np.divmod(b, S)
    return ga, sa, gb, sb, gain, np.abs(peak)


def _best_pair_swaps(item_load: np.ndarray, gpu_load: np.ndarray, rows: np.ndarray):
    """For every row, the swap of two slots of its heaviest GPU with two slots of one of its :data:`_PARTNERS`
    lightest GPUs (a swap with GPU b gains at most half the gap between the heaviest GPU and b) that minimises the
    larger of the two new loads (same cost as :func:`_best_swaps`, items replaced by pair sums). For every pair of
    the heaviest GPU and every partner, the partner's pair is found by binary search in its sorted pair sums (the
    two neighbours of the ideal sum are scored exactly). Returns (gpu_a, pair_a, gpu_b, pair_b, gain, peak) per
    row; a pair is an index into ``np.triu_indices(S, 1)``."""
    _, G, S = item_load.shape
    K = min(G - 1, _PARTNERS)
    n = rows.size
    r = np.arange(n)[:, None]
    first, second = np.triu_indices(S, 1)
    Q = first.size
    load = gpu_load[rows]
    by_load = np.argsort(load, axis=1, kind="stable")
    ga, gb = by_load[:, -1], by_load[:, :K]  # heaviest, K lightest
    peak = load[r[:, 0], ga]
    other = np.take_along_axis(load, gb, axis=1)  # [n, K]
    half = 0.5 * (peak[:, None] - other)
    w = item_load[rows[:, None], np.concatenate([ga[:, None], gb], axis=1)]  # [n, 1 + K, S]
    pair = w[:, :, first] + w[:, :, second]  # [n, 1 + K, Q]
    order = np.argsort(pair, axis=2, kind="stable")
    sorted_pair = np.take_along_axis(pair, order, axis=2)
    mine, theirs = sorted_pair[:, 0], sorted_pair[:, 1:]  # ascending: the searches below come in order (faster)
    ideal = mine[:, None, :] - half[:, :, None]  # [n, K, Q] partner pair sum that evens the two GPUs
    # one flat sorted array of all (row, partner) blocks: block b's keys are offset by b * span > every key range
    span = 4.0 * (np.abs(pair).max(initial=0.0) + np.abs(ideal).max(initial=0.0)) + 1.0
    offset = (np.arange(n * K, dtype=np.float64) * span).reshape(n, K, 1)
    at = np.searchsorted((theirs + offset).ravel(), (ideal + offset).ravel()).reshape(n, K, Q)
    at -= (np.arange(n * K, dtype=np.int64) * Q).reshape(n, K, 1)
    below, above = np.clip(at - 1, 0, Q - 1), np.clip(at, 0, Q - 1)
    cost_below = np.abs(ideal - np.take_along_axis(theirs, below, axis=2))
    cost_above = np.abs(ideal - np.take_along_axis(theirs, above, axis=2))
    best_at = np.where(cost_above < cost_below, above, below)
    cost = np.minimum(cost_below, cost_above) + 0.5 * (peak[:, None] + other)[:, :, None]
    flat = cost.reshape(n, -1)
    best = flat.argmin(axis=1)
    gain = peak - flat[r[:, 0], best]
    k, qa = np.divmod(best, Q)
    qb = order[r[:, 0], 1 + k, best_at[r[:, 0], k, qa]]
    return ga, order[r[:, 0], 0, qa], gb[r[:, 0], k], qb, gain, np.abs(peak)


def _swap(item_load, origin, gpu_load, r, ga, sa, gb, sb) -> None:
    """Apply the 1-1 swaps (row r: slot (ga, sa) <-> slot (gb, sb)) in place."""
    x, y = item_load[r, ga, sa], item_load[r, gb, sb]
    item_load[r, ga, sa], item_load[r, gb, sb] = y, x
    origin[r, ga, sa], origin[r, gb, sb] = origin[r, gb, sb], origin[r, ga, sa]
    gpu_load[r, ga] += y - x
    gpu_load[r, gb] += x - y


def improve_by_swaps(item_load: np.ndarray, *, pairs: bool = True) -> np.ndarray:
    """Exchange local search (see the module docstring) on ``item_load`` float64 [R, G, S] (R rows, G packs of S
    items); modified in place.

    Args:
        pairs: False: 1-1 swaps only, every row to the end (no 2-2 stage, no early stop): the search "balanced"
            ran before 2-2 swaps, kept as the reference of "move_aware" (see :func:`balanced_plan`).

    Returns:
        int64 [R, G, S]: for every final position, the flat index ``g * S + s`` of the item's starting position.
    """
    R, G, S = item_load.shape
    origin = np.broadcast_to(np.arange(G * S, dtype=np.int64).reshape(G, S), (R, G, S)).copy()
    if G < 2:
        return origin
    gpu_load = item_load.sum(axis=-1)
    if pairs:
        good = gpu_load.mean(axis=1) * (1 + _GOOD_ENOUGH)
    else:
        good = np.full(R, -np.inf)
    first, second = np.triu_indices(S, 1)
    active = np.arange(R)
    move = np.full(R, _MAX_1, dtype=np.int64)
    paired = np.zeros(R, dtype=bool)  # a 2-2 swap helped since the row last entered the 2-2 stage
    for _ in range(_MAX_ITER):
        if active.size == 0:
            break
        still = []
        active = active[gpu_load[active].max(axis=1) > good[active]]
        for kind in (_MAX_1, _MIN_1, _MAX_2):
            rows = active[move[active] == kind]
            if kind == _MAX_2 and (S < 2 or not pairs):
                rows = rows[:0]
            if rows.size == 0:
                continue
            if kind == _MIN_1:  # raising the lightest GPU = lowering the heaviest of the negated problem
                ga, sa, gb, sb, gain, scale = _best_swaps(-item_load, -gpu_load, rows)
            elif kind == _MAX_1:
                ga, sa, gb, sb, gain, scale = _best_swaps(item_load, gpu_load, rows)
            else:
                ga, qa, gb, qb, gain, scale = _best_pair_swaps(item_load, gpu_load, rows)
            ok = gain > scale * _RTOL
            r, ga, gb = rows[ok], ga[ok], gb[ok]
            if kind == _MAX_2:
                _swap(item_load, origin, gpu_load, r, ga, first[qa[ok]], gb, first[qb[ok]])
                _swap(item_load, origin, gpu_load, r, ga, second[qa[ok]], gb, second[qb[ok]])
            else:
                _swap(item_load, origin, gpu_load, r, ga, sa[ok], gb, sb[ok])
            failed = rows[~ok]
            if kind == _MAX_2:  # 2-2 again while it helps; stuck: back to 1-1 if some 2-2 helped, else the end
                paired[r] = True
                back = failed[paired[failed]]
                move[back] = _MAX_1
                still += [r, back]
            else:  # 1-1 on the heaviest GPU stuck: raise the lightest; that helped: back; stuck too: 2-2
                move[r] = _MAX_1
                move[failed] = _MIN_1 if kind == _MAX_1 else _MAX_2
                if kind == _MIN_1:
                    paired[failed] = False
                still += [r, failed]
        active = np.unique(np.concatenate(still)) if still else active[:0]
    return origin


def balanced_phy2log(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """DeepSeek's plan (``num_groups``/``num_nodes`` as given: pass 1/1 for global) improved by the exchange local
    search within nodes. Returns phy2log int64 [L, P]. Inputs must already be checked."""
    return balanced_plan(expert_load, num_replicas, num_groups, num_nodes, num_gpus)[0]


def balanced_plan(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
    pairs: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`balanced_phy2log` and the load of its heaviest GPU per layer: (phy2log int64 [L, P], float64 [L]
    tokens), the peak computed once here for callers that need it.

    ``pairs=False`` runs the 1-1 swaps alone (no 2-2 stage): the plan "balanced" gave before the 2-2 stage, which
    "move_aware" keeps as its reference (its tolerance and moves are measured against it, and its output stays
    what it was)."""
    start, logcnt, deepseek, deepseek_logcnt = balanced_start(expert_load, num_replicas, num_groups, num_nodes,
                                                              num_gpus)
    load = np.asarray(expert_load, dtype=np.float64)
    phy2log = _search(load, start, logcnt, num_nodes, num_gpus, pairs)
    deepseek_gpu = raw_gpu_loads(load, deepseek, num_gpus)
    before = deepseek_gpu.max(axis=1)
    after = raw_gpu_loads(load, phy2log, num_gpus).max(axis=1)
    # a layer with a lighter node packing is searched from DeepSeek's too, and keeps the lighter end (ties: the
    # lighter packing's): the lighter packing's replicas may pack worse onto GPUs. Not where the lighter end is at
    # most DeepSeek's heaviest node over its GPUs, which no plan with DeepSeek's packing goes below
    gpus_per_node = num_gpus // num_nodes
    floor = deepseek_gpu.reshape(len(load), num_nodes, gpus_per_node).sum(axis=2).max(axis=1) / gpus_per_node
    lighter = np.flatnonzero((start != deepseek).any(axis=1) & (after > floor))
    if lighter.size:
        other = _search(load[lighter], deepseek[lighter], deepseek_logcnt[lighter], num_nodes, num_gpus, pairs)
        other_peak = raw_gpu_loads(load[lighter], other, num_gpus).max(axis=1)
        won = other_peak < after[lighter]
        phy2log[lighter[won]], after[lighter[won]] = other[won], other_peak[won]
    # never worse than DeepSeek on any layer (guards against float drift of the incremental loads)
    better = after <= before
    return np.where(better[:, None], phy2log, deepseek), np.where(better, after, before)


def _search(load: np.ndarray, start: np.ndarray, logcnt: np.ndarray, num_nodes: int, num_gpus: int,
            pairs: bool) -> np.ndarray:
    """Steps 2-3 of the module docstring from ``start`` int64 [L, P] with its replica counts ``logcnt`` int64
    [L, E] (``load`` float64 [L, E] tokens): the exchange search inside every node, then (``pairs``) the re-count
    of rows whose counts force an excess. Returns phy2log int64 [L, P], a new array."""
    L, P = start.shape
    gpus_per_node = num_gpus // num_nodes
    item_load = np.take_along_axis(load / logcnt, start, axis=1).reshape(L * num_nodes, gpus_per_node,
                                                                         P // num_gpus)
    origin = improve_by_swaps(item_load, pairs=pairs).reshape(L * num_nodes, -1)
    phy2log = np.take_along_axis(start.reshape(L * num_nodes, -1), origin, axis=1).reshape(L, P)
    if pairs:  # a row whose replica counts force an excess: other counts
        phy2log = recount_rows(load, phy2log, num_nodes, num_gpus, improve_by_swaps)
    return phy2log


class BalancedStart(NamedTuple):
    """:func:`balanced_start`'s plan and DeepSeek's, each with its replica counts."""

    #: int64 [L, P]: the plan the search starts from
    phy2log: np.ndarray
    #: int64 [L, E]: its replica counts
    logcnt: np.ndarray
    #: int64 [L, P]: DeepSeek's own plan (what "balanced" is never worse than)
    deepseek: np.ndarray
    #: int64 [L, E]: DeepSeek's replica counts
    deepseek_logcnt: np.ndarray


def balanced_start(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> BalancedStart:
    """The plan the exchange search starts from: DeepSeek's, except that in hierarchical mode a layer whose groups
    have a packing onto nodes with a lighter heaviest node than DeepSeek's greedy one
    (:func:`fdeplb.placement.node_maps.lightest_maps`, exhaustive; no change when there are too many packings to
    try) gets DeepSeek's steps 2-3 on that packing (:func:`fdeplb.placement.deepseek.place_in_nodes`).

    Returns:
        :class:`BalancedStart`. Inputs must already be checked.
    """
    deepseek, _, logcnt = deepseek_placement(expert_load, num_replicas, num_groups, num_nodes, num_gpus)
    unchanged = BalancedStart(deepseek, logcnt, deepseek, logcnt)
    if num_nodes == 1:
        return unchanged
    load = np.asarray(expert_load, dtype=np.float64)
    E = load.shape[1]
    group_load = group_loads(load, num_groups)
    lighter = lightest_maps(group_load, num_nodes)
    if lighter is None:
        return unchanged
    maps, peak = lighter
    theirs = node_loads(group_nodes(deepseek, num_groups, num_nodes, E // num_groups), group_load, num_nodes)
    rows = np.flatnonzero(peak < theirs.max(axis=1) * (1 - 1e-9))  # strictly lighter, beyond float noise
    if rows.size == 0:
        return unchanged
    pack = maps[rows]
    rank = (np.tri(num_groups, k=-1, dtype=np.int64)[None] * (pack[:, :, None] == pack[:, None, :])).sum(axis=2)
    start, start_logcnt = deepseek.copy(), logcnt.copy()
    start[rows], _, start_logcnt[rows] = place_in_nodes(load[rows], pack, rank, num_replicas, num_nodes, num_gpus)
    return BalancedStart(start, start_logcnt, deepseek, logcnt)
