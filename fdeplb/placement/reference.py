"""Plain-Python-loop DeepSeek EPLB: one layer at a time, lists and scalars, no vectorisation.

Written from the algorithm's description to cross-check :mod:`fdeplb.placement.deepseek` (the tests compare the
two on every real dump) and as the speed reference of ``benchmarks/placement.py``. It uses the same float32
arithmetic (numpy float32 scalars) and the same tie rules, so both give the same phy2log. Not for production use.
"""

from __future__ import annotations

import numpy as np


def _pack(loads: list, num_packs: int) -> list[tuple[int, int]]:
    """(pack, rank in pack) of every item: heaviest first (stable), into the lightest pack with room."""
    n = len(loads)
    per_pack = n // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(n)]
    order = sorted(range(n), key=lambda i: -loads[i])  # Python's sort is stable
    pack_load = [np.float32(0.0)] * num_packs
    pack_items = [0] * num_packs
    out = [(-1, -1)] * n
    for item in order:
        best = -1
        for p in range(num_packs):
            if pack_items[p] < per_pack and (best < 0 or pack_load[p] < pack_load[best]):
                best = p
        out[item] = (best, pack_items[best])
        pack_load[best] = np.float32(pack_load[best] + loads[item])
        pack_items[best] += 1
    return out


def _replicate(loads: list, num_phy: int) -> tuple[list[int], list[int]]:
    """(expert of every slot, replica count of every expert): extra slots to the largest load per replica."""
    num_log = len(loads)
    slots = list(range(num_log))
    count = [1] * num_log
    for _ in range(num_log, num_phy):
        best = 0
        best_val = np.float32(loads[0] / np.float32(count[0]))
        for e in range(1, num_log):
            val = np.float32(loads[e] / np.float32(count[e]))
            if val > best_val:
                best, best_val = e, val
        slots.append(best)
        count[best] += 1
    return slots, count


def deepseek_reference(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """DeepSeek's policy, layer by layer in plain Python; returns phy2log int64 [L, P].

    Applies the hierarchical/global rule itself (``num_groups % num_nodes``); inputs must be valid.
    """
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    load32 = np.asarray(expert_load).astype(np.float32)
    L, E = load32.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    out = np.empty((L, num_replicas), dtype=np.int64)
    for layer in range(L):
        row = [np.float32(v) for v in load32[layer]]
        group_loads = [
            np.float32(sum(float(v) for v in row[g * group_size : (g + 1) * group_size])) for g in range(num_groups)
        ]
        # experts of each node, in the order of the groups packed onto it
        node_experts: list[list[int]] = [[] for _ in range(num_nodes)]
        for rank in range(groups_per_node):
            for g, (node, r) in enumerate(_pack(group_loads, num_nodes)):
                if r == rank:
                    node_experts[node].extend(range(g * group_size, (g + 1) * group_size))
        for node, experts in enumerate(node_experts):
            node_loads = [row[e] for e in experts]
            slots, count = _replicate(node_loads, slots_per_node)
            replica_loads = [np.float32(node_loads[i] / np.float32(count[i])) for i in slots]
            base = node * slots_per_node
            for slot, (gpu, r) in enumerate(_pack(replica_loads, gpus_per_node)):
                out[layer, base + gpu * slots_per_gpu + r] = experts[slots[slot]]
    return out
