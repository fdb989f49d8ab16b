"""DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB, ``eplb.py``), vectorised over layers in numpy.

Same steps, the same arithmetic and the same tie order as the published PyTorch code run on torch's CPU backend:

1. ``balanced_packing`` of the expert groups onto nodes (hierarchical policy only);
2. ``replicate_experts`` inside each node: every redundant slot goes to the expert with the largest load per
   replica (``load / logcnt``);
3. ``balanced_packing`` of the replicas onto the node's GPUs.

The global policy is the hierarchical one run with one group and one node. What is reproduced:
``rebalance_experts(..., policy="deepseek")`` returns the phy2log, log2phy (each expert's slots in replica-rank
order, built from :func:`deepseek_placement`'s ranks) and logcnt of ``eplb.rebalance_experts``, element for
element, ties included, for inputs fdeplb accepts (finite, non-negative loads). tests/golden holds ``eplb.py``'s
outputs under torch 2.13 CPU (real dumps at four topologies plus small and random cases with many ties) and the
tests compare them all.

How: arithmetic is float32 like the reference (``weight.float()``). ``balanced_packing`` orders items as
``torch.sort(descending=True)`` on CPU does, which is not a stable sort for rows longer than 16 (see
:func:`torch_sort_desc`); ``argmax`` and the lightest-pack choice keep the first index, like ``torch.max`` on CPU
and Python's ``min``. Group loads are summed in float64 and rounded once to float32 (the reference sums in float32
in torch's order, which only differs when a group's load is not exactly representable in float32, i.e. above
2**24 tokens).

The only Python loops run over the items of one pack step (``n`` iterations, each vectorised over all layers) and
over the recursion levels of the sort (each vectorised over all rows), never over layers x items.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError

_INSERTION_THRESHOLD = 16  # libstdc++'s _S_threshold: introsort leaves segments of at most 16 to insertion sort


def _heap_sort_desc(keys: list, items: list) -> None:
    """libstdc++'s ``std::__partial_sort(first, last, last)`` (make_heap + sort_heap) with ``comp(a, b) = a > b``,
    in place on the parallel lists ``keys`` / ``items``. Introsort falls back to it when its depth limit runs out."""

    def adjust(hole: int, length: int, key, item) -> None:  # std::__adjust_heap, then std::__push_heap
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if keys[child] > keys[child - 1]:
                child -= 1
            keys[hole], items[hole] = keys[child], items[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            keys[hole], items[hole] = keys[child - 1], items[child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and keys[parent] > key:
            keys[hole], items[hole] = keys[parent], items[parent]
            hole = parent
            parent = (hole - 1) // 2
        keys[hole], items[hole] = key, item

    n = len(keys)
    if n >= 2:  # std::__make_heap
        for parent in range((n - 2) // 2, -1, -1):
            adjust(parent, n, keys[parent], items[parent])
    for last in range(n - 1, 0, -1):  # std::__sort_heap: pop_heap(first, last, last)
        key, item = keys[last], items[last]
        keys[last], items[last] = keys[0], items[0]
        adjust(0, last, key, item)


def torch_sort_desc(keys: np.ndarray) -> np.ndarray:
    """Indices of ``torch.sort(keys, dim=-1, descending=True)`` on CPU, ties included: int64 [X, n].

    torch's CPU sort (``stable=False``) runs libstdc++'s ``std::sort`` on every row over (key, index) pairs with
    ``comp(a, b) = a.key > b.key``: introsort (median of first+1 / middle / last-1 moved to the front, unguarded
    Hoare partition, recursion depth limit ``2 * floor(log2 n)`` then heap sort) leaves segments of at most 16
    elements, and a final insertion sort (stable) finishes. So rows of at most 16 elements, and rows whose keys
    are all distinct, come out as a stable descending sort; the order of equal keys in longer rows is the order
    the partitions left them in.

    This emulates the partitions of all rows at once, one recursion level per step: a Hoare partition with pivot
    ``p`` swaps the k-th element from the left with key <= p with the k-th element from the right with key >= p,
    for every k whose left position is below the right one, and returns the next left stop; that has a closed form
    in cumulative counts. Segments that reach the depth limit (adversarial inputs only) are heap-sorted in Python
    exactly as libstdc++ does. The final insertion sort is a stable argsort of the arrangement.

    Args:
        keys: [X, n] float array (float32 for DeepSeek), without NaN.

    Returns:
        int64 [X, n]: row ``x`` lists the indices of ``keys[x]`` in torch's descending order.
    """
    X, n = keys.shape
    if n <= _INSERTION_THRESHOLD:
        return np.argsort(-keys, axis=1, kind="stable")
    srt = np.sort(keys, axis=1)
    emulate = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))  # other rows: every order of ties agrees
    arranged = np.ascontiguousarray(keys).copy()
    items = np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy()
    K, I = arranged.reshape(-1), items.reshape(-1)  # flat views: a segment is [start, start + length)
    start = emulate * n
    length = np.full(len(emulate), n, dtype=np.int64)
    depth = 2 * (n.bit_length() - 1)  # every segment of one recursion level has the same depth left
    heap_segments = []
    while len(start):
        if depth == 0:
            heap_segments += zip(start.tolist(), length.tolist())
            break
        depth -= 1
        # median of three (std::__move_median_to_first) swapped to the front
        a, b, c = start + 1, start + length // 2, start + length - 1
        ka, kb, kc = K[a], K[b], K[c]
        ab, bc, ac = ka > kb, kb > kc, ka > kc
        median = np.where(ab, np.where(bc, b, np.where(ac, c, a)), np.where(ac, a, np.where(bc, c, b)))
        K[start], K[median] = K[median], K[start]
        I[start], I[median] = I[median], I[start]
        # std::__unguarded_partition(first + 1, last, pivot = first) in closed form over the flat positions
        span = length - 1
        offset = np.cumsum(span) - span  # where each segment's positions begin in the flat position list
        last = offset + span - 1
        pos = np.repeat(start + 1 - offset, span) + np.arange(int(span.sum()))
        key, pivot = K[pos], np.repeat(K[start], span)
        le, ge = key <= pivot, key >= pivot  # the left scan stops at le, the right scan at ge
        cum_le, cum_ge = np.cumsum(le), np.cumsum(ge)
        rank_le = cum_le - np.repeat(cum_le[offset] - le[offset], span)  # k of the k-th left stop
        ge_right = np.repeat(cum_ge[last], span) - cum_ge  # ge positions strictly right of this one
        swap_left = le & (ge_right >= rank_le)  # L_k < R_k: the k-th stops swap
        swaps = np.add.reduceat(swap_left, offset)
        swap_right = ge & (ge_right < np.repeat(swaps, span))  # R_k for k = ge_right + 1 <= swaps
        left_pos = pos[swap_left]  # ascending k
        right_pos = pos[swap_right]  # descending k inside each segment: reverse every segment's block
        if len(left_pos):
            rfirst = np.cumsum(swaps) - swaps
            right_pos = right_pos[np.repeat(2 * rfirst + swaps - 1, swaps) - np.arange(len(right_pos))]
            K[left_pos], K[right_pos] = K[right_pos], K[left_pos]
            I[left_pos], I[right_pos] = I[right_pos], I[left_pos]
        # returned cut: the next left stop, min(L_{m+1}, R_m) (L_1 when nothing swapped)
        stop = np.where((le & ~swap_left) | swap_right, pos, np.iinfo(np.int64).max)
        cut = np.minimum.reduceat(stop, offset)
        start, length = np.concatenate([start, cut]), np.concatenate([cut - start, start + length - cut])
        keep = length > _INSERTION_THRESHOLD
        start, length = start[keep], length[keep]
    for s, ln in heap_segments:
        seg_keys, seg_items = K[s : s + ln].tolist(), I[s : s + ln].tolist()
        _heap_sort_desc(seg_keys, seg_items)
        K[s : s + ln], I[s : s + ln] = seg_keys, seg_items
    # final insertion sort: stable on the arrangement the partitions left
    return np.take_along_axis(items, np.argsort(-arranged, axis=1, kind="stable"), axis=1)


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation matrix [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1], dtype=perm.dtype), perm.shape), axis=1)
    return inv


def balanced_packing(load: np.ndarray, num_packs: int, *, tie_order: str = "stable") -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` items into ``num_packs`` packs of exactly ``n / num_packs`` items each, balancing pack loads.

    DeepSeek's ``balanced_packing``: greedy in descending item load; each item goes to the lightest pack that still
    has room (ties: lowest pack index). Pack loads accumulate in ``load``'s dtype (float32 for bit-exactness with
    DeepSeek). With ``n / num_packs == 1`` item ``i`` goes to pack ``i``.

    Args:
        load: [X, n] float array, the load of every item of every row.
        num_packs: number of packs; must divide ``n`` (checked by the caller).
        tie_order: order of equal loads. ``"stable"``: ascending index (what ``greedy`` relies on);
            ``"torch"``: the order of ``torch.sort(descending=True)`` on CPU (:func:`torch_sort_desc`), which is
            what ``eplb.py`` gets.

    Returns:
        ``(pack_index, rank_in_pack)``, both int64 [X, n]: the pack of every item and its position in the pack.

    Raises:
        InputError: an unknown ``tie_order``.
    """
    if tie_order not in ("stable", "torch"):
        raise InputError(f"tie_order must be 'stable' or 'torch', got {tie_order!r}")
    X, n = load.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return (
            np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy(),
            np.zeros((X, n), dtype=np.int64),
        )
    order = np.argsort(-load, axis=1, kind="stable") if tie_order == "stable" else torch_sort_desc(load)
    sorted_load = np.take_along_axis(load, order, axis=1)
    flat_row = np.arange(X) * num_packs  # flat index of (row, pack) = flat_row + pack
    open_load = np.zeros(X * num_packs, dtype=load.dtype)  # a pack's load, inf once it is full
    pack_items = np.zeros(X * num_packs, dtype=np.int64)
    pack_by_pos = np.empty((n, X), dtype=np.int64)  # pack / rank of the item at sorted position j
    rank_by_pos = np.empty((n, X), dtype=np.int64)
    full = np.array(np.inf, dtype=load.dtype)
    for j in range(n):
        at = flat_row + open_load.reshape(X, num_packs).argmin(axis=1)  # lightest open pack, lowest index
        pack_by_pos[j] = at - flat_row
        rank_by_pos[j] = pack_items[at]
        open_load[at] += sorted_load[:, j]  # the same float additions, in the same order, as DeepSeek's
        pack_items[at] += 1
        open_load[at[pack_items[at] == per_pack]] = full
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    np.put_along_axis(pack_index, order, pack_by_pos.T, axis=1)
    np.put_along_axis(rank_in_pack, order, rank_by_pos.T, axis=1)
    return pack_index, rank_in_pack


