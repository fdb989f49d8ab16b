"""The per-layer engine of "move_aware": one (layer, node) row at a time, scalar in the row's actions.

It serves the capped path in hierarchical mode (``max_moved_experts``: every layer repaired within what is left of
the budget; in global mode only as a guard, :mod:`fdeplb.placement.pareto` plans it) and the layers the batched
uncapped repair (:mod:`fdeplb.placement.repair`) leaves stuck. It owns:

- ``_Row``: one row's slots and counts, with its repair (*replace* and *swap* actions, best gain per moved expert,
  see steps 2 and 3 of :mod:`fdeplb.placement.move_aware`), ``revert`` (slots given back their old expert) and
  ``fill`` (free slots filled LPT);
- ``_Candidate``: one group-to-node map of a layer, its node rows filled after relocating the groups that changed
  node, and what that cost (:func:`layer_candidates` builds a layer's candidates);
- :func:`plan_layer` (one candidate, repaired node by node, with the fallback onto the "balanced" plan) and
  :func:`best_layer_plan` (the best candidate within a budget).
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.slots import multiset_overlap, overlap_assignment

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
        E, S, P = self.load.size, self.S, self.row.size
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
            score = np.where(ok & (spent + cost <= budget), np.minimum(peak - local_peak, need) / np.maximum(cost, 0.5),
                             -np.inf)
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


class _Candidate:
    """One way to plan a layer: a group-to-node map, its nodes' rows after relocating the groups that changed node
    (``fill``), and what that relocation cost in moved experts."""

    def __init__(self, group_node: np.ndarray, load_row: np.ndarray, old_row: np.ndarray, num_nodes: int,
                 gpus_per_node: int, group_size: int, node_perm: np.ndarray | None = None):
        E = load_row.size
        slots_per_node = old_row.size // num_nodes
        self.group_node = group_node
        self.node_perm = node_perm  # old-numbered node -> node of the fresh plan (fresh packing only)
        self.nodes = []
        for node in range(num_nodes):
            experts = np.flatnonzero(group_node[np.arange(E) // group_size] == node)  # local -> global id
            local = np.full(E, -1, dtype=np.int64)
            local[experts] = np.arange(experts.size)
            span = slice(node * slots_per_node, (node + 1) * slots_per_node)
            old_local = local[old_row[span]]
            row = _Row(old_local, old_local, load_row[experts], gpus_per_node)
            row.fill()
            self.nodes.append([span, experts, local, old_local, row])
        self.fill_cost = sum(_cost(n[-1]) for n in self.nodes)


def layer_candidates(load_row: np.ndarray, old_row: np.ndarray, fresh_row: np.ndarray, old_map: np.ndarray,
                     fresh_map: np.ndarray, num_nodes: int, gpus_per_node: int, group_size: int) -> list[_Candidate]:
    """The candidates of one layer: the old map's first (when it differs from the balanced one), then the balanced
    map's. ``old_map``/``fresh_map`` int64 [num_groups]: node of every group (:mod:`fdeplb.placement.node_maps`);
    ``fresh_row`` int64 [P]: the "balanced" plan of the layer (its node packing gives the balanced map's node
    renumbering)."""
    P = old_row.size
    fresh_node = np.empty(old_map.size, dtype=np.int64)
    fresh_node[fresh_row // group_size] = np.arange(P) // (P // num_nodes)
    node_perm = np.empty(num_nodes, dtype=np.int64)
    node_perm[fresh_map] = fresh_node
    cands = []
    if num_nodes > 1 and not (old_map == fresh_map).all():
        cands.append(_Candidate(old_map, load_row, old_row, num_nodes, gpus_per_node, group_size))
    cands.append(_Candidate(fresh_map, load_row, old_row, num_nodes, gpus_per_node, group_size, node_perm))
    return cands


def _cost(row: _Row) -> int:
    """Moved experts of a row against its old contents."""
    return int(np.maximum(row.M - row.Mo, 0).sum())


def plan_layer(cand: _Candidate, fresh_row: np.ndarray, load_row: np.ndarray, target: float, budget: float,
               gpus_per_node: int, S: int, repair: bool = True) -> tuple[np.ndarray, int, float]:
    """Repair every node of ``cand`` within ``budget`` (which already covers its fill cost); returns (new phy2log row,
    moved experts, heaviest GPU load). ``repair=False`` (balanced map, no cap): every node takes the fallback."""
    out = np.empty(fresh_row.size, dtype=np.int64)
    spent = cand.fill_cost
    peak = -np.inf
    slots_per_node = gpus_per_node * S
    for span, experts, local, old_local, row in cand.nodes:
        if repair:
            spent += row.repair(target, budget - spent)
        if (not repair or row.loads()[0].max() > target) and budget == np.inf and cand.node_perm is not None:
            fresh_node = cand.node_perm[span.start // slots_per_node]
            fresh_span = slice(fresh_node * slots_per_node, (fresh_node + 1) * slots_per_node)
            candidate = local[fresh_row[fresh_span]].reshape(gpus_per_node, S)
            old_bins = np.where(old_local < 0, experts.size, old_local).reshape(gpus_per_node, S)
            perm = overlap_assignment(multiset_overlap(candidate, old_bins, experts.size + 1))
            matched = np.empty_like(candidate)
            matched[perm] = candidate
            alt = _Row(matched.ravel(), old_local, load_row[experts], gpus_per_node)
            alt.revert(target)
            spent += _cost(alt) - _cost(row)
            row = alt
        out[span] = experts[row.row]
        peak = max(peak, float(row.loads()[0].max()))
    return out, int(spent), peak


def _better(a: tuple[np.ndarray, int, float], b: tuple[np.ndarray, int, float], target: float) -> bool:
    """Is plan ``a`` strictly better than ``b``: within the target beats above it; within it, fewer moves; above
    it, a lower heaviest GPU, then fewer moves."""
    a_ok, b_ok = a[2] <= target, b[2] <= target
    if a_ok != b_ok:
        return a_ok
    if not a_ok and abs(a[2] - b[2]) > _RTOL * max(abs(a[2]), abs(b[2])):
        return a[2] < b[2]
    return a[1] < b[1]


def best_layer_plan(cands: list[_Candidate], fresh_row: np.ndarray, load_row: np.ndarray, target: float,
                    budget: float, gpus_per_node: int, S: int) -> tuple[np.ndarray, int, float]:
    """:func:`plan_layer` on every candidate whose fill cost ``budget`` covers; the best by :func:`_better` (ties:
    the first). Returns (phy2log row, moved experts, heaviest GPU load)."""
    best = None
    for cand in cands:
        if cand.fill_cost > budget:
            continue
        plan = plan_layer(cand, fresh_row, load_row, target, budget, gpus_per_node, S)
        if best is None or _better(plan, best, target):
            best = plan
    return best
