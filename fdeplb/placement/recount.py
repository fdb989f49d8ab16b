"""Replica counts that spread: re-count the rows whose heaviest GPU holds two replicas of one expert.

DeepSeek's replica counts (each redundant slot to the expert of largest load per replica) minimise the largest
per-replica load but ignore that ``c`` replicas of one expert on ``g`` GPUs put ``ceil(c / g)`` of them on some GPU.
With one expert carrying most of a layer's load that GPU decides the layer: 80% of the load on one expert, 288 slots
on 32 GPUs, DeepSeek gives it 33 replicas and one GPU two of them (max/mean 1.59), where 32 replicas, one per GPU,
give about 1.00. No exchange of replicas between GPUs can fix it (the pigeonhole is in the counts).

:func:`recount_rows` looks at every row (a layer, or in hierarchical mode a node of a layer, whose experts keep all
their replicas inside it) whose heaviest GPU holds more than one replica of an expert. For the heaviest such expert
it tries the counts at the multiples of the row's GPU count on either side of its count, and one less; the slots
freed go to the other experts of the row by DeepSeek's rule (largest load per replica first), the slots needed are
taken from the expert whose load per replica rises least (with at least two replicas). Every candidate is packed as
"balanced" packs (DeepSeek's greedy packing, then its exchange search, passed in: ``improve``); the row takes
the best candidate if it lowers its heaviest GPU, and is looked at again (up to :data:`_ROUNDS` times). Rows without
such a GPU, every row of the real dumps in ``../shared/real_data`` included, are left exactly as they are.
The rule is fdeplb's: DeepSeek's EPLB and the cardinality-constrained P||Cmax literature fix the counts first.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from fdeplb.placement.deepseek import balanced_packing

#: at most this many re-counts per row (each settles the counts of one expert)
_ROUNDS = 4
#: relative gain below which a re-count is not taken (float64 noise)
_RTOL = 1e-12


def _gpu_loads(ids: np.ndarray, per_replica: np.ndarray, gpus: int) -> np.ndarray:
    return per_replica[ids].reshape(gpus, -1).sum(axis=1)


def _shift_counts(load: np.ndarray, counts: np.ndarray, expert: int, target: int) -> np.ndarray | None:
    """``counts`` with ``counts[expert] = target`` and the difference taken from / given to the other experts (see
    the module docstring); None if the others cannot give that many slots."""
    out = counts.copy()
    out[expert] = target
    others = np.arange(counts.size) != expert
    for _ in range(counts[expert] - target):  # freed slots: to the largest load per replica
        gain = np.where(others, load / out, -np.inf)
        out[int(gain.argmax())] += 1
    for _ in range(target - counts[expert]):  # needed slots: from the smallest rise of load per replica
        rise = np.where(others & (out >= 2), load / np.maximum(out - 1, 1), np.inf)
        giver = int(rise.argmin())
        if not np.isfinite(rise[giver]):
            return None
        out[giver] -= 1
    return out


#: the exchange search that finishes a packing: item loads float64 [1, G, S] in place -> origins int64 [1, G, S]
Improve = Callable[[np.ndarray], np.ndarray]


def _pack(experts: np.ndarray, load: np.ndarray, counts: np.ndarray, gpus: int,
          improve: Improve) -> tuple[np.ndarray, float]:
    """Pack the replicas of ``experts`` (their loads ``load``, counts ``counts``) onto ``gpus`` GPUs as "balanced"
    does; returns (expert ids int64 [slots] GPU by GPU, heaviest GPU load)."""
    ids = np.repeat(experts, counts)
    item = np.repeat(load / counts, counts)
    pack, rank = balanced_packing(item[None, :], gpus)
    per = ids.size // gpus
    slot = (pack * per + rank)[0]
    grid_ids = np.empty_like(ids)
    grid_ids[slot] = ids
    grid = np.empty_like(item)
    grid[slot] = item
    origin = improve(grid.reshape(1, gpus, per))[0]
    final = grid_ids[origin.ravel()]
    return final, float(grid[origin.ravel()].reshape(gpus, per).sum(axis=1).max())


def _recount_row(ids: np.ndarray, load: np.ndarray, gpus: int, improve: Improve) -> np.ndarray:
    """One row: expert ids int64 [slots] (GPU by GPU), the layer's expert loads float64 [E]; the row re-counted."""
    for _ in range(_ROUNDS):
        experts, counts = np.unique(ids, return_counts=True)
        per_replica = np.zeros(load.size)
        per_replica[experts] = load[experts] / counts
        gpu = _gpu_loads(ids, per_replica, gpus)
        top = int(gpu.argmax())
        held, times = np.unique(ids.reshape(gpus, -1)[top], return_counts=True)
        doubled = held[times > 1]
        if doubled.size == 0:
            return ids
        hot = int(doubled[np.argmax(per_replica[doubled])])
        at = int(np.searchsorted(experts, hot))
        c = int(counts[at])
        targets = sorted({t for t in ((c // gpus) * gpus, -(-c // gpus) * gpus, c - 1) if 1 <= t != c})
        best, best_peak = None, gpu[top] * (1 - _RTOL)
        for target in targets:
            shifted = _shift_counts(load[experts], counts, at, target)
            if shifted is None:
                continue
            cand, peak = _pack(experts, load[experts], shifted, gpus, improve)
            if peak < best_peak:
                best, best_peak = cand, peak
        if best is None:
            return ids
        ids = best
    return ids


def recount_rows(load: np.ndarray, phy2log: np.ndarray, num_nodes: int, num_gpus: int,
                 improve: Improve) -> np.ndarray:
    """Re-count the rows whose heaviest GPU holds two replicas of one expert (see the module docstring).

    Args:
        load: float64 [L, E] expert_load.
        phy2log: int64 [L, P] a plan whose experts keep all their replicas inside one node (DeepSeek's and
            "balanced"'s do); P a multiple of ``num_gpus``, ``num_gpus`` a multiple of ``num_nodes``.
        num_nodes, num_gpus: the plan's topology (1 node: global).
        improve: the exchange search that finishes each candidate's packing ("balanced"'s
            :func:`~fdeplb.placement.balanced.improve_by_swaps`, which imports this module).

    Returns:
        int64 [L, P]: ``phy2log`` with those rows replaced where that lowers the row's heaviest GPU; a new array,
        equal to ``phy2log`` when no row has such a GPU. Deterministic.
    """
    L, P = phy2log.shape
    gpn, S = num_gpus // num_nodes, P // num_gpus
    rows = phy2log.reshape(L * num_nodes, gpn, S)
    per_replica = load[:, None, :].repeat(num_nodes, axis=1).reshape(L * num_nodes, -1)
    counts = np.zeros_like(per_replica)
    np.add.at(counts, (np.arange(L * num_nodes)[:, None], rows.reshape(L * num_nodes, -1)), 1.0)
    per_replica = per_replica / np.maximum(counts, 1.0)
    r = np.arange(L * num_nodes)
    item = per_replica[r[:, None, None], rows]
    top = item.sum(axis=2).argmax(axis=1)
    on_top = np.sort(rows[r, top], axis=1)
    doubled = (on_top[:, 1:] == on_top[:, :-1]).any(axis=1)
    out = rows.copy()
    for row in np.nonzero(doubled)[0]:
        out[row] = _recount_row(rows[row].ravel(), load[row // num_nodes], gpn, improve).reshape(gpn, S)
    return out.reshape(L, P)
