"""Group-to-node maps of the hierarchical "move_aware" policy: which node every expert group lives on, and the
(layer, node) rows a map gives.

The maps of a layer: the old placement's (:func:`old_node_of_groups`), the "balanced" plan's packing with its
nodes renumbered to match the old placement (:func:`node_of_groups`), the map within a node-load limit that
relocates the fewest old slots (:func:`nearest_maps`, what the uncapped policy takes,
:mod:`fdeplb.placement.move_aware`) and, with a move cap, the old map with one swap of two groups
(:func:`swap_map`). :func:`node_rows` turns a map into the rows the batched repair works on.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from fdeplb.placement.fill import fill_rows, forced_copies, replica_counts
from fdeplb.placement.slots import overlap_assignment


def group_nodes(phy2log: np.ndarray, num_groups: int, num_nodes: int, group_size: int) -> np.ndarray:
    """int64 [L, num_groups]: the node of every group of ``phy2log`` int64 [L, P], a plan that keeps every group on
    one node (P / num_nodes consecutive slots a node; groups of ``group_size`` consecutive experts)."""
    L, P = phy2log.shape
    out = np.empty((L, num_groups), dtype=np.int64)
    out[np.arange(L)[:, None], phy2log // group_size] = np.arange(P) // (P // num_nodes)
    return out


def node_of_groups(
    fresh: np.ndarray, old: np.ndarray, num_groups: int, num_nodes: int, group_size: int
) -> np.ndarray:
    """int64 [L, num_groups]: node of every group, the balanced plan's packing with nodes renumbered to match old."""
    L, P = fresh.shape
    node_of_slot = np.arange(P) // (P // num_nodes)
    fresh_nodes = group_nodes(fresh, num_groups, num_nodes, group_size)
    out = np.empty((L, num_groups), dtype=np.int64)
    for layer in range(L):
        overlap = np.zeros((num_nodes, num_nodes), dtype=np.int64)
        np.add.at(overlap, (fresh_nodes[layer][old[layer] // group_size], node_of_slot), 1)
        out[layer] = overlap_assignment(overlap)[fresh_nodes[layer]]
    return out


def old_node_of_groups(old_row: np.ndarray, num_groups: int, num_nodes: int, group_size: int) -> np.ndarray:
    """int64 [num_groups]: node of every group in the old placement of one layer.

    When the old placement keeps every group on one node, that node. Otherwise (a group spread over nodes, e.g. the
    initial placement) the packing with ``num_groups / num_nodes`` groups per node that keeps the most old slots
    (``linear_sum_assignment`` of groups to node seats on "slots of the node holding an expert of the group")."""
    P = old_row.size
    node_of_slot = np.arange(P) // (P // num_nodes)
    overlap = np.zeros((num_groups, num_nodes), dtype=np.int64)
    np.add.at(overlap, (old_row // group_size, node_of_slot), 1)
    on = overlap > 0
    if (on.sum(axis=1) == 1).all():
        return on.argmax(axis=1).astype(np.int64)
    per_node = num_groups // num_nodes
    return overlap_assignment(np.repeat(overlap, per_node, axis=1)) // per_node


def group_loads(load: np.ndarray, num_groups: int) -> np.ndarray:
    """float64 [L, num_groups] tokens of every group (num_groups blocks of E / num_groups consecutive experts) of
    ``load`` [L, E]."""
    L, E = load.shape
    return np.asarray(load, dtype=np.float64).reshape(L, num_groups, E // num_groups).sum(axis=2)


def node_loads(maps: np.ndarray, group_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """float64 [L, num_nodes] tokens of every node when ``maps`` int64 [L, num_groups] puts the groups of
    ``group_load`` float64 [L, num_groups] on nodes."""
    out = np.zeros((group_load.shape[0], num_nodes))
    np.add.at(out, (np.arange(group_load.shape[0])[:, None], maps), group_load)
    return out


def old_group_slots(old: np.ndarray, num_groups: int, num_experts: int) -> np.ndarray:
    """int64 [L, num_groups]: the slots of ``old`` int64 [L, P] holding each group's experts (what relocating the
    group moves: :func:`nearest_maps`'s cost)."""
    out = np.zeros((old.shape[0], num_groups), dtype=np.int64)
    np.add.at(out, (np.arange(old.shape[0])[:, None], old // (num_experts // num_groups)), 1)
    return out


def swap_map(old_maps: np.ndarray, group_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """int64 [L, num_groups]: every layer's ``old_maps`` row with the one swap of two groups on different nodes that
    lowers its heaviest node most (ties: the first pair in (i, j) order), or unchanged when no swap lowers it.
    ``group_load`` float64 [L, num_groups]: every group's load (tokens)."""
    L, num_groups = group_load.shape
    layers = np.arange(L)[:, None]
    node_load = node_loads(old_maps, group_load, num_nodes)
    i, j = np.triu_indices(num_groups, 1)
    shift = group_load[:, i] - group_load[:, j]  # [L, Q]: what node(i) gives node(j) by the swap
    after = np.repeat(node_load[:, None, :], i.size, axis=1)  # [L, Q, num_nodes]
    q = np.arange(i.size)
    after[layers, q, old_maps[:, i]] -= shift
    after[layers, q, old_maps[:, j]] += shift
    peak = np.where(old_maps[:, i] != old_maps[:, j], after.max(axis=2), np.inf)
    best = peak.argmin(axis=1)
    rows = np.flatnonzero(peak[np.arange(L), best] < node_load.max(axis=1) * (1 - 1e-12))
    out = old_maps.copy()
    out[rows, i[best[rows]]], out[rows, j[best[rows]]] = old_maps[rows, j[best[rows]]], old_maps[rows, i[best[rows]]]
    return out


#: the most group-to-node maps a layer that :func:`nearest_maps`, :func:`lightest_maps` and
#: :func:`fdeplb.placement.move_bound.groups_on_nodes_lower_bound` enumerate (8 groups on 4 nodes: 2,520; on 2
#: nodes: 70; 12 on 3: 34,650 and one group a node at 8 nodes: 40,320 are past it)
MAX_MAPS = 5000


@lru_cache(maxsize=8)
def all_maps(num_groups: int, num_nodes: int) -> np.ndarray:
    """int64 [M, num_groups]: every map of groups to nodes with num_groups / num_nodes groups per node, in
    lexicographic order."""
    per_node = num_groups // num_nodes
    out: list[tuple[int, ...]] = []
    seats = [per_node] * num_nodes

    def extend(prefix: list[int]) -> None:
        if len(prefix) == num_groups:
            out.append(tuple(prefix))
            return
        for node in range(num_nodes):
            if seats[node]:
                seats[node] -= 1
                extend(prefix + [node])
                seats[node] += 1

    extend([])
    maps = np.array(out, dtype=np.int64)
    maps.setflags(write=False)
    return maps


@lru_cache(maxsize=8)
def map_indicator(num_groups: int, num_nodes: int) -> np.ndarray:
    """float64 [num_groups * num_nodes, M]: 1 where map m (:func:`all_maps`) puts group g on node n (row g * num_nodes
    + n)."""
    maps = all_maps(num_groups, num_nodes)
    out = (maps.T[:, None, :] == np.arange(num_nodes)[None, :, None]).astype(np.float64)
    out.setflags(write=False)
    return out.reshape(num_groups * num_nodes, -1)


def map_count(num_groups: int, num_nodes: int, at_most: int = MAX_MAPS) -> int:
    """How many maps put num_groups / num_nodes groups on every node (the multinomial coefficient, a product of
    binomials node by node), or a number above ``at_most`` as soon as the product passes it (no huge integers for
    absurd group counts)."""
    per_node, left, count = num_groups // num_nodes, num_groups, 1
    for _ in range(num_nodes):
        count *= math.comb(left, per_node)
        left -= per_node
        if count > at_most:
            break
    return count


def map_peaks(group_load: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(every map int64 [M, num_groups] (:func:`all_maps`), the heaviest node load of every layer under every map
    float64 [L, M]) for ``group_load`` float64 [L, num_groups]."""
    L, num_groups = group_load.shape
    onehot = map_indicator(num_groups, num_nodes)  # [num_groups * num_nodes, M]: group g on node n in map m
    peak = (group_load @ onehot.reshape(num_groups, -1)).reshape(L, num_nodes, -1).max(axis=1)
    return all_maps(num_groups, num_nodes), peak


def lightest_maps(group_load: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Every layer's group-to-node map of least heaviest node (ties: the first in lexicographic order), exhaustive
    over the maps with num_groups / num_nodes groups a node: (maps int64 [L, num_groups], their heaviest node
    float64 [L], tokens); None with more than :data:`MAX_MAPS` maps. ``group_load`` float64 [L, num_groups].

    The problem is multiway number partitioning with equal cardinalities (balanced partitioning); DeepSeek's greedy
    (:func:`fdeplb.placement.deepseek.balanced_packing`) is optimal with two groups a node (the heaviest pairs with
    the lightest) but not with more: DeepSeek-V3 dumps at 2 nodes, 4 groups a node: heaviest node 1.006-1.041 x
    the mean node load where the greedy packing has 1.022-1.059."""
    if map_count(group_load.shape[1], num_nodes) > MAX_MAPS:
        return None
    maps, peak = map_peaks(group_load, num_nodes)
    best = peak.argmin(axis=1)
    return maps[best], peak[np.arange(peak.shape[0]), best]


def nearest_maps(old_maps: np.ndarray, group_load: np.ndarray, group_slots: np.ndarray, num_nodes: int,
                 limit: np.ndarray) -> np.ndarray | None:
    """int64 [L, num_groups]: every layer's group-to-node map that relocates the fewest old slots among the maps
    whose heaviest node load is at most ``limit``; None when there are more than :data:`MAX_MAPS` maps to try.

    Exhaustive over the maps with num_groups / num_nodes groups per node (:func:`all_maps`); a map's cost is the
    sum of ``group_slots`` over the groups it puts on another node than ``old_maps``. Ties: the lower heaviest node,
    then the first map in lexicographic order. A layer no map meets ``limit`` in gets the map of least heaviest
    node (DeepSeek's greedy node packing is one of the maps tried, so this is never heavier than it). With one
    group a node every map has the same node loads: the old maps come back.

    Args:
        old_maps: int64 [L, num_groups] node of every group in the old placement.
        group_load: float64 [L, num_groups] tokens per group.
        group_slots: int64 [L, num_groups] old slots holding the group's experts (what relocating it moves).
        num_nodes: nodes (num_groups divisible by it).
        limit: float64 [L] tokens: the heaviest node allowed.
    """
    L, num_groups = group_load.shape
    if num_groups == num_nodes:  # one group a node: every map has the old one's node loads, in another order
        return old_maps.copy()
    if map_count(num_groups, num_nodes) > MAX_MAPS:
        return None
    maps, peak = map_peaks(group_load, num_nodes)
    onehot = map_indicator(num_groups, num_nodes)
    stays = np.zeros((L, num_groups, num_nodes))  # slots a group keeps when it stays on its old node
    np.put_along_axis(stays, old_maps[:, :, None], group_slots[:, :, None].astype(np.float64), axis=2)
    cost = group_slots.sum(axis=1, keepdims=True) - stays.reshape(L, -1) @ onehot  # [L, M] slots relocated
    fits = peak <= limit[:, None]
    cost = np.where(fits, cost, np.inf)
    cost[~fits.any(axis=1)] = 0.0  # no map fits: least heaviest node
    cheapest = cost == cost.min(axis=1, keepdims=True)
    best = np.where(cheapest, peak, np.inf).argmin(axis=1)  # argmin: the first map of a tie
    return maps[best]


def node_rows(load: np.ndarray, old: np.ndarray, maps: np.ndarray, free_item: np.ndarray, cap: np.ndarray,
              num_nodes: int, num_gpus: int, bulk_copies: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The (layer, node) rows of the hierarchical repair for a group-to-node map per layer.

    Every node's experts get local ids in expert order; an old slot keeps its expert when the expert's group stays
    on the slot's node, else becomes a slot to fill. A row with a slot to fill or an expert without a replica is
    filled (:func:`fdeplb.placement.fill.fill_rows`, replicas re-assigned above ``free_item``: the relocation of
    the groups that changed node); a row whose experts need ``bulk_copies`` or more replicas to bring every
    per-replica load under ``cap`` gets them in bulk the same way (re-assigned above ``cap``).

    Args:
        load: float64 [L, E] expert_load (tokens); old: int64 [L, P] old phy2log; maps: int64 [L, num_groups] node
            of every group (groups of E / num_groups consecutive experts, num_groups / num_nodes per node).
        free_item, cap: float64 [L] tokens.
        num_nodes, num_gpus: P / num_nodes slots on num_gpus / num_nodes GPUs per node.

    Returns:
        (experts_of int64 [L, num_nodes, E / num_nodes]: global id of every node's local expert, old_local int64
        [L * num_nodes, P / num_nodes]: the old placement in local ids (-1: the slot's expert left the node),
        row_load float64 [L * num_nodes, E / num_nodes], start int64 [L * num_nodes, P / num_nodes]: the rows
        after the fill). Deterministic.
    """
    L, E = load.shape
    P = old.shape[1]
    num_groups = maps.shape[1]
    group_size = E // num_groups
    En, Pn, Gn = E // num_nodes, P // num_nodes, num_gpus // num_nodes
    layers = np.arange(L)
    node_of_slot = np.arange(P) // Pn
    expert_node = np.repeat(maps, group_size, axis=1)  # [L, E]
    experts_of = np.argsort(expert_node * E + np.arange(E), axis=1, kind="stable").reshape(L, num_nodes, En)
    local = np.empty((L, E), dtype=np.int64)
    np.put_along_axis(local, experts_of.reshape(L, E), np.broadcast_to(np.arange(E) % En, (L, E)), axis=1)
    rows_idx = layers[:, None]
    old_local = np.where(expert_node[rows_idx, old] == node_of_slot, local[rows_idx, old],
                         -1).reshape(L * num_nodes, Pn)
    row_load = load[layers[:, None, None], experts_of].reshape(L * num_nodes, En)
    start = old_local.copy()
    held = replica_counts(old_local, En)
    free = (old_local < 0).any(axis=1) | (held[:, :En] == 0).any(axis=1)  # a slot to fill or an expert to place
    row_cap = np.repeat(cap, num_nodes)
    bulk = ~free & (forced_copies(old_local, row_load, row_cap) >= bulk_copies)
    fill = free | bulk
    if fill.any():
        max_item = np.where(free, np.repeat(free_item, num_nodes), row_cap)
        start[fill] = fill_rows(old_local[fill], row_load[fill], Gn, max_item[fill])
    return experts_of, old_local, row_load, start
