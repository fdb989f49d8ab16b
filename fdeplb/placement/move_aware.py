"""The "move_aware" policy: repair the current placement just enough to come within a tolerance of "balanced".

Per layer (and per node in hierarchical mode):

1. Target: the GPU-load max/mean that "balanced" reaches on the new loads, plus ``tolerance``.
2. Repair (from the old placement; experts stay in their slots unless moved): while the heaviest GPU is above the
   target, apply the action with the best gain per moved expert, gain capped at what the target needs:
   - *replace*: one slot gets another expert (a replica of an expert with >= 2 replicas is given to an expert that
     needs one), with the slot on the heaviest GPU or the new expert taken from it; costs one moved expert
     (zero when it restores an expert that was there in the old placement);
   - *swap*: a slot of the heaviest GPU trades experts with a slot of another GPU; costs up to two.
   An action is allowed only if it lowers the heaviest GPU and lifts no GPU to its level, so the loop ends.
3. Fallback when the repair gets stuck above the target: the "balanced" plan with its GPUs renumbered to match
   the old GPUs (``scipy.optimize.linear_sum_assignment`` on shared experts), then every slot that can go back to
   its old expert without leaving the target does so.

In hierarchical mode the groups keep the node packing of the "balanced" plan, with nodes renumbered to match the
old placement; experts of groups that changed node are re-placed first. Deterministic: ties keep the first
candidate in slot / expert order.
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.balanced import balanced_phy2log
from fdeplb.placement.metrics import raw_gpu_loads
from fdeplb.placement.slots import align_slots, multiset_overlap, overlap_assignment

_RTOL = 1e-12


class _Row:
    """One (layer, node) row: local expert ids 0..En-1, slots of the node, GPUs of the node."""

    def __init__(self, row: np.ndarray, old: np.ndarray, load: np.ndarray, num_gpus: int):
        self.row = row.copy()
        self.load = load
        self.G = num_gpus
        self.S = row.size // num_gpus
        self.gpu = np.arange(row.size) // self.S
        E = load.size
        self.M = np.zeros((num_gpus, E), dtype=np.int64)
        placed = self.row >= 0  # -1: a slot to fill (its old expert belongs to another node now)
        np.add.at(self.M, (self.gpu[placed], self.row[placed]), 1)
        self.Mo = np.zeros((num_gpus, E), dtype=np.int64)
        known = old >= 0
        np.add.at(self.Mo, (self.gpu[known], old[known]), 1)
        self.old = old
        self.c = self.M.sum(axis=0)

    def loads(self) -> tuple[np.ndarray, np.ndarray]:
        per = self.load / self.c
        return self.M @ per, per

    def replace_effect(self, s, f, loads, per):
        """New GPU loads [K, G] and move cost [K] of putting expert f[k] in slot s[k] (checked: c[e] >= 2)."""
        e = self.row[s]
        gs = self.gpu[s]
        k = np.arange(s.size)
        ne = self.load[e] / (self.c[e] - 1)
        nf = self.load[f] / (self.c[f] + 1)
        Me = self.M[:, e].T
        Mf = self.M[:, f].T
        new = loads + Me * (ne - per[e])[:, None] + Mf * (nf - per[f])[:, None]
        new[k, gs] += nf - ne
        cost = (self.M[gs, f] >= self.Mo[gs, f]).astype(np.int64) - (self.M[gs, e] > self.Mo[gs, e])
        return new, cost

    def apply_replace(self, s: int, f: int) -> None:
        e, g = self.row[s], self.gpu[s]
        self.row[s] = f
        self.M[g, e] -= 1
        self.M[g, f] += 1
        self.c[e] -= 1
        self.c[f] += 1

    def apply_swap(self, a: int, b: int) -> None:
        ea, eb, ga, gb = self.row[a], self.row[b], self.gpu[a], self.gpu[b]
        self.row[a], self.row[b] = eb, ea
        self.M[ga, ea] -= 1
        self.M[ga, eb] += 1
        self.M[gb, eb] -= 1
        self.M[gb, ea] += 1

    # ---- repair ---------------------------------------------------------------------------------------------
    def repair(self, target: float, budget: float) -> float:
        """Lower the heaviest GPU until it is <= target (absolute load); returns the moves it spent (<= budget)."""
        spent = 0
        E, G, S, P = self.load.size, self.G, self.S, self.row.size
        slots = np.arange(P)
        while True:
            loads, per = self.loads()
            gmax = int(loads.argmax())
            peak = loads[gmax]
            if peak <= target:
                return spent
            eps = peak * _RTOL
            need = peak - target
            mine = slots[self.gpu == gmax]
            # replace: a slot of gmax gets any expert, or any slot elsewhere gets an expert of gmax
            f_here = np.flatnonzero(self.M[gmax] > 0)
            s = np.concatenate([np.repeat(mine, E), np.repeat(slots[self.gpu != gmax], f_here.size)])
            f = np.concatenate([np.tile(np.arange(E), mine.size), np.tile(f_here, P - S)])
            keep = (f != self.row[s]) & (self.c[self.row[s]] >= 2)
            s, f = s[keep], f[keep]
            new, cost = self.replace_effect(s, f, loads, per)
            ok = (new[:, gmax] < peak - eps) & (new <= np.maximum(loads, peak - eps)).all(axis=1)
            local_peak = np.where(new != loads, new, -np.inf).max(axis=1)
            score = np.where(ok & (spent + cost <= budget), np.minimum(peak - local_peak, need) / np.maximum(cost, 0.5), -np.inf)
            # swap: a slot of gmax with a slot of another GPU
            a = np.repeat(mine, P)
            b = np.tile(slots, S)
            ea, eb = self.row[a], self.row[b]
            keep = (self.gpu[b] != gmax) & (ea != eb)
            a, b, ea, eb = a[keep], b[keep], ea[keep], eb[keep]
            gb = self.gpu[b]
            d = per[ea] - per[eb]
            na, nb = peak - d, loads[gb] + d
            cost2 = (
                (self.M[gmax, eb] >= self.Mo[gmax, eb]).astype(np.int64) - (self.M[gmax, ea] > self.Mo[gmax, ea])
                + (self.M[gb, ea] >= self.Mo[gb, ea]) - (self.M[gb, eb] > self.Mo[gb, eb])
            )
            ok2 = (na < peak - eps) & (nb < peak - eps) & (spent + cost2 <= budget)
            score2 = np.where(ok2, np.minimum(peak - np.maximum(na, nb), need) / np.maximum(cost2, 0.5), -np.inf)
            i1 = int(score.argmax()) if score.size else -1
            i2 = int(score2.argmax()) if score2.size else -1
            best1 = score[i1] if i1 >= 0 else -np.inf
            best2 = score2[i2] if i2 >= 0 else -np.inf
            if best1 == -np.inf and best2 == -np.inf:
                return spent
            if best1 >= best2:
                self.apply_replace(int(s[i1]), int(f[i1]))
                spent += int(cost[i1])
            else:
                self.apply_swap(int(a[i2]), int(b[i2]))
                spent += int(cost2[i2])

    def revert(self, target: float) -> None:
        """Give slots back their old expert while the heaviest GPU stays <= max(target, current peak)."""
        while True:
            loads, per = self.loads()
            limit = max(target, loads.max())
            s = np.flatnonzero((self.row != self.old) & (self.old >= 0))
            s = s[self.c[self.row[s]] >= 2]
            if s.size == 0:
                return
            new, cost = self.replace_effect(s, self.old[s], loads, per)
            peak = new.max(axis=1)
            ok = (peak <= limit) & (cost < 0)
            if not ok.any():
                return
            i = int(np.where(ok, peak, np.inf).argmin())
            self.apply_replace(int(s[i]), int(self.old[s[i]]))

    def fill(self) -> None:
        """Give every free slot (-1) an expert: first the experts without a slot, heaviest first, each on the lightest
        GPU with a free slot; then the expert with the largest load per replica. Frees duplicate slots if needed."""
        free = self.row < 0
        missing = [int(e) for e in np.argsort(-self.load, kind="stable") if self.c[e] == 0]
        if not free.any() and not missing:
            return
        while len(missing) > free.sum():  # not enough room: drop the replica whose removal costs least
            spare = np.flatnonzero(self.c >= 2)
            e = int(spare[np.argmin(self.load[spare] / (self.c[spare] - 1))])
            s = int(np.flatnonzero((self.row == e) & ~free)[-1])
            self.M[self.gpu[s], e] -= 1
            self.c[e] -= 1
            self.row[s] = -1
            free[s] = True
        while free.any():
            if missing:
                e = int(missing.pop(0))
            else:
                e = int(np.argmax(self.load / np.maximum(self.c, 1)))
            per = self.load / np.maximum(self.c, 1)
            gpu_load = self.M @ per
            candidates = np.flatnonzero(free)
            s = int(candidates[np.argmin(gpu_load[self.gpu[candidates]])])
            self.row[s] = e
            free[s] = False
            self.M[self.gpu[s], e] += 1
            self.c[e] += 1


def _node_of_groups(
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


def move_aware_phy2log(
    expert_load: np.ndarray,
    old_phy2log: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    tolerance: float = 0.001,
    max_moved_experts: int | None = None,
) -> np.ndarray:
    """Move-aware plan on checked inputs (``num_groups``/``num_nodes`` = 1 for global); returns phy2log [L, P]."""
    load = np.asarray(expert_load, dtype=np.float64)
    old = np.asarray(old_phy2log, dtype=np.int64)
    L, E = load.shape
    P = num_replicas
    fresh = balanced_phy2log(expert_load, P, num_groups, num_nodes, num_gpus)
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = P // num_nodes
    S = P // num_gpus
    mean = load.sum(axis=1) / num_gpus
    fresh_peak = raw_gpu_loads(load, fresh, num_gpus).max(axis=1)
    # a hair under the tolerance so that the ratio recomputed from scratch stays within it
    target = np.maximum(fresh_peak, (fresh_peak / np.where(mean > 0, mean, 1) + tolerance * (1 - 1e-9)) * mean)
    group_size = E // num_groups
    if num_nodes > 1:
        group_node = _node_of_groups(fresh, old, num_groups, num_nodes, group_size)
    else:
        group_node = np.zeros((L, num_groups), dtype=np.int64)
    budget = np.inf if max_moved_experts is None else float(max_moved_experts)
    out = np.empty_like(old)
    # worst layers first, so that a move budget goes where it helps most
    old_peak = raw_gpu_loads(load, old, num_gpus).max(axis=1)
    for layer in np.argsort(-(old_peak - target), kind="stable"):
        fresh_node = np.empty(num_groups, dtype=np.int64)
        fresh_node[fresh[layer] // group_size] = np.arange(P) // slots_per_node
        node_perm = np.empty(num_nodes, dtype=np.int64)
        node_perm[group_node[layer]] = fresh_node  # old-numbered node -> fresh node
        for node in range(num_nodes):
            experts = np.flatnonzero(group_node[layer][np.arange(E) // group_size] == node)  # local -> global id
            local = np.full(E, -1, dtype=np.int64)
            local[experts] = np.arange(experts.size)
            span = slice(node * slots_per_node, (node + 1) * slots_per_node)
            old_local = local[old[layer, span]]
            row = _Row(old_local, old_local, load[layer, experts], gpus_per_node)
            row.fill()
            spent = int(np.maximum(row.M - row.Mo, 0).sum())
            spent += row.repair(target[layer], budget - spent)
            if row.loads()[0].max() > target[layer] and budget == np.inf:
                fresh_span = slice(node_perm[node] * slots_per_node, (node_perm[node] + 1) * slots_per_node)
                candidate = local[fresh[layer, fresh_span]].reshape(gpus_per_node, S)
                old_bins = np.where(old_local < 0, experts.size, old_local).reshape(gpus_per_node, S)
                perm = overlap_assignment(multiset_overlap(candidate, old_bins, experts.size + 1))
                matched = np.empty_like(candidate)
                matched[perm] = candidate
                alt = _Row(matched.ravel(), old_local, load[layer, experts], gpus_per_node)
                alt.revert(target[layer])
                row, spent = alt, int(np.maximum(alt.M - alt.Mo, 0).sum())
            budget -= spent
            out[layer, span] = experts[row.row]
    return align_slots(old, out, num_gpus)
