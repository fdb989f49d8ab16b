"""Where every row of the batched repair stops, and the rows rebuilt at those stops.

:func:`fdeplb.placement.repair.repair_rows` records every row's trajectory (moved experts, heaviest GPU after each
of its actions) and a log of the actions it applied. :func:`choose_stops` picks one point per row so that the
total moved experts is least under the tolerance bounds of the uncapped "move_aware" policy (a Lagrangian
relaxation over all points); :func:`choose_within_budget` picks one candidate point per layer so that the summed
excess is least under a budget of moved experts (the capped policy's Pareto option, exactly), with
:func:`block_candidates` turning the trajectories of a layer's node rows (hierarchical mode) into such candidates,
and :func:`replay_stops` replays the log up to the chosen points.
"""

from __future__ import annotations

import numpy as np


def replay_stops(start: np.ndarray, log: list, stops: np.ndarray) -> np.ndarray:
    """The rows of :func:`fdeplb.placement.repair.repair_rows` stopped after ``stops[r]`` iterations (0:
    ``start``); int64 [R, P]. ``log`` is its action log, ``stops`` int64 [R] (:func:`choose_stops`)."""
    out = start.copy()
    t = 0
    for entry in log:
        if entry is None:
            t += 1
            continue
        rr, kind, i, j = entry
        sel = t < stops[rr]
        rr, i, j = rr[sel], i[sel], j[sel]
        if kind == 0:
            out[rr, i], out[rr, j] = out[rr, j], out[rr, i]
        else:
            out[rr, i] = j
    return out


