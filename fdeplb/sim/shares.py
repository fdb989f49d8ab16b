"""Simulated per-rank expert_load windows drawn from a real expert-load dump.

A real DP rank records the tokens it routed; here every rank's window is its share of a recorded trace: each
(layer, expert) count is split across the ranks by a multinomial draw with a fixed seed, so the ranks' windows sum
exactly to the trace and every process computes the same split without talking to the others.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError


def integral_load(expert_load: np.ndarray) -> np.ndarray:
    """``expert_load`` as int64 (the dumps store counts as floats); refuses non-integral or negative values."""
    arr = np.asarray(expert_load, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or (arr < 0).any():
        raise InputError("expert_load must be finite and non-negative")
    rounded = np.rint(arr)
    if not np.array_equal(rounded, arr):
        raise InputError("expert_load must hold whole token counts to be split across ranks")
    return rounded.astype(np.int64)


def rank_share(expert_load: np.ndarray, ep_rank: int, ep_size: int, seed: int = 0) -> np.ndarray:
    """Rank ``ep_rank``'s window: int64 [L, E]; the windows of ranks 0..ep_size-1 sum to ``expert_load``."""
    counts = integral_load(expert_load)
    if not 0 <= ep_rank < ep_size:
        raise InputError(f"ep_rank {ep_rank} outside [0, {ep_size})")
    rng = np.random.default_rng(seed)
    split = rng.multinomial(counts, np.full(ep_size, 1.0 / ep_size))  # [L, E, ep_size]
    return np.ascontiguousarray(split[..., ep_rank], dtype=np.int64)
