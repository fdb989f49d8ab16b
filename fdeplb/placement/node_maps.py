"""Group-to-node maps of the hierarchical "move_aware" policy: which node every expert group lives on.

Two maps per layer: the old placement's (:func:`old_node_of_groups`) and the "balanced" plan's packing with its
nodes renumbered to match the old placement (:func:`node_of_groups`); a layer keeps the first or takes the second
(:mod:`fdeplb.placement.move_aware`).
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.slots import overlap_assignment


def node_of_groups(
    fresh: np.ndarray, old: np.ndarray, num_groups: int, num_nodes: int, group_size: int
) -> np.ndarray:
    """int64 [L, num_groups]: node of every group, the balanced plan's packing with nodes renumbered to match old."""
    L, P = fresh.shape
    node_of_slot = np.arange(P) // (P // num_nodes)
    out = np.empty((L, num_groups), dtype=np.int64)
    for layer in range(L):
        fresh_node = np.empty(num_groups, dtype=np.int64)
        fresh_node[fresh[layer] // group_size] = node_of_slot
        overlap = np.zeros((num_nodes, num_nodes), dtype=np.int64)
        np.add.at(overlap, (fresh_node[old[layer] // group_size], node_of_slot), 1)
        out[layer] = overlap_assignment(overlap)[fresh_node]
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
