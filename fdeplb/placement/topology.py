"""The "topology_aware" policy: fewer tokens cross nodes, at a balance slack the caller sets.

Input: ``source_load`` [L, R, E], the tokens EP rank ``s`` (R = num_gpus source ranks; rank ``s`` sits on node
``s // (num_gpus / num_nodes)``) routed to logical expert ``e``: what SGLang's ``topology_aware`` policy and vLLM's
per-source-rank statistics plan from, and what the recorder sums into ``expert_load`` today.

Traffic model (the one every fdeplb metric uses): an expert's tokens from every source rank are split evenly over
its replicas. A replica of expert ``e`` on node ``n`` then serves ``local[n, e] = (tokens to e from ranks of node
n) / logcnt[e]`` tokens without leaving the node; the cross-node tokens of a plan are the total minus the sum of
``local`` over its slots (:func:`fdeplb.placement.metrics.cross_node_fraction`).

Method:

1. Start from the global "balanced" plan of the summed load (its replica counts stay: swaps below keep them).
   Every GPU may then carry up to ``cap = max(balanced peak, (balanced max/mean + tolerance) x mean)``.
2. Cross-node swaps: every iteration scores, for every layer, every swap of two slots on different nodes by the
   local tokens it gains; each GPU proposes its best swap that keeps both GPUs at or under ``cap`` and puts no
   expert twice on a GPU, and the proposals are accepted best first, each GPU at most once per iteration (so every
   accepted swap's check stays exact). Every accepted swap strictly raises the local tokens, so the search ends.
3. Swaps inside a node change no traffic: the exchange search of "balanced" (1-1 swaps, within nodes) then lowers
   the heaviest GPUs, which frees room under ``cap`` for step 2 again; at most :data:`_ROUNDS` rounds.

The result is within ``tolerance`` of "balanced"'s max/mean on every layer (both steps keep every GPU under
``cap``). This is a first-improvement local search for the generalized assignment of replicas to nodes (profit:
local tokens; capacity: GPU load), in the spirit of SGLang's ``topology_aware.py`` and vLLM's node-local expert
placement; the batching and the even-split traffic model are fdeplb's.
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.balanced import balanced_plan, improve_by_swaps
from fdeplb.placement.metrics import node_local_load

#: rounds of (cross-node swaps, then balancing inside nodes)
_ROUNDS = 3
#: hard cap on cross-node swap iterations per round (each accepts up to num_gpus / 2 swaps per layer)
_MAX_ITER = 500
#: cross-node swaps score this many slots per GPU of largest potential (see :func:`_cross_node_swaps`)
_CANDIDATES = 2
#: local-token gain below which a swap is not worth it, relative to the layer's total tokens
_RTOL = 1e-12


def topology_aware_phy2log(source_load: np.ndarray, num_replicas: int, num_nodes: int, num_gpus: int,
                           tolerance: float) -> np.ndarray:
    """phy2log int64 [L, P] of the "topology_aware" policy (module docstring) on checked inputs: ``source_load``
    [L, num_gpus, E] non-negative, ``tolerance`` >= 0 (max/mean units). With one node it is "balanced"'s plan."""
    load = source_load.sum(axis=1, dtype=np.float64)
    L, E = load.shape
    P, G = num_replicas, num_gpus
    phy2log, peak = balanced_plan(load, P, 1, 1, G)
    if num_nodes == 1:
        return phy2log
    phy2log = phy2log.copy()
    logcnt = np.zeros((L, E), dtype=np.int64)
    np.add.at(logcnt, (np.arange(L)[:, None], phy2log), 1)
    per_replica = load / logcnt
    local = node_local_load(source_load, num_nodes) / logcnt[:, None, :]  # [L, N, E] per replica
    mean = load.sum(axis=1) / G
    cap = np.maximum(peak, (peak / np.where(mean > 0, mean, 1) + tolerance * (1 - 1e-9)) * mean)
    S, Gn = P // G, G // num_nodes
    for _ in range(_ROUNDS):
        if not _cross_node_swaps(phy2log, per_replica, local, cap, G, num_nodes):
            break
        item = np.take_along_axis(per_replica, phy2log, axis=1).reshape(L * num_nodes, Gn, S)
        origin = improve_by_swaps(item, pairs=False).reshape(L * num_nodes, -1)
        phy2log[:] = np.take_along_axis(phy2log.reshape(L * num_nodes, -1), origin, axis=1).reshape(L, P)
    return phy2log


