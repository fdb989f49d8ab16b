"""A lower bound on the experts any plan must move to reach a balance from an old placement (linear relaxation).

Owns one question: given the old placement and the new loads, at least how many moved experts
(:func:`fdeplb.placement.moved_experts`) does *any* plan need so that the mean over layers of its GPU-load
max/mean is at most a given level? The answer says how far "move_aware" is from what is possible: a bound above a
move target proves the target infeasible; a bound below it proves nothing.

The relaxation (per layer ``l``, GPU ``g`` with old slots ``s``; ``p_s`` = slot's per-replica load at the old
replica counts ``c``, ``w_e`` = expert load, ``W`` = layer load, ``m = W / G``, ``q = max_e w_e``):

- ``x_s`` in [0, 1]: slot ``s`` gets another expert (one moved expert each; a plan's moves on a GPU are its
  replaced slots, matched by multiset); ``y_e >= 0`` / ``d_e`` in [0, c_e - 1]: replica count increases /
  decreases, with ``sum y <= sum x`` (every new replica fills a replaced slot) and ``sum y = sum d`` (the number
  of slots is fixed);
- ceiling: ``base_g - sum p_s x_s - sum_e n_ge w_e y_e / (c_e (c_e + 1)) <= t_l m``: a kept replica's load falls
  by at most that slope when its expert gains replicas (``w/c - w/(c+y)`` is concave in ``y``), a new replica
  weighs at least 0;
- floor: ``base_g - sum p_s x_s + q sum x_s + sum_e n_ge (w_e / c_e) d_e >= W - (G - 1) t_l m``: no GPU is above
  ``t_l m``, so every GPU carries at least the rest; a new replica weighs at most ``q``, a kept one rises by at most
  the chord of ``w/(c-d) - w/c`` over ``d`` in [0, c - 1];
- ``t_l >= 1`` and ``sum_l t_l <= L * max_over_mean``; minimise ``sum x``.

Every plan gives a feasible point of the same objective (its moves), so the optimum is a lower bound; it is
solved with HiGHS (``scipy.optimize.linprog``, Huangfu and Hall, "Parallelizing the dual revised simplex method",
Math. Prog. Comp. 10, 2018). On the drift pairs of ``benchmarks/placement.py`` it is 1.4-1.8% of a fresh plan's moves:
weak, because a new replica may weigh anywhere in [0, q]. The formulation is fdeplb's.

For plans that keep every expert group on one node (DeepSeek's hierarchical policy and "move_aware" at several
nodes), :func:`groups_on_nodes_lower_bound` is far stronger: a layer's group-to-node map alone puts a floor under its
heaviest GPU (its heaviest node spread evenly over the node's GPUs) and forces a move for every expert put on a
node that held no replica of it; the least such moves over layers within the mean level is a multiple-choice
knapsack over every layer's maps, bounded by its linear relaxation (HiGHS again). DeepSeek-V3 4-node drift pair of
the benchmark at fresh "balanced" + 0.0005: 2,194 moved experts, 14.2% of a fresh plan's 15,461.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment, linprog

from fdeplb.errors import InputError
from fdeplb.placement._validate import check_expert_load, check_int, check_phy2log, check_topology
from fdeplb.placement.node_maps import MAX_MAPS, group_loads, map_count, map_indicator, map_peaks


def _checked(expert_load: object, old_phy2log: object, max_over_mean: object) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [L, E] load, int64 [L, P] old placement) checked against each other, and the level checked."""
    load = check_expert_load(expert_load).astype(np.float64)
    old = np.asarray(getattr(old_phy2log, "phy2log", old_phy2log))
    L, E = load.shape
    if old.ndim != 2 or old.shape[0] != L:
        raise InputError(f"old_phy2log has shape {old.shape}, expected [{L}, num_physical_experts]")
    if (isinstance(max_over_mean, bool) or not isinstance(max_over_mean, (int, float, np.integer, np.floating))
            or not np.isfinite(max_over_mean) or max_over_mean < 1):
        raise InputError(f"max_over_mean must be a finite number >= 1, got {max_over_mean!r}")
    return load, check_phy2log(old, E).astype(np.int64)


