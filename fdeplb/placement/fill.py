"""Replica counts and bulk filling of many rows at once (the uncapped "move_aware" path's fill step).

A row is one layer (global mode) or one node of a layer (hierarchical mode), local expert ids ``0..E-1``, ``-1``
for a slot to fill. :func:`fill_rows` gives every row its replica counts (:func:`choose_counts`, DeepSeek's
replicate rule applied from the old counts) and places the replicas that lost their slot, before the batched repair
(:mod:`fdeplb.placement.repair`) starts. :func:`forced_copies` says how many replicas a row lacks, which decides
whether it is filled in bulk. The per-layer engine's own fill is ``_Row.fill`` (:mod:`fdeplb.placement.row_repair`).
"""

from __future__ import annotations

import numpy as np


# ---- the uncapped path: all (layer, node) rows at once -----------------------------------------------------------
def choose_counts(load: np.ndarray, old_count: np.ndarray, num_slots: int, max_item: np.ndarray) -> np.ndarray:
    """Replica counts int64 [R, En] per row that change ``old_count`` least: every expert gets >= 1, the total is
    ``num_slots``, and replicas move (one at a time, from the expert whose per-replica load rises least to the one
    with the largest per-replica load, DeepSeek's replicate rule) while some per-replica load exceeds ``max_item``
    [R] and the move lowers the largest one. Deterministic: ties take the lowest expert id."""
    R, En = load.shape
    c = np.maximum(old_count, 1).astype(np.int64)
    r = np.arange(R)
    for _ in range(num_slots + 2 * En):
        surplus = c.sum(axis=1) - num_slots
        per = load / c
        drop_cost = np.where(c >= 2, load / np.maximum(c - 1, 1), np.inf)
        give = per.argmax(axis=1)
        take = drop_cost.argmin(axis=1)
        peak = per[r, give]
        shift = (surplus == 0) & (peak > max_item) & (drop_cost[r, take] < peak) & (take != give)
        add = surplus < 0
        sub = surplus > 0
        if not (shift.any() or add.any() or sub.any()):
            break
        c[r[add | shift], give[add | shift]] += 1
        c[r[sub | shift], take[sub | shift]] -= 1
    return c


def _rank_within(keys_major: np.ndarray, *minor: np.ndarray) -> np.ndarray:
    """For [R, n] arrays: the rank of every element among the elements of its row with the same ``keys_major``
    value, ordered by the ``minor`` keys (first is most significant), then by position."""
    R, n = keys_major.shape
    rows = np.broadcast_to(np.arange(R)[:, None], (R, n)).ravel()
    pos = np.broadcast_to(np.arange(n), (R, n)).ravel()
    order = np.lexsort((pos, *[m.ravel() for m in reversed(minor)], keys_major.ravel(), rows))
    grp = rows[order] * (int(keys_major.max(initial=0)) + 2) + keys_major.ravel()[order]
    start = np.r_[True, grp[1:] != grp[:-1]]
    idx = np.arange(order.size)
    first = np.maximum.accumulate(np.where(start, idx, 0))
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = idx - first
    return rank.reshape(R, n)


def fill_rows(old_local: np.ndarray, load: np.ndarray, num_gpus: int, max_item: np.ndarray) -> np.ndarray:
    """Fill the free slots (-1) of many rows (a row = one node of a layer): int64 [R, Pn] local expert ids.

    1. Replica counts: :func:`choose_counts` from the old counts.
    2. Every old replica whose expert keeps that many replicas stays in its slot (an expert with fewer replicas
       keeps those on its lightest GPUs); the other slots are free, and so are the -1 slots.
    3. The replicas without a slot, heaviest first, each go to the lightest GPU with a free slot (LPT).

    Args:
        old_local: int64 [R, Pn] expert of every slot in the old placement (-1: a slot to fill).
        load: float64 [R, En] load of every expert of the row.
        num_gpus: GPUs per row (Pn a multiple of it).
        max_item: float64 [R] per-replica load above which replicas are re-assigned (step 1).
    """
    R, Pn = old_local.shape
    En = load.shape[1]
    G, S = num_gpus, Pn // num_gpus
    r = np.arange(R)
    known = old_local >= 0
    safe_old = np.where(known, old_local, En)  # En: a dummy expert of no load
    old_count = np.zeros((R, En + 1), dtype=np.int64)
    np.add.at(old_count, (r[:, None], safe_old), 1)
    c = choose_counts(load, old_count[:, :En], Pn, max_item)
    per = np.concatenate([load / c, np.zeros((R, 1))], axis=1)
    gpu_of_slot = np.arange(Pn) // S
    # 2. keep
    old_gpu_load = per[r[:, None], safe_old].reshape(R, G, S).sum(axis=2)
    rank = _rank_within(safe_old, old_gpu_load[:, gpu_of_slot])
    c_ext = np.concatenate([c, np.zeros((R, 1), dtype=np.int64)], axis=1)
    kept = known & (rank < c_ext[r[:, None], safe_old])
    row = np.where(kept, old_local, -1)
    kept_count = np.zeros((R, En + 1), dtype=np.int64)
    np.add.at(kept_count, (r[:, None], np.where(kept, old_local, En)), 1)
    need = c - kept_count[:, :En]  # replicas to place, per expert
    # 3. LPT of the replicas without a slot
    n_items = need.sum(axis=1)
    K = int(n_items.max(initial=0))
    if K:
        items = np.full((R, K), -1, dtype=np.int64)
        flat_r = np.repeat(np.repeat(r, En), need.ravel())
        flat_e = np.repeat(np.tile(np.arange(En), R), need.ravel())
        key = np.lexsort((flat_e, -per[flat_r, flat_e], flat_r))
        flat_r, flat_e = flat_r[key], flat_e[key]
        starts = np.cumsum(n_items) - n_items
        items[flat_r, np.arange(flat_r.size) - starts[flat_r]] = flat_e
        gpu_load = per[r[:, None], np.where(kept, old_local, En)].reshape(R, G, S).sum(axis=2)
        free = (row < 0).reshape(R, G, S)
        for j in range(K):
            act = np.flatnonzero(items[:, j] >= 0)
            e = items[act, j]
            fr = free[act]
            g = np.where(fr.any(axis=2), gpu_load[act], np.inf).argmin(axis=1)
            s = fr[np.arange(act.size), g].argmax(axis=1)
            row[act, g * S + s] = e
            free[act, g, s] = False
            gpu_load[act, g] += per[act, e]
    return row


def replica_counts(row: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [R, E + 1]: replicas of every expert in every row of ``row`` int64 [R, P] (local ids 0..E-1); the last
    column counts the -1 slots (slots to fill)."""
    R = row.shape[0]
    E1 = num_experts + 1
    return np.bincount((np.arange(R)[:, None] * E1 + np.where(row < 0, num_experts, row)).ravel(),
                       minlength=R * E1).reshape(R, E1)


def forced_copies(row: np.ndarray, load: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """int64 [R]: replicas the experts of every row need in all so that none has a per-replica load above ``cap``
    float64 [R] (tokens), counted from ``row`` int64 [R, P] (local ids; -1: a slot to fill); ``load`` float64
    [R, E]."""
    E = load.shape[1]
    need = np.ceil(load / np.maximum(cap, np.finfo(np.float64).tiny)[:, None]).astype(np.int64)
    return np.maximum(need - np.maximum(replica_counts(row, E)[:, :E], 1), 0).sum(axis=1)
