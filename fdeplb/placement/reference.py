"""Plain-Python-loop DeepSeek EPLB: one layer at a time, lists and scalars, no vectorisation.

Written from the algorithm's description to cross-check :mod:`fdeplb.placement.deepseek` (the tests compare the
two on every real dump) and as the speed reference of ``benchmarks/placement.py``. It uses the same float32
arithmetic (numpy float32 scalars) and the same tie rules, so both give the same phy2log. The descending sort of
``balanced_packing`` is a line-by-line port of libstdc++'s ``std::sort`` (what ``torch.sort`` runs on CPU), written
independently of the vectorised closed form in :mod:`fdeplb.placement.deepseek`. Not for production use.
"""

from __future__ import annotations

import numpy as np


def _std_sort_desc(keys: list) -> list[int]:
    """Indices of ``keys`` in the order libstdc++'s ``std::sort`` leaves (key, index) pairs, ``comp = a.key > b.key``.

    Introsort (depth limit 2 * floor(log2 n), median of three to the front, unguarded partition, heap sort when the
    depth runs out) down to segments of 16, then insertion sort of the first 16 and unguarded insertion of the rest.
    """
    a = [(k, i) for i, k in enumerate(keys)]

    def gt(x, y) -> bool:
        return x[0] > y[0]

    def sift(lo: int, hole: int, length: int, value) -> None:  # std::__adjust_heap + std::__push_heap
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if gt(a[lo + child], a[lo + child - 1]):
                child -= 1
            a[lo + hole] = a[lo + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            a[lo + hole] = a[lo + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and gt(a[lo + parent], value):
            a[lo + hole] = a[lo + parent]
            hole = parent
            parent = (hole - 1) // 2
        a[lo + hole] = value

    def heap_sort(lo: int, hi: int) -> None:  # std::__partial_sort(lo, hi, hi)
        length = hi - lo
        if length >= 2:
            parent = (length - 2) // 2
            while True:
                sift(lo, parent, length, a[lo + parent])
                if parent == 0:
                    break
                parent -= 1
        while hi - lo > 1:
            hi -= 1
            value = a[hi]
            a[hi] = a[lo]
            sift(lo, 0, hi - lo, value)

    def introsort(lo: int, hi: int, depth: int) -> None:
        while hi - lo > 16:
            if depth == 0:
                heap_sort(lo, hi)
                return
            depth -= 1
            mid = lo + (hi - lo) // 2
            x, y, z = lo + 1, mid, hi - 1
            if gt(a[x], a[y]):
                m = y if gt(a[y], a[z]) else (z if gt(a[x], a[z]) else x)
            else:
                m = x if gt(a[x], a[z]) else (z if gt(a[y], a[z]) else y)
            a[lo], a[m] = a[m], a[lo]
            first, last = lo + 1, hi
            while True:
                while gt(a[first], a[lo]):
                    first += 1
                last -= 1
                while gt(a[lo], a[last]):
                    last -= 1
                if not first < last:
                    break
                a[first], a[last] = a[last], a[first]
                first += 1
            introsort(first, hi, depth)
            hi = first

    def insert(i: int, guarded: bool) -> None:
        value = a[i]
        if guarded and gt(value, a[0]):
            a[1 : i + 1] = a[0:i]
            a[0] = value
            return
        while gt(value, a[i - 1]):
            a[i] = a[i - 1]
            i -= 1
        a[i] = value

    n = len(a)
    if n:
        introsort(0, n, 2 * (n.bit_length() - 1))
        for i in range(1, n):
            insert(i, guarded=i < 16)
    return [i for _, i in a]


def _pack(loads: list, num_packs: int) -> list[tuple[int, int]]:
    """(pack, rank in pack) of every item: heaviest first (torch's CPU sort order), into the lightest pack with room."""
    n = len(loads)
    per_pack = n // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(n)]
    order = _std_sort_desc(loads)
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
