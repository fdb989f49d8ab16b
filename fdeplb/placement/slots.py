"""Slot bookkeeping between two placements: keep experts in their slot, match GPUs by content."""

from __future__ import annotations

import numpy as np


def align_slots(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder each GPU's slots of ``new_phy2log`` so that an expert that stays on its GPU keeps its old slot.

    GPU contents (and so every metric, including :func:`moved_experts`) are unchanged; only the order of slots
    inside a GPU changes, so fewer slots are rewritten. Returns a new int64 [L, P] array.
    """
    old = np.asarray(old_phy2log)
    out = np.array(new_phy2log, dtype=np.int64, copy=True)
    L, P = out.shape
    S = P // num_gpus
    old3 = old.reshape(L, num_gpus, S)
    new3 = out.reshape(L, num_gpus, S)
    same = old3 == new3
    if same.all():
        return out
    for layer, gpu in zip(*np.nonzero(~same.all(axis=2))):
        o, n = old3[layer, gpu], new3[layer, gpu]
        row = np.full(S, -1, dtype=np.int64)
        pending = list(n)
        for s in range(S):  # first pass: experts found in their old slot's GPU stay put
            if o[s] in pending:
                pending.remove(o[s])
                row[s] = o[s]
        free = np.flatnonzero(row < 0)
        row[free] = pending
        new3[layer, gpu] = row
    return out


def overlap_assignment(overlap: np.ndarray) -> np.ndarray:
    """Permutation ``perm`` maximising ``sum_i overlap[i, perm[i]]`` (scipy's linear_sum_assignment).

    ``overlap[i, j]`` scores placing new bin ``i`` on old bin ``j`` (experts in common). Deterministic: ties resolve
    the way scipy's solver resolves them for identical input.
    """
    from scipy.optimize import linear_sum_assignment  # here, not at import: the CLI starts without scipy

    rows, cols = linear_sum_assignment(overlap, maximize=True)
    perm = np.empty(overlap.shape[0], dtype=np.int64)
    perm[rows] = cols
    return perm


def multiset_overlap(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """``out[i, j]`` = size of the multiset intersection of bin ``a[i]`` and bin ``b[j]`` (int arrays [n, k])."""
    ca = np.zeros((a.shape[0], num_experts), dtype=np.int64)
    cb = np.zeros((b.shape[0], num_experts), dtype=np.int64)
    np.add.at(ca, (np.arange(a.shape[0])[:, None], a), 1)
    np.add.at(cb, (np.arange(b.shape[0])[:, None], b), 1)
    return np.minimum(ca[:, None, :], cb[None, :, :]).sum(axis=2)