def _layer_rows(load: np.ndarray, old: np.ndarray, num_gpus: int) -> tuple:
    """Per (layer, GPU) row the terms of the ceiling and floor constraints; see the module docstring."""
    L, P = old.shape
    E = load.shape[1]
    per = P // num_gpus
    rows = np.arange(L)[:, None]
    counts = np.zeros((L, E), dtype=np.int64)
    np.add.at(counts, (rows, old), 1)
    slot_load = load[rows, old] / counts[rows, old]  # p_s [L, P]
    base = slot_load.reshape(L, num_gpus, per).sum(axis=2)  # [L, G]
    held = np.zeros((L, num_gpus, E), dtype=np.int64)  # n_ge
    np.add.at(held, (rows, np.arange(P)[None, :] // per, old), 1)
    safe = np.maximum(counts, 1)[:, None, :]
    fall = held * (load[:, None, :] / (safe * (safe + 1)))  # ceiling slope per unit of y_e
    rise = held * np.where(counts[:, None, :] >= 2, load[:, None, :] / safe, 0.0)  # floor slope per unit of d_e
    return counts, slot_load, base, fall, rise


def moved_experts_lower_bound(expert_load: object, old_phy2log: object, num_gpus: int,
                              max_over_mean: float) -> int:
    """At least how many experts any plan moves from ``old_phy2log`` to reach the balance ``max_over_mean``.

    Args:
        expert_load: [L, E] tokens per logical expert (the new loads).
        old_phy2log: int [L, P] the old placement (or a :class:`fdeplb.placement.Placement`); P a multiple of
            ``num_gpus``.
        num_gpus: EP size.
        max_over_mean: the balance to reach: the mean over layers of (heaviest GPU load / mean GPU load), >= 1.

    Returns:
        int: the optimum of the linear relaxation in the module docstring, rounded up; every plan with that mean
        max/mean moves at least this many experts (:func:`fdeplb.placement.moved_experts`).

    Raises:
        InputError: shapes that do not match, P not a multiple of ``num_gpus``, ``max_over_mean`` not a finite
            number >= 1, or the solver failing (its message).
    """
    load, old = _checked(expert_load, old_phy2log, max_over_mean)
    L, E = load.shape
    G = check_int(num_gpus, "num_gpus")
    P = old.shape[1]
    if P % G:
        raise InputError(f"num_physical_experts ({P}) is not a multiple of num_gpus ({G})")
    counts, slot_load, base, fall, rise = _layer_rows(load, old, G)
    total = load.sum(axis=1)
    mean, q = total / G, load.max(axis=1)
    nx, ny = L * P, L * E
    ix, iy, it, i_d = 0, nx, nx + ny, nx + ny + L  # variable blocks: x, y, t, d
    lg = np.arange(L * G)
    layer_of = lg // G
    slot_rows = np.repeat(lg, P // G)  # (layer, GPU) row of every slot, slot-major per layer
    ex_rows = np.repeat(lg, E)
    ex_cols = (layer_of[:, None] * E + np.arange(E)[None, :]).ravel()
    ceiling = sp.coo_matrix((np.r_[-slot_load.ravel(), -fall.ravel(), -mean[layer_of]],
                             (np.r_[slot_rows, ex_rows, lg], np.r_[ix + np.arange(nx), iy + ex_cols, it + layer_of])),
                            shape=(L * G, i_d + ny))
    floor = sp.coo_matrix((np.r_[(slot_load - q[:, None]).ravel(), -rise.ravel(), -(G - 1) * mean[layer_of]],
                           (np.r_[slot_rows, ex_rows, lg], np.r_[ix + np.arange(nx), i_d + ex_cols, it + layer_of])),
                          shape=(L * G, i_d + ny))
    lay_x, lay_e = np.repeat(np.arange(L), P), np.repeat(np.arange(L), E)
    fills = sp.coo_matrix((np.r_[np.ones(ny), -np.ones(nx)], (np.r_[lay_e, lay_x], np.r_[iy + np.arange(ny),
                                                                                         ix + np.arange(nx)])),
                          shape=(L, i_d + ny))
    level = sp.coo_matrix((np.ones(L), (np.zeros(L, dtype=np.int64), it + np.arange(L))), shape=(1, i_d + ny))
    slots_kept = sp.coo_matrix((np.r_[np.ones(ny), -np.ones(ny)], (np.r_[lay_e, lay_e], np.r_[iy + np.arange(ny),
                                                                                              i_d + np.arange(ny)])),
                               shape=(L, i_d + ny))
    a_ub = sp.vstack([ceiling, floor, fills, level]).tocsr()
    b_ub = np.r_[-base.ravel(), (base - total[:, None]).ravel(), np.zeros(L), L * float(max_over_mean)]
    cost = np.r_[np.ones(nx), np.zeros(ny + L + ny)]
    bounds = np.r_[np.tile([0.0, 1.0], (nx, 1)), np.tile([0.0, np.inf], (ny, 1)), np.tile([1.0, np.inf], (L, 1)),
                   np.c_[np.zeros(ny), np.maximum(counts.ravel() - 1, 0)]]
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=slots_kept.tocsr(), b_eq=np.zeros(L), bounds=bounds,
                  method="highs")
    if res.status != 0:
        raise InputError(f"the move lower bound's linear program failed: {res.message}")
    return int(np.ceil(res.fun - 1e-6))


def groups_on_nodes_lower_bound(expert_load: object, old_phy2log: object, num_groups: int, num_nodes: int,
                                num_gpus: int, max_over_mean: float) -> int:
    """At least how many experts a plan that keeps every expert group on one node moves from ``old_phy2log`` to
    reach the balance ``max_over_mean``.

    Per layer and group-to-node map m (num_groups / num_nodes groups a node, :func:`fdeplb.placement.node_maps.
    all_maps`): any plan with that map has max/mean at least its heaviest node over the node's GPUs, over the mean
    GPU load, and moves at least the experts m puts on a node none of whose GPUs held a replica of them. The bound
    is the optimum of the linear relaxation of choosing one map a layer with the mean of those floors at most
    ``max_over_mean`` and the fewest forced moves (``scipy.optimize.linprog``, HiGHS), rounded up. With one group a
    node every map has the same floor: the sum over layers of the cheapest assignment of groups to nodes
    (``scipy.optimize.linear_sum_assignment``).

    Args:
        expert_load: [L, E] tokens per logical expert (the new loads), E a multiple of ``num_groups``.
        old_phy2log: int [L, P] the old placement (or a :class:`fdeplb.placement.Placement`).
        num_groups, num_nodes, num_gpus: the hierarchical topology (``num_groups`` a multiple of ``num_nodes``,
            ``num_gpus`` of ``num_nodes``, P of ``num_gpus``).
        max_over_mean: the balance to reach: the mean over layers of max/mean GPU load, >= 1.

    Returns:
        int: every plan with every group on one node and that mean max/mean moves at least this many experts.

    Raises:
        InputError: shapes or a topology that do not match, not hierarchical (``num_groups % num_nodes``), more than
            :data:`fdeplb.placement.node_maps.MAX_MAPS` maps a layer to enumerate (one group a node excepted), ``max_over_mean`` not a finite
            number >= 1 or below every plan's with groups on nodes.
    """
    load, old = _checked(expert_load, old_phy2log, max_over_mean)
    L, E = load.shape
    P = old.shape[1]
    _, num_groups, num_nodes, num_gpus, hierarchical = check_topology(E, P, num_groups, num_nodes, num_gpus)
    if not hierarchical:
        raise InputError(f"num_groups ({num_groups}) is not a multiple of num_nodes ({num_nodes}): groups are not "
                         "kept on nodes")
    one_a_node = num_groups == num_nodes  # every map has the same floor: the cheapest assignment a layer
    if not one_a_node and map_count(num_groups, num_nodes) > MAX_MAPS:
        raise InputError(f"more than {MAX_MAPS} group-to-node maps a layer ({num_groups} groups on {num_nodes} "
                         "nodes): too many to enumerate")
    group_size, gpus_per_node = E // num_groups, num_gpus // num_nodes
    held = np.zeros((L, num_nodes, E), dtype=bool)  # a GPU of the node held a replica of the expert
    held[np.arange(L)[:, None], np.arange(P)[None, :] // (P // num_nodes), old] = True
    missing = (~held).reshape(L, num_nodes, num_groups, group_size).sum(axis=3).transpose(0, 2, 1)  # [L, grp, node]
    group_load = group_loads(load, num_groups)
    mean = np.where(load.sum(axis=1) > 0, load.sum(axis=1) / num_gpus, 1.0)
    # [L, M] max/mean no plan with the map goes below (1 for a layer without load, as imbalance() counts it)
    peaks = group_load.max(axis=1, keepdims=True) if one_a_node else map_peaks(group_load, num_nodes)[1]
    floor = np.maximum(peaks / gpus_per_node / mean[:, None], 1.0)
    if floor.min(axis=1).sum() > L * float(max_over_mean) * (1 + 1e-12):
        raise InputError(f"no plan with every group on one node reaches a mean max/mean of {max_over_mean} "
                         f"(at least {floor.min(axis=1).mean():.6f})")
    if one_a_node:
        return int(sum(missing[layer][linear_sum_assignment(missing[layer])].sum() for layer in range(L)))
    onehot = map_indicator(num_groups, num_nodes)  # [num_groups * num_nodes, M]
    forced = missing.reshape(L, -1).astype(np.float64) @ onehot  # [L, M] moved experts the map forces
    one_map = sp.kron(sp.eye(L), np.ones((1, onehot.shape[1])))
    res = linprog(forced.ravel(), A_ub=floor.reshape(1, -1), b_ub=[L * float(max_over_mean)],
                  A_eq=one_map, b_eq=np.ones(L), bounds=(0, 1), method="highs")
    if res.status != 0:
        raise InputError(f"the move lower bound's linear program failed: {res.message}")
    return int(np.ceil(res.fun - 1e-6))
