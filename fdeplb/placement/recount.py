"""Replica counts that spread: re-count the rows whose heaviest GPU holds two replicas of replicated experts.

DeepSeek's replica counts (each redundant slot to the expert of largest load per replica) minimise the largest
per-replica load but ignore that ``c`` replicas of one expert on ``g`` GPUs put ``ceil(c / g)`` of them on some GPU.
With one expert carrying most of a layer's load that GPU decides the layer: 80% of the load on one expert, 288 slots
on 32 GPUs, DeepSeek gives it 33 replicas and one GPU two of them (max/mean 1.59), where 32 replicas, one per GPU,
give about 1.00. No exchange of replicas between GPUs can fix it (the pigeonhole is in the counts).

:func:`recount_rows` looks at every row (a layer, or in hierarchical mode a node of a layer, whose experts keep all
their replicas inside it) where the counts force an excess (:func:`forced_peak`: some GPU must hold ``k + 1`` of the
``k g + 1`` heaviest replicas on ``g`` GPUs) more than :data:`_SLACK` above the bound no counts beat (the row's mean GPU load, or its
largest load per replica at DeepSeek's counts), as is its heaviest GPU. It re-counts together the row's one, two, ... :data:`_GROUP` replicated experts of largest
load per replica (and, alone, each replicated expert of the heaviest GPU): their replicas in all go to the
multiples of the row's GPU count on either side of what they hold, or one less, dealt among them by DeepSeek's rule;
the slots freed go to the other experts of the row by that rule (largest load per replica first), the slots needed
are taken from the expert whose load per replica rises least (with at least two replicas). Two experts with 40% of
the load each: DeepSeek gives them 17 + 17 replicas for 32 GPUs (1.54), 16 + 16 give one on every GPU (1.00).
Every candidate is packed as "balanced" packs (DeepSeek's greedy packing, then its exchange search, passed in:
``improve``); the row takes the best candidate if it lowers its heaviest GPU, and is looked at again (up to
:data:`_ROUNDS` times). The plans of the real dumps in ``../shared/real_data`` stay exactly as they were (checked
on every dump at the placement tests' topologies: none of their rows gains from a re-count).

The rule is fdeplb's: DeepSeek's EPLB and the cardinality-constrained P||Cmax literature fix the counts first.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from fdeplb.placement.deepseek import balanced_packing, replicate_experts
from fdeplb.placement.fill import replica_counts

#: at most this many re-counts per row (each settles the counts of one group of experts)
_ROUNDS = 4
#: relative gain below which a re-count is not taken (float64 noise)
_RTOL = 1e-12
#: the row's replicated experts of largest load per replica re-counted together: one, two, ... this many
_GROUP = 3
#: a row is looked at only when its forced load (:func:`forced_peak`) and its heaviest GPU are this share above the
#: bound no counts beat (the mean, or the largest load per replica at DeepSeek's counts); no real dump's row is
_SLACK = 1e-3


def _gpu_loads(ids: np.ndarray, per_replica: np.ndarray, gpus: int) -> np.ndarray:
    """float64 [gpus]: the load of every GPU of a row of expert ids int64 [slots] (GPU by GPU)."""
    return per_replica[ids].reshape(gpus, -1).sum(axis=1)


def _counts_for(load: np.ndarray, counts: np.ndarray, chosen: np.ndarray, total: int) -> np.ndarray | None:
    """``counts`` with the ``chosen`` experts (indexes) holding ``total`` replicas between them, dealt by DeepSeek's
    rule (each at least one, then each slot to the largest load per replica), and the difference taken from / given
    to the other experts (see the module docstring); None if that cannot be done."""
    k = chosen.size
    if total < k:
        return None
    out = counts.copy()
    out[chosen] = 1
    for _ in range(total - k):
        best = chosen[int(np.argmax(load[chosen] / out[chosen]))]
        out[best] += 1
    others = np.ones(counts.size, dtype=bool)
    others[chosen] = False
    for _ in range(int(counts[chosen].sum()) - total):  # freed slots: to the largest load per replica
        gain = np.where(others, load / out, -np.inf)
        out[int(gain.argmax())] += 1
    for _ in range(total - int(counts[chosen].sum())):  # needed slots: from the smallest rise of load per replica
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
        on_top = np.unique(ids.reshape(gpus, -1)[top])
        at_top = np.searchsorted(experts, on_top[counts[np.searchsorted(experts, on_top)] > 1])
        if at_top.size == 0:
            return ids
        replicated = np.flatnonzero(counts > 1)  # indexes into experts, heaviest replica first
        replicated = replicated[np.argsort(-(load[experts] / counts)[replicated], kind="stable")]
        sets = [replicated[:k] for k in range(1, min(replicated.size, _GROUP) + 1)] + [at_top[i:i + 1] for i in
                                                                                     range(at_top.size)]
        best, best_peak = None, gpu[top] * (1 - _RTOL)
        for chosen in sets:
            held = int(counts[chosen].sum())
            totals = {(held // gpus) * gpus, -(-held // gpus) * gpus, held - 1}
            for total in sorted(t for t in totals if t != held):
                shifted = _counts_for(load[experts], counts, chosen, total)
                if shifted is None:
                    continue
                cand, peak = _pack(experts, load[experts], shifted, gpus, improve)
                if peak < best_peak:
                    best, best_peak = cand, peak
        if best is None:
            return ids
        ids = best
    return ids


def forced_peak(item: np.ndarray, gpus: int) -> np.ndarray:
    """float64 [R]: a load some GPU of every row must reach at these replica counts, ``item`` float64 [R, gpus * S]
    the replicas' loads: for every k < S, some GPU holds k + 1 of the k * gpus + 1 heaviest replicas (pigeonhole) and
    S - k - 1 others, so at least the k + 1 lightest of those and the S - k - 1 lightest replicas of the row; the
    largest over k."""
    R, n = item.shape
    S = n // gpus
    ordered = np.sort(item, axis=1)
    smallest = np.concatenate([np.zeros((R, 1)), np.cumsum(ordered, axis=1)], axis=1)  # sum of the j lightest
    out = np.zeros(R)
    for k in range(1, S):
        first = n - k * gpus - 1  # the (k * gpus + 1)-th heaviest, ascending index
        forced = smallest[:, first + k + 1] - smallest[:, first] + smallest[:, S - k - 1]
        out = np.maximum(out, forced)
    return out


def recount_rows(load: np.ndarray, phy2log: np.ndarray, num_nodes: int, num_gpus: int,
                 improve: Improve) -> np.ndarray:
    """Re-count the rows whose heaviest GPU holds two replicas of replicated experts (see the module docstring).

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
    counts = replica_counts(rows.reshape(L * num_nodes, -1), load.shape[1])[:, :-1]
    per_replica = np.repeat(load, num_nodes, axis=0) / np.maximum(counts, 1)
    r = np.arange(L * num_nodes)
    item = per_replica[r[:, None, None], rows].reshape(L * num_nodes, -1)
    gpu = item.reshape(L * num_nodes, gpn, S).sum(axis=2)
    peak = gpu.max(axis=1)
    out = rows.copy()
    if S < 2:  # one replica per GPU: nothing is forced
        return out.reshape(L, P)
    heaviest = forced_peak(item, gpn)
    for row in np.nonzero(heaviest > gpu.mean(axis=1) * (1 + _SLACK))[0]:
        layer_load = load[row // num_nodes]
        ids = rows[row].ravel()
        experts = np.unique(ids)
        least = replicate_experts(layer_load[experts][None, :], ids.size)[2][0]  # DeepSeek's counts
        bound = max(gpu[row].mean(), float((layer_load[experts] / least).max()))
        if min(peak[row], heaviest[row]) > bound * (1 + _SLACK):
            out[row] = _recount_row(ids, layer_load, gpn, improve).reshape(gpn, S)
    return out.reshape(L, P)
