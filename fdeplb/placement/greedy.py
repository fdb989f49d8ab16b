"""The "greedy" policy: the flat (topology-unaware) policy of TensorRT-LLM's MoE load balancer.

1. Replica counts: start at one replica per expert, then repeatedly give one more replica to the expert with the
   largest load per replica (ties: lowest expert id). A layer without any load spreads the slots evenly from the
   lowest ids (``P // E`` each, one more for the first ``P % E``).
2. Placement: replicas in descending load per replica (ties: ascending expert id), each onto the least-loaded GPU
   that still has a free slot (ties: lowest rank), filling the GPU's slots in that order.

Arithmetic is float64 (TensorRT-LLM uses double). Groups and nodes are ignored.
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.deepseek import balanced_packing, replicate_experts


def greedy_phy2log(expert_load: np.ndarray, num_replicas: int, num_gpus: int) -> np.ndarray:
    """TensorRT-LLM's flat replication + placement; returns phy2log int64 [L, P]. Inputs must be checked."""
    load = np.asarray(expert_load, dtype=np.float64)
    L, E = load.shape
    _, _, logcnt = replicate_experts(load, num_replicas)
    idle = ~load.any(axis=1)
    if idle.any():
        base, extra = divmod(num_replicas, E)
        logcnt[idle] = base + (np.arange(E) < extra)
    # replicas listed by ascending expert id, so the stable sort inside balanced_packing breaks ties by id
    replica_expert = np.repeat(np.tile(np.arange(E), L), logcnt.ravel()).reshape(L, num_replicas)
    replica_load = np.take_along_axis(load / logcnt, replica_expert, axis=1)
    if num_replicas == num_gpus:  # one slot per GPU: heaviest replica on rank 0 (balanced_packing's identity
        pack = np.empty_like(replica_expert)  # shortcut is DeepSeek's, not TensorRT-LLM's)
        np.put_along_axis(pack, np.argsort(-replica_load, axis=1, kind="stable"), np.arange(num_gpus), axis=1)
        rank = np.zeros_like(pack)
    else:
        pack, rank = balanced_packing(replica_load, num_gpus)
    phy2log = np.empty_like(replica_expert)
    phy2log[np.arange(L)[:, None], pack * (num_replicas // num_gpus) + rank] = replica_expert
    return phy2log