def choose_stops(points: list, row_layer: np.ndarray, fresh_peak: np.ndarray, mean: np.ndarray, tolerance: float,
                 layer_cap: float, *, replanned_at_tolerance: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Where to stop every row so that moved experts are fewest with the mean excess over layers within tolerance.

    A layer's excess at a stop is ``(max over its rows of the heaviest GPU - fresh_peak) / mean``. Minimises the
    sum of moved experts subject to: mean excess over layers <= ``tolerance``, and every layer <= ``layer_cap``
    (absolute, same unit) when it can get there; with ``replanned_at_tolerance`` a layer that cannot counts at
    ``tolerance`` in the mean (the caller plans it again within one tolerance), else at the least it reaches.
    Solved by a Lagrangian relaxation (bisection on the price of one unit of excess in moved experts) over every
    point of the rows' trajectories.

    Args:
        points: :func:`fdeplb.placement.repair.repair_rows`'s trajectories.
        row_layer: int64 [R] layer of every row (rows of a layer are contiguous, in node order).
        fresh_peak, mean: float64 [L] the "balanced" plan's heaviest GPU and the mean GPU load of every layer.
        tolerance, layer_cap: floats >= 0.

    Returns:
        (stops int64 [R]: iterations to replay per row, excess float64 [L] of every layer at those stops).
    """
    R = row_layer.size
    L = fresh_peak.size
    rows = np.concatenate([p[0] for p in points])
    it = np.concatenate([np.full(p[0].size, t, dtype=np.int64) for t, p in enumerate(points)])
    mv = np.concatenate([p[1] for p in points])
    layer = row_layer[rows]
    exc = (np.concatenate([p[2] for p in points]) - fresh_peak[layer]) / mean[layer]
    # every row's points by excess; moves_r(level) = fewest moves among points with excess <= level
    order = np.lexsort((it, exc, rows))
    rows_s, exc_s, mv_s = rows[order], exc[order], mv[order]
    seg = np.searchsorted(rows_s, np.arange(R))  # first point of every row
    big = int(mv.max(initial=0)) + 1
    prefmin = np.minimum.accumulate(mv_s - rows_s * big) + rows_s * big
    span = float(max(np.abs(exc).max(initial=0.0), 1.0)) * 4 + 4
    key_s = rows_s * span + exc_s  # increasing: rows apart by more than any excess difference
    nodes = R // L
    # candidate levels of a layer: every point of its rows
    cand_layer, cand_exc = layer, exc
    r_of = cand_layer[:, None] * nodes + np.arange(nodes)  # [N, nodes] rows of the candidate's layer
    pos = np.searchsorted(key_s, r_of * span + cand_exc[:, None], side="right") - 1
    feasible = pos >= seg[r_of]
    cost = np.where(feasible, prefmin[np.maximum(pos, 0)], big * R).sum(axis=1).astype(np.float64)
    ok = feasible.all(axis=1)
    # pad candidates into [L, K]
    by_layer = np.lexsort((cand_exc, cand_layer))
    cl = cand_layer[by_layer]
    start = np.searchsorted(cl, np.arange(L))
    col = np.arange(cl.size) - start[cl]
    K = int(col.max(initial=0)) + 1
    C = np.full((L, K), np.inf)
    X = np.full((L, K), np.inf)
    C[cl, col] = np.where(ok[by_layer], cost[by_layer], np.inf)
    X[cl, col] = cand_exc[by_layer]
    within = X <= layer_cap
    reach = np.where(np.isfinite(C), X, np.inf).min(axis=1)  # lowest excess a layer can reach
    # a layer that cannot get within the cap is planned again by the caller, ending within one tolerance: it
    # counts at the tolerance in the mean (not at its reach, which would push every other layer lower)
    stuck = (reach > layer_cap) & replanned_at_tolerance

    allowed = np.where(within | (X <= reach[:, None]), C, np.inf)  # every allowed X is finite

    def pick(price):
        return (allowed + price * X).argmin(axis=1)

    def mean_excess(c):
        return np.where(stuck, tolerance, X[np.arange(L), c]).mean()

    lo, hi = 0.0, float(big * R) / max(tolerance, 1e-12) * 4 + 1.0
    choice = pick(hi)
    if mean_excess(choice) <= tolerance:
        for _ in range(48):
            mid = 0.5 * (lo + hi)
            c = pick(mid)
            if mean_excess(c) <= tolerance:
                hi, choice = mid, c
            else:
                lo = mid
    level = X[np.arange(L), choice]
    # every row: its point with fewest moves (then earliest) at or under its layer's level
    pt_ok = exc <= level[layer] + 1e-15
    pick_pt = np.lexsort((it, mv, ~pt_ok, rows))
    first = pick_pt[np.searchsorted(rows[pick_pt], np.arange(R))]
    return it[first], level


def choose_within_budget(layer: np.ndarray, moves: np.ndarray, excess: np.ndarray, num_layers: int,
                         budget: int) -> np.ndarray:
    """One candidate per layer so that the sum of excess is least with at most ``budget`` moves in all: the
    multiple-choice knapsack, solved exactly by dynamic programming over the integer budget (H. Kellerer, U. Pferschy,
    D. Pisinger, "Knapsack Problems", Springer 2004, ch. 11, the multiple-choice knapsack problem).

    Unlike the Lagrangian relaxation of :func:`choose_stops` (Everett 1963), which only reaches the vertices of
    the layers' lower convex hulls and leaves the budget between two of them unspent, the table ``best[b]`` (least
    sum over the layers so far with at most ``b`` moves) is optimal at every budget, hence non-increasing in it: a
    larger budget never gives a larger sum. Only each layer's Pareto-efficient candidates (fewer moves, or less
    excess than every candidate with as few) enter the table. Cost O(L x B x K), B = min(budget, the most moves
    any choice needs), K = efficient candidates per layer.

    Args:
        layer: int64 [N] layer of every candidate (every layer needs one with ``moves`` <= ``budget``, e.g. its
            old placement at 0 moves).
        moves: int64 [N] moved experts of every candidate, >= 0.
        excess: float64 [N] what the candidate adds to the sum (finite).
        num_layers: L.
        budget: moves allowed in all, >= 0.

    Returns:
        int64 [L]: the index (into the candidate arrays) chosen for every layer. Deterministic: among candidates
        with equal moves, the least excess, then the lowest index; among table entries of equal value, the
        candidate with fewer moves.

    Raises:
        ValueError: a layer has no candidate within ``budget``.
    """
    N = layer.size
    order = np.lexsort((np.arange(N), excess, moves, layer))
    starts = np.searchsorted(layer[order], np.arange(num_layers + 1))
    efficient = []
    for l in range(num_layers):
        idx = order[starts[l]:starts[l + 1]]  # by moves, then excess
        if idx.size == 0 or moves[idx[0]] > budget:
            raise ValueError(f"choose_within_budget: layer {l} has no candidate within {budget} moves")
        ex = excess[idx]
        keep = np.ones(idx.size, dtype=bool)
        keep[1:] = ex[1:] < np.minimum.accumulate(ex)[:-1]  # strictly below every candidate with as few moves
        efficient.append(idx[keep & (moves[idx] <= budget)])
    B = int(min(budget, sum(int(moves[e].max()) for e in efficient)))
    b = np.arange(B + 1)
    best = np.zeros(B + 1)  # no layer yet: 0 at every budget
    choice = np.empty((num_layers, B + 1), dtype=np.int64)
    for l, eff in enumerate(efficient):
        src = b[None, :] - moves[eff][:, None]  # [K, B + 1] budget left for the layers before
        val = np.where(src >= 0, best[np.maximum(src, 0)] + excess[eff][:, None], np.inf)
        k = val.argmin(axis=0)  # first minimum: the candidate with fewer moves
        choice[l] = eff[k]
        best = val[k, b]
    out = np.empty(num_layers, dtype=np.int64)
    left = B
    for l in range(num_layers - 1, -1, -1):
        out[l] = choice[l, left]
        left -= int(moves[out[l]])
    return out


def block_candidates(points: list, rows_per_block: int, ref_peak: np.ndarray,
                     mean: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate stops of blocks of rows (``rows_per_block`` consecutive rows of
    :func:`fdeplb.placement.repair.repair_rows`, e.g. the node rows of one layer under one start): every point of a
    block's rows sets a level (its excess, ``(peak - ref_peak) / mean`` of the block); at that level every row of the
    block stops at its point with fewest moved experts (then least excess, then earliest) whose excess is at most
    the level. A level some row of the block cannot meet gives no candidate.

    Args:
        points: :func:`fdeplb.placement.repair.repair_rows`'s trajectories of R rows.
        rows_per_block: rows per block (R a multiple of it).
        ref_peak, mean: float64 [R / rows_per_block] tokens (``mean`` > 0): the reference heaviest GPU and the mean
            GPU load of every block.

    Returns:
        (block int64 [N], moves int64 [N]: summed over the block's rows, excess float64 [N]: the largest of its
        rows', stops int64 [N, rows_per_block]: iterations to replay per row, for :func:`replay_stops`).
        Deterministic; candidates may repeat.
    """
    R = points[0][0].size
    rows = np.concatenate([p[0] for p in points])
    it = np.concatenate([np.full(p[0].size, t, dtype=np.int64) for t, p in enumerate(points)])
    mv = np.concatenate([p[1] for p in points]).astype(np.int64)
    blk = rows // rows_per_block
    exc = (np.concatenate([p[2] for p in points]) - ref_peak[blk]) / mean[blk]
    order = np.lexsort((it, exc, rows))  # every row's points by excess, then iteration
    rows_s, exc_s, mv_s, it_s = rows[order], exc[order], mv[order], it[order]
    N = order.size
    seg = np.searchsorted(rows_s, np.arange(R))  # first point of every row
    big = int(mv.max(initial=0)) + 1
    # best[i]: the point with fewest moves (then first in this order) among its row's points up to i
    key = (mv_s - rows_s * big) * N + np.arange(N)  # later rows below earlier ones: the running min restarts
    best = np.mod(np.minimum.accumulate(key), N)
    span = float(max(np.abs(exc).max(initial=0.0), 1.0)) * 4 + 4
    key_s = rows_s * span + exc_s  # increasing: rows apart by more than any excess difference
    r_of = (rows_s // rows_per_block)[:, None] * rows_per_block + np.arange(rows_per_block)  # [N, n]
    pos = np.searchsorted(key_s, r_of * span + exc_s[:, None], side="right") - 1
    ok = (pos >= seg[r_of]).all(axis=1)
    at = best[np.maximum(pos[ok], 0)]  # [N', n] the rows' points at every feasible level
    return rows_s[ok] // rows_per_block, mv_s[at].sum(axis=1), exc_s[at].max(axis=1), it_s[at]
