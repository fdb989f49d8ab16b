"""DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB, ``eplb.py``), vectorised over layers in numpy.

Same steps and the same arithmetic as the published PyTorch code, so the result is bit-exact:

1. ``balanced_packing`` of the expert groups onto nodes (hierarchical policy only);
2. ``replicate_experts`` inside each node: every redundant slot goes to the expert with the largest load per
   replica (``load / logcnt``);
3. ``balanced_packing`` of the replicas onto the node's GPUs.

The global policy is the hierarchical one run with one group and one node. Arithmetic is float32 like the
reference (``weight.float()``); sorts are stable and descending and ``argmin``/``argmax`` keep the first index, which
is the tie order of ``torch.sort``/``torch.max`` on CPU. Group loads are summed in float64 and rounded once to
float32 (the reference sums in float32 in torch's order, which only differs when a group's load is not exactly
representable in float32, i.e. above 2**24 tokens).

The only Python loops run over the items of one pack step (``n`` iterations, each vectorised over all layers), never
over layers x items.
"""

from __future__ import annotations

import numpy as np


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation matrix [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1], dtype=perm.dtype), perm.shape), axis=1)
    return inv


def balanced_packing(load: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` items into ``num_packs`` packs of exactly ``n / num_packs`` items each, balancing pack loads.

    Greedy in descending item load (stable: equal loads in ascending index); each item goes to the lightest pack
    that still has room (ties: lowest pack index). Pack loads accumulate in ``load``'s dtype (float32 for
    bit-exactness with DeepSeek).

    Args:
        load: [X, n] float array, the load of every item of every row.
        num_packs: number of packs; must divide ``n`` (checked by the caller).

    Returns:
        ``(pack_index, rank_in_pack)``, both int64 [X, n]: the pack of every item and its position in the pack.
    """
    X, n = load.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return (
            np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy(),
            np.zeros((X, n), dtype=np.int64),
        )
    order = np.argsort(-load, axis=1, kind="stable")
    rows = np.arange(X)
    pack_load = np.zeros((X, num_packs), dtype=load.dtype)
    pack_items = np.zeros((X, num_packs), dtype=np.int64)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    inf = np.array(np.inf, dtype=load.dtype)
    for j in range(n):
        item = order[:, j]
        pack = np.where(pack_items < per_pack, pack_load, inf).argmin(axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_items[rows, pack]
        pack_load[rows, pack] += load[rows, item]
        pack_items[rows, pack] += 1
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
    """DeepSeek's hierarchical policy on checked inputs; returns ``(phy2log, logcnt)``, int64 [L, P] and [L, E].

    Call with ``num_groups=num_nodes=1`` for the global policy. Inputs must already be checked
    (:func:`fdeplb.placement.rebalance_experts` does it).
    """
    load = np.asarray(expert_load).astype(np.float32)
    L, E = load.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    log_per_node = E // num_nodes

    # Step 1: pack groups onto nodes; "mlog" numbers the experts node by node.
    group_load = load.reshape(L, num_groups, group_size).sum(axis=-1, dtype=np.float64).astype(np.float32)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts inside every node; rows are (layer, node).
    mlog_load = np.take_along_axis(load, mlog2log, axis=1).reshape(L * num_nodes, log_per_node)
    phy2mlog, _, mlogcnt = replicate_experts(mlog_load, num_replicas // num_nodes)

    # Step 3: pack the node's replicas onto its GPUs.
    replica_load = np.take_along_axis(mlog_load / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rank = balanced_packing(replica_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * slots_per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * log_per_node)[None, :, None]).reshape(L, num_replicas)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, E), log2mlog, axis=1)
    return phy2log, logcnt
