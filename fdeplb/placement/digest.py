"""The plan_id: a content hash of everything a plan is computed from."""

from __future__ import annotations

import hashlib
import json

import numpy as np


def plan_digest(expert_load: np.ndarray, old_phy2log: np.ndarray, policy: str, topology: dict[str, int]) -> str:
    """Content hash of (load snapshot, old placement, policy, topology): the plan_id, 16 hex digits.

    ``expert_load`` int64 [L, E] and ``old_phy2log`` int64 [L, P] are hashed with their dtype and shape, so the
    same plan_id always means the same inputs; placement is deterministic, so it also means the same plan.
    """
    h = hashlib.sha256()
    for arr in (np.ascontiguousarray(expert_load), np.ascontiguousarray(old_phy2log)):
        h.update(arr.dtype.str.encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    h.update(policy.encode())
    h.update(json.dumps(topology, sort_keys=True).encode())
    return h.hexdigest()[:16]


def routing_digest(phy2log: np.ndarray) -> str:
    """Digest of the routing tables a rank holds: sha256 (16 hex digits) of ``phy2log`` as int64 [L, P] (shape
    and bytes); ``log2phy`` and ``logcnt`` derive from it, so it names all three.

    Two ranks (or a rank and the cluster's placement) with the same digest dispatch every token the same way;
    dispatch maps that differ across ranks cause silent accuracy loss (SGLang #32962).
    """
    arr = np.ascontiguousarray(phy2log, dtype=np.int64)
    h = hashlib.sha256(b"fdeplb-routing-v1")
    h.update(repr(arr.shape).encode())
    h.update(arr.tobytes())
    return h.hexdigest()[:16]