def _cross_node_swaps(phy2log: np.ndarray, per_replica: np.ndarray, local: np.ndarray, cap: np.ndarray,
                      num_gpus: int, num_nodes: int) -> bool:
    """Step 2 of the module docstring on ``phy2log`` int64 [L, P], in place; True when some swap was made.

    A swap's gain is at most the sum of its two slots' potentials (the most local tokens a slot's replica gains
    on any node), so one of the two is among the slots of largest potential: only the :data:`_CANDIDATES` x G
    slots of largest potential are scored against every slot ([L, K, P] arrays)."""
    L, P = phy2log.shape
    G, E = num_gpus, per_replica.shape[1]
    S = P // G
    K = min(P, _CANDIDATES * G)
    gpu = np.arange(P) // S
    node = gpu // (G // num_nodes)
    rows = np.arange(L)[:, None]
    thr = (local.sum(axis=(1, 2)) * _RTOL)[:, None]
    any_swap = False
    for _ in range(_MAX_ITER):
        x = per_replica[rows, phy2log]  # [L, P] item loads
        room = np.repeat(cap[:, None] - x.reshape(L, G, S).sum(axis=2), S, axis=1)  # [L, P] room on its GPU
        on_node = local[rows, :, phy2log]  # [L, P, N]: local tokens of every slot's replica on every node
        here = on_node[rows, np.arange(P)[None, :], node[None, :]]  # [L, P] where it is
        top = np.argsort(here - on_node.max(axis=2), axis=1, kind="stable")[:, :K]  # [L, K] largest potential
        held = np.zeros((L, G, E), dtype=bool)
        held[rows, gpu[None, :], phy2log] = True
        e_top, g_top, n_top = phy2log[rows, top], gpu[top], node[top]
        # [L, K(i), P(j)]: local tokens gained by e_i moving to j's node and e_j moving to i's node
        gain = (np.repeat(on_node[rows, top], P // num_nodes, axis=2) + on_node.transpose(0, 2, 1)[rows, n_top]
                - here[rows, top][:, :, None] - here[:, None, :])
        delta = x[:, None, :] - x[rows, top][:, :, None]  # x_j - x_i: the change on i's GPU
        fits = (delta <= room[rows, top][:, :, None]) & (-delta <= room[:, None, :])
        fits &= n_top[:, :, None] != node[None, None, :]
        fits &= ~np.repeat(held[rows, :, e_top], S, axis=2)  # e_i already on j's GPU
        fits &= ~held[rows[:, :, None], g_top[:, :, None], phy2log[:, None, :]]  # e_j already on i's GPU
        score = np.where(fits & (gain > thr[:, :, None]), gain, -np.inf)
        best_j = score.argmax(axis=2)  # [L, K]
        best = np.take_along_axis(score, best_j[:, :, None], axis=2)[:, :, 0]
        if not np.isfinite(best).any():
            break
        order = np.argsort(-best, axis=1, kind="stable")
        used = np.zeros((L, G), dtype=bool)
        for k in range(K):  # best first, every GPU in at most one swap per iteration (so every check stays exact)
            c = order[:, k]
            i, j = top[rows[:, 0], c], best_j[rows[:, 0], c]
            ok = np.isfinite(best[rows[:, 0], c]) & ~used[rows[:, 0], gpu[i]] & ~used[rows[:, 0], gpu[j]]
            r = np.flatnonzero(ok)
            if r.size == 0:
                if not np.isfinite(best[rows[:, 0], c]).any():
                    break
                continue
            i, j = i[r], j[r]
            phy2log[r, i], phy2log[r, j] = phy2log[r, j], phy2log[r, i]
            used[r, gpu[i]] = used[r, gpu[j]] = True
            any_swap = True
    return any_swap


__all__ = ["topology_aware_phy2log"]
