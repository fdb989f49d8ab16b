"""The "balanced" policy: DeepSeek's plan improved by pairwise-swap local search.

Starts from DeepSeek's placement (hierarchical or global, same rule), keeps its replica counts and, in hierarchical
mode, its group-to-node packing, and swaps replicas between GPUs of the same node while that lowers the heaviest
GPU (or, once the heaviest GPU is stuck, raises the lightest one, which frees new swaps for the heaviest). A swap
keeps every GPU at exactly P / num_gpus slots. Every accepted swap strictly lowers the sum of squared GPU loads and
never raises the maximum, so the search ends and the result is never worse than "deepseek" on any layer.

The search runs on all (layer, node) rows at once; each iteration evaluates every swap of the chosen GPU with every
other slot of the node in one numpy expression ([rows, slots_per_gpu, slots_per_node]).
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.deepseek import deepseek_phy2log
from fdeplb.placement.metrics import raw_gpu_loads

#: relative gain below which a swap is not worth it (float64 noise on loads of ~1e8 tokens)
_RTOL = 1e-12
#: hard cap on iterations (each moves one swap per active row); real dumps converge in < 100
_MAX_ITER = 10_000


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


def improve_by_swaps(item_load: np.ndarray) -> np.ndarray:
    """Swap local search on ``item_load`` float64 [R, G, S] (R rows, G packs of S items); modified in place.

    Returns:
        int64 [R, G, S]: for every final position, the flat index ``g * S + s`` of the item's starting position.
    """
    R, G, S = item_load.shape
    origin = np.broadcast_to(np.arange(G * S, dtype=np.int64).reshape(G, S), (R, G, S)).copy()
    if G < 2:
        return origin
    gpu_load = item_load.sum(axis=-1)
    active = np.arange(R)
    on_min = np.zeros(R, dtype=bool)  # row works on its lightest GPU (its heaviest one is stuck)
    max_stuck = np.zeros(R, dtype=bool)
    for _ in range(_MAX_ITER):
        if active.size == 0:
            break
        still = []
        for lightest in (False, True):
            rows = active[on_min[active] == lightest]
            if rows.size == 0:
                continue
            if lightest:  # raising the lightest GPU = lowering the heaviest of the negated problem
                ga, sa, gb, sb, gain, scale = _best_swaps(-item_load, -gpu_load, rows)
            else:
                ga, sa, gb, sb, gain, scale = _best_swaps(item_load, gpu_load, rows)
            ok = gain > scale * _RTOL
            r, ga, sa, gb, sb = rows[ok], ga[ok], sa[ok], gb[ok], sb[ok]
            x, y = item_load[r, ga, sa], item_load[r, gb, sb]
            item_load[r, ga, sa], item_load[r, gb, sb] = y, x
            origin[r, ga, sa], origin[r, gb, sb] = origin[r, gb, sb], origin[r, ga, sa]
            gpu_load[r, ga] += y - x
            gpu_load[r, gb] += x - y
            failed = rows[~ok]
            if lightest:  # a raise succeeded: back to the heaviest GPU; a failed raise ends the row
                on_min[r] = False
                still.append(r)
            else:  # the heaviest GPU stuck: try raising the lightest, unless that already failed to help
                done = failed[max_stuck[failed]]
                max_stuck[failed] = True
                max_stuck[r] = False
                on_min[failed] = True
                still.append(np.setdiff1d(rows, done))
        active = np.sort(np.concatenate(still)) if still else active[:0]
    return origin


def balanced_phy2log(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """DeepSeek's plan (``num_groups``/``num_nodes`` as given: pass 1/1 for global) improved by swaps within nodes.

    Returns phy2log int64 [L, P]. Inputs must already be checked.
    """
    return balanced_plan(expert_load, num_replicas, num_groups, num_nodes, num_gpus)[0]


def balanced_plan(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`balanced_phy2log` and the load of its heaviest GPU per layer: (phy2log int64 [L, P], float64 [L]
    tokens), the peak computed once here for callers that need it ("move_aware")."""
    start, logcnt = deepseek_phy2log(expert_load, num_replicas, num_groups, num_nodes, num_gpus)
    load = np.asarray(expert_load, dtype=np.float64)
    L, P = start.shape
    gpus_per_node = num_gpus // num_nodes
    S = P // num_gpus
    per_replica = load / logcnt
    item_load = np.take_along_axis(per_replica, start, axis=1).reshape(L * num_nodes, gpus_per_node, S)
    origin = improve_by_swaps(item_load).reshape(L * num_nodes, -1)
    phy2log = np.take_along_axis(start.reshape(L * num_nodes, -1), origin, axis=1).reshape(L, P)
    # never worse than DeepSeek on any layer (guards against float drift of the incremental loads)
    before = raw_gpu_loads(load, start, num_gpus).max(axis=1)
    after = raw_gpu_loads(load, phy2log, num_gpus).max(axis=1)
    better = after <= before
    return np.where(better[:, None], phy2log, start), np.where(better, after, before)