def replicate_experts(load: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_phy - num_log`` redundant slots one by one to the expert with the largest load per replica.

    Args:
        load: [X, num_log] float array (float32 for bit-exactness).
        num_phy: number of slots per row, >= num_log.

    Returns:
        ``(phy2log, phyrank, logcnt)``: int64 [X, num_phy] expert of every slot (slot i < num_log holds expert i,
        the redundant slots follow in the order they were handed out), int64 [X, num_phy] replica rank of the slot,
        int64 [X, num_log] replica count.
    """
    X, num_log = load.shape
    rows = np.arange(X)
    phy2log = np.empty((X, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    phyrank = np.zeros((X, num_phy), dtype=np.int64)
    logcnt = np.ones((X, num_log), dtype=np.int64)
    per_replica = load.copy()  # load / logcnt, updated in the one column that changes
    for i in range(num_log, num_phy):
        best = per_replica.argmax(axis=1)
        phy2log[:, i] = best
        phyrank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
        per_replica[rows, best] = load[rows, best] / logcnt[rows, best].astype(load.dtype)
    return phy2log, phyrank, logcnt


def deepseek_phy2log(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log, logcnt)`` of :func:`deepseek_placement`, int64 [L, P] and [L, E]."""
    phy2log, _, logcnt = deepseek_placement(expert_load, num_replicas, num_groups, num_nodes, num_gpus)
    return phy2log, logcnt


def deepseek_placement(
    expert_load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's hierarchical policy on checked inputs, as ``eplb.rebalance_experts`` computes it.

    Call with ``num_groups=num_nodes=1`` for the global policy. Inputs must already be checked
    (:func:`fdeplb.placement.rebalance_experts` does it). ``eplb.py``'s log2phy lists every expert's slots by
    replica rank: ``Placement.from_phy2log(phy2log, E, replica_rank=phyrank)`` builds exactly that.

    Args:
        expert_load: [L, E] int or float array, non-negative and finite.
        num_replicas, num_groups, num_nodes, num_gpus: a checked topology.

    Returns:
        ``(phy2log, phyrank, logcnt)``: int64 [L, P] expert of every slot, int64 [L, P] replica rank of every slot
        (0 for the expert's first replica, then in the order step 2 handed them out), int64 [L, E] replica count.
    """
    load = np.asarray(expert_load).astype(np.float32)
    L, E = load.shape
    # Step 1: pack groups onto nodes.
    group_load = load.reshape(L, num_groups, E // num_groups).sum(axis=-1, dtype=np.float64).astype(np.float32)
    group_pack, group_rank = balanced_packing(group_load, num_nodes, tie_order="torch")
    return place_in_nodes(load, group_pack, group_rank, num_replicas, num_nodes, num_gpus)


def place_in_nodes(
    expert_load: np.ndarray, group_pack: np.ndarray, group_rank: np.ndarray, num_replicas: int, num_nodes: int,
    num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 2 and 3 of DeepSeek's hierarchical policy for a given packing of groups onto nodes: replicate experts
    inside every node, pack the node's replicas onto its GPUs (float32 as ``eplb.py``).

    Args:
        expert_load: [L, E] non-negative finite loads.
        group_pack, group_rank: int64 [L, num_groups] the node of every group and its position on the node
            (``num_groups / num_nodes`` groups a node, positions 0, 1, ...): step 1's packing or another.
        num_replicas, num_nodes, num_gpus: a checked topology.

    Returns:
        ``(phy2log, phyrank, logcnt)`` as :func:`deepseek_placement`.
    """
    load = np.asarray(expert_load).astype(np.float32)
    L, E = load.shape
    num_groups = group_pack.shape[1]
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    log_per_node = E // num_nodes
    # "mlog" numbers the experts node by node
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts inside every node; rows are (layer, node).
    mlog_load = np.take_along_axis(load, mlog2log, axis=1).reshape(L * num_nodes, log_per_node)
    phy2mlog, mlogrank, mlogcnt = replicate_experts(mlog_load, num_replicas // num_nodes)

    # Step 3: pack the node's replicas onto its GPUs.
    replica_load = np.take_along_axis(mlog_load / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rank = balanced_packing(replica_load, num_gpus // num_nodes, tie_order="torch")
    pphy2phy = _inverse(pack * slots_per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * log_per_node)[None, :, None]).reshape(L, num_replicas)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    phyrank = np.take_along_axis(mlogrank, pphy2phy, axis=1).reshape(L, num_replicas)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, E), log2mlog, axis=1)
    return phy2log, phyrank, logcnt
