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

In hierarchical mode every layer has up to two group-to-node maps: the old placement's (as it is when the old
placement keeps every group on one node; otherwise the packing with num_groups / num_nodes groups per node that
keeps the most old slots) and the node packing of the "balanced" plan, with nodes renumbered to match the old
placement. For each map, experts of groups that changed node are re-placed first (their moves are charged to
``max_moved_experts`` like any other), then the steps above run inside each node. A map whose relocation the
remaining budget cannot pay is skipped; of the others the layer keeps the plan within the target that moves
fewest experts, or, when none reaches it, the one with the lightest heaviest GPU (ties: the old map). Moves that
no map avoids (an old placement that spreads groups over nodes) are reserved before any layer is repaired; a cap
below them is an error. With the cap at 0 (and groups on nodes) the old placement comes back unchanged.
Deterministic: ties keep the first candidate in slot / expert order.

Without a move cap every layer is independent and a different, vectorised plan runs on all (layer, node) rows at
once (:func:`repair_rows`): replica counts first (the old ones, changed only while an expert's per-replica load
exceeds ``_MAX_ITEM_SHARE`` of the mean GPU load), every old replica that keeps its count stays in its slot, the
other replicas go LPT-style into the freed slots, then swaps between the ``_HEAVY_GPUS`` heaviest and the
``_LIGHT_GPUS`` lightest GPUs (best gain per moved expert) until the target holds. In hierarchical mode a layer keeps
the old group-to-node map when its heaviest node spread over its GPUs is within the target, else takes the balanced
map. Layers this leaves above the target go through the per-layer repair and fallback above. With a cap the layers
are repaired one at a time, worst first, so that the budget goes where it helps most.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError
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


# ---- the uncapped fast path: all (layer, node) rows at once --------------------------------------------------------
#: partners of a swap are looked for on this many lightest GPUs of the row (besides the heaviest one)
_LIGHT_GPUS = 8
#: heaviest GPUs of a row that each get a swap in one iteration
_HEAVY_GPUS = 4
#: hard cap on iterations of the swap repair (each applies one swap per active row)
_MAX_ITER = 10_000


def choose_counts(load: np.ndarray, old_count: np.ndarray, num_slots: int, max_item: np.ndarray) -> np.ndarray:
    """Replica counts int64 [R, En] per row that change ``old_count`` least: every expert gets >= 1, the total is
    ``num_slots``, and replicas move (one at a time, from the expert whose per-replica load rises least to the one
    with the largest per-replica load, DeepSeek's replicate rule) while some per-replica load exceeds ``max_item``
    [R] and the move lowers the largest one. Deterministic: ties take the lowest expert id."""
    R, En = load.shape
    c = np.maximum(old_count, 1).astype(np.int64)
    r = np.arange(R)
    for _ in range(num_slots + 2 * En):
        surplus = c.sum(axis=1) - num_slots
        per = load / c
        drop_cost = np.where(c >= 2, load / np.maximum(c - 1, 1), np.inf)
        give = per.argmax(axis=1)
        take = drop_cost.argmin(axis=1)
        peak = per[r, give]
        shift = (surplus == 0) & (peak > max_item) & (drop_cost[r, take] < peak) & (take != give)
        add = surplus < 0
        sub = surplus > 0
        if not (shift.any() or add.any() or sub.any()):
            break
        c[r[add | shift], give[add | shift]] += 1
        c[r[sub | shift], take[sub | shift]] -= 1
    return c


def _rank_within(keys_major: np.ndarray, *minor: np.ndarray) -> np.ndarray:
    """For [R, n] arrays: the rank of every element among the elements of its row with the same ``keys_major``
    value, ordered by the ``minor`` keys (first is most significant), then by position."""
    R, n = keys_major.shape
    rows = np.broadcast_to(np.arange(R)[:, None], (R, n)).ravel()
    pos = np.broadcast_to(np.arange(n), (R, n)).ravel()
    order = np.lexsort((pos, *[m.ravel() for m in reversed(minor)], keys_major.ravel(), rows))
    grp = rows[order] * (int(keys_major.max(initial=0)) + 2) + keys_major.ravel()[order]
    start = np.r_[True, grp[1:] != grp[:-1]]
    idx = np.arange(order.size)
    first = np.maximum.accumulate(np.where(start, idx, 0))
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = idx - first
    return rank.reshape(R, n)


def repair_rows(old_local: np.ndarray, load: np.ndarray, targets: np.ndarray, num_gpus: int,
                max_item: np.ndarray) -> np.ndarray:
    """Move-aware plan of many rows at once (a row = one layer, or one node of a layer): int64 [R, Pn] local ids.

    1. Replica counts: :func:`choose_counts` from the old counts.
    2. Every old replica whose expert keeps that many replicas stays in its slot (an expert with fewer replicas
       keeps those on its lightest GPUs); the other slots are free (and so are slots marked -1 in ``old_local``).
    3. The replicas without a slot, heaviest first, each go to the lightest GPU with a free slot (LPT).
    4. Swaps between the heaviest GPU and the ``_LIGHT_GPUS`` lightest ones while the heaviest is above its target:
       the swap with the best gain per moved expert (gain capped at what the target needs) that lowers the heaviest
       GPU and lifts no GPU to its level; rows that get stuck stop there (the caller checks the target).

    Args:
        old_local: int64 [R, Pn] expert of every slot in the old placement (-1: a slot to fill).
        load: float64 [R, En] load of every expert of the row.
        targets: float64 [R] absolute GPU load every row should come down to.
        num_gpus: GPUs per row (Pn a multiple of it).
        max_item: float64 [R] per-replica load above which replicas are re-assigned (step 1).
    """
    R, Pn = old_local.shape
    En = load.shape[1]
    G, S = num_gpus, Pn // num_gpus
    r = np.arange(R)
    known = old_local >= 0
    safe_old = np.where(known, old_local, En)  # En: a dummy expert of no load
    old_count = np.zeros((R, En + 1), dtype=np.int64)
    np.add.at(old_count, (r[:, None], safe_old), 1)
    c = choose_counts(load, old_count[:, :En], Pn, max_item)
    per = np.concatenate([load / c, np.zeros((R, 1))], axis=1)
    gpu_of_slot = np.arange(Pn) // S
    # 2. keep
    old_gpu_load = per[r[:, None], safe_old].reshape(R, G, S).sum(axis=2)
    rank = _rank_within(safe_old, old_gpu_load[:, gpu_of_slot])
    c_ext = np.concatenate([c, np.zeros((R, 1), dtype=np.int64)], axis=1)
    kept = known & (rank < c_ext[r[:, None], safe_old])
    row = np.where(kept, old_local, -1)
    kept_count = np.zeros((R, En + 1), dtype=np.int64)
    np.add.at(kept_count, (r[:, None], np.where(kept, old_local, En)), 1)
    need = c - kept_count[:, :En]  # replicas to place, per expert
    # 3. LPT of the replicas without a slot
    n_items = need.sum(axis=1)
    K = int(n_items.max(initial=0))
    if K:
        items = np.full((R, K), -1, dtype=np.int64)
        flat_r = np.repeat(np.repeat(r, En), need.ravel())
        flat_e = np.repeat(np.tile(np.arange(En), R), need.ravel())
        key = np.lexsort((flat_e, -per[flat_r, flat_e], flat_r))
        flat_r, flat_e = flat_r[key], flat_e[key]
        starts = np.cumsum(n_items) - n_items
        items[flat_r, np.arange(flat_r.size) - starts[flat_r]] = flat_e
        gpu_load = per[r[:, None], np.where(kept, old_local, En)].reshape(R, G, S).sum(axis=2)
        free = (row < 0).reshape(R, G, S)
        for j in range(K):
            act = np.flatnonzero(items[:, j] >= 0)
            e = items[act, j]
            fr = free[act]
            g = np.where(fr.any(axis=2), gpu_load[act], np.inf).argmin(axis=1)
            s = fr[np.arange(act.size), g].argmax(axis=1)
            row[act, g * S + s] = e
            free[act, g, s] = False
            gpu_load[act, g] += per[act, e]
    # 4. swaps
    M = np.zeros((R, G, En + 1), dtype=np.int16)
    np.add.at(M, (r[:, None], gpu_of_slot, row), 1)
    Mo = np.zeros((R, G, En + 1), dtype=np.int16)
    np.add.at(Mo, (r[:, None], gpu_of_slot, safe_old), 1)
    if G < 2:
        return row
    K = min(_LIGHT_GPUS, G - 1)
    H = min(_HEAVY_GPUS, G - 1)
    T = np.asarray(targets, dtype=np.float64)
    item = per[r[:, None], row]  # [R, Pn] load of every slot
    gpu_load = item.reshape(R, G, S).sum(axis=2)
    active = np.flatnonzero(gpu_load.max(axis=1) > T)
    arS = np.arange(S)
    for _ in range(_MAX_ITER):
        if active.size == 0:
            break
        n = active.size
        q = np.arange(n)
        A1, A2 = active[:, None], active[:, None, None]
        loads = gpu_load[active]
        Ta = T[active]
        order = np.argsort(-loads, axis=1, kind="stable")
        hs = order[:, :H]  # [n, H] heaviest GPUs
        light = order[:, ::-1][:, :K]  # [n, K] lightest GPUs
        peak = np.take_along_axis(loads, hs, axis=1)
        heavy_ok = peak > Ta[:, None]
        light_load = np.take_along_axis(loads, light, axis=1)
        a = hs[:, :, None] * S + arS  # [n, H, S]
        b = (light[:, :, None] * S + arS).reshape(n, K * S)  # [n, KS]
        rowa = row[active]
        ea = np.take_along_axis(rowa, a.reshape(n, -1), axis=1).reshape(n, H, S)
        eb = np.take_along_axis(rowa, b, axis=1)
        xa = np.take_along_axis(item[active], a.reshape(n, -1), axis=1).reshape(n, H, S)
        xb = np.take_along_axis(item[active], b, axis=1)
        d = xa[..., None] - xb[:, None, None, :]  # [n, H, S, KS]
        na = peak[:, :, None, None] - d
        nb = np.repeat(light_load, S, axis=1)[:, None, None, :] + d
        lim = (peak * (1 - _RTOL))[:, :, None, None]
        # moved experts: an expert arriving costs one unless it returns to a GPU that lost it; one leaving a GPU
        # it was moved to saves one
        extra = M[A1, gpu_of_slot, rowa] > Mo[A1, gpu_of_slot, rowa]  # [n, Pn]
        leave_a = np.take_along_axis(extra, a.reshape(n, -1), axis=1).reshape(n, H, S)
        leave_b = np.take_along_axis(extra, b, axis=1)
        arrive_b = M[A2, hs[:, :, None], eb[:, None, :]] >= Mo[A2, hs[:, :, None], eb[:, None, :]]  # [n, H, KS]
        A4 = active[:, None, None, None]
        arrive_a = np.repeat(M[A4, light[:, None, None, :], ea[..., None]]
                             >= Mo[A4, light[:, None, None, :], ea[..., None]], S, axis=3)  # [n, H, S, KS]
        cost = (arrive_b[:, :, None, :].astype(np.int8) - leave_a[..., None] + arrive_a - leave_b[:, None, None, :])
        ok = ((na < lim) & (nb < lim) & (ea[..., None] != eb[:, None, None, :])
              & heavy_ok[:, :, None, None] & (light_load <= Ta[:, None]).repeat(S, axis=1)[:, None, None, :])
        gain = np.minimum(peak[:, :, None, None] - np.maximum(na, nb), (peak - Ta[:, None])[:, :, None, None])
        score = np.where(ok, gain / np.maximum(cost, 0.5), -np.inf).reshape(n, H, -1)
        best = score.argmax(axis=2)  # [n, H]
        found = np.take_along_axis(score, best[..., None], axis=2)[..., 0] > -np.inf
        i, j = np.divmod(best, K * S)
        taken = np.zeros((n, G), dtype=bool)
        for k in range(H):  # heaviest first; a partner GPU takes one swap per iteration
            sa = a[q, k, i[:, k]]
            sb = b[q, j[:, k]]
            gbb = sb // S
            acc = found[:, k] & ~taken[q, gbb]
            taken[q[acc], gbb[acc]] = True
            rr, sa, sb, gbb = active[acc], sa[acc], sb[acc], gbb[acc]
            ga = sa // S
            va, vb = row[rr, sa], row[rr, sb]
            row[rr, sa], row[rr, sb] = vb, va
            M[rr, ga, va] -= 1
            M[rr, ga, vb] += 1
            M[rr, gbb, vb] -= 1
            M[rr, gbb, va] += 1
            wa, wb = item[rr, sa], item[rr, sb]
            item[rr, sa], item[rr, sb] = wb, wa
            gpu_load[rr, ga] += wb - wa
            gpu_load[rr, gbb] += wa - wb
        progressed = active[found.any(axis=1)]
        active = progressed[gpu_load[progressed].max(axis=1) > T[progressed]]
    return row


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


def _old_node_of_groups(old_row: np.ndarray, num_groups: int, num_nodes: int, group_size: int) -> np.ndarray:
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


def _cost(row: _Row) -> int:
    """Moved experts of a row against its old contents."""
    return int(np.maximum(row.M - row.Mo, 0).sum())


def _plan_layer(cand: _Candidate, fresh_row: np.ndarray, load_row: np.ndarray, target: float, budget: float,
                gpus_per_node: int, S: int, repaired: bool = False) -> tuple[np.ndarray, int, float]:
    """Repair every node of ``cand`` within ``budget`` (which already covers its fill cost); returns (new phy2log row,
    moved experts, heaviest GPU load). ``repaired``: the rows went through :func:`repair_rows` already."""
    out = np.empty(fresh_row.size, dtype=np.int64)
    spent = cand.fill_cost
    peak = -np.inf
    slots_per_node = gpus_per_node * S
    for span, experts, local, old_local, row in cand.nodes:
        spent += row.repaired if repaired else row.repair(target, budget - spent)
        if row.loads()[0].max() > target and budget == np.inf and cand.node_perm is not None:
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
    """Move-aware plan on checked inputs (``num_groups``/``num_nodes`` = 1 for global); returns phy2log [L, P].

    Raises:
        InputError: in hierarchical mode, ``max_moved_experts`` below the moves needed to bring every group of an
            old placement that spreads groups over nodes onto one node.
    """
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
    # every layer's group-to-node maps: the old one (kept as is when the old placement keeps groups on nodes) and
    # the balanced plan's packing renumbered to match old
    if num_nodes > 1:
        group_node = _node_of_groups(fresh, old, num_groups, num_nodes, group_size)
        old_maps = np.stack([_old_node_of_groups(old[layer], num_groups, num_nodes, group_size) for layer in range(L)])
    else:
        group_node = old_maps = np.zeros((L, num_groups), dtype=np.int64)

    def candidates_of(layer: int) -> list[_Candidate]:
        """The old map's candidate first (when it differs from the balanced one), then the balanced map's."""
        fresh_node = np.empty(num_groups, dtype=np.int64)
        fresh_node[fresh[layer] // group_size] = np.arange(P) // slots_per_node
        node_perm = np.empty(num_nodes, dtype=np.int64)
        node_perm[group_node[layer]] = fresh_node
        cands = []
        if num_nodes > 1 and not (old_maps[layer] == group_node[layer]).all():
            cands.append(_Candidate(old_maps[layer], load[layer], old[layer], num_nodes, gpus_per_node, group_size))
        cands.append(_Candidate(group_node[layer], load[layer], old[layer], num_nodes, gpus_per_node, group_size,
                                node_perm))
        return cands

    if max_moved_experts is None:  # no cap: every layer is independent, plan all (layer, node) rows at once
        out = _plan_all(load, old, target, mean, old_maps, group_node, num_nodes, num_gpus)
        peak = raw_gpu_loads(load, out, num_gpus).max(axis=1)
        for layer in np.flatnonzero(peak > target):  # stuck rows: the per-layer repair with its fallback
            best = None
            for cand in candidates_of(layer):
                plan = _plan_layer(cand, fresh[layer], load[layer], target[layer], np.inf, gpus_per_node, S)
                if best is None or _better(plan, best, target[layer]):
                    best = plan
            out[layer] = best[0]
        return align_slots(old, out, num_gpus)
    candidates = [candidates_of(layer) for layer in range(L)]
    # moves no plan can avoid (groups spread over nodes in the old placement) are reserved first
    reserve = np.array([min(c.fill_cost for c in cands) for cands in candidates], dtype=np.float64)
    budget = np.inf if max_moved_experts is None else float(max_moved_experts)
    if reserve.sum() > budget:
        layers = np.flatnonzero(reserve > 0)
        raise InputError(
            f"max_moved_experts={max_moved_experts} cannot be met: old_phy2log spreads expert groups over nodes "
            f"(layers {layers[:8].tolist()}{' ...' if layers.size > 8 else ''}) and putting every group on one "
            f"node moves {int(reserve.sum())} experts"
        )
    budget -= reserve.sum()
    out = np.empty_like(old)
    # worst layers first, so that a move budget goes where it helps most
    old_peak = raw_gpu_loads(load, old, num_gpus).max(axis=1)
    for layer in np.argsort(-(old_peak - target), kind="stable"):
        layer_budget = budget + reserve[layer]
        best = None
        for cand in candidates[layer]:
            if cand.fill_cost > layer_budget:
                continue
            plan = _plan_layer(cand, fresh[layer], load[layer], target[layer], layer_budget, gpus_per_node, S)
            if best is None or _better(plan, best, target[layer]):
                best = plan
        out[layer] = best[0]
        budget = layer_budget - best[1]
    return align_slots(old, out, num_gpus)


#: "move_aware" re-assigns replicas (changes replica counts) while an expert's per-replica load exceeds this share
#: of the mean GPU load
_MAX_ITEM_SHARE = 0.3


def _plan_all(load: np.ndarray, old: np.ndarray, target: np.ndarray, mean: np.ndarray, old_maps: np.ndarray,
              fresh_maps: np.ndarray, num_nodes: int, num_gpus: int) -> np.ndarray:
    """The uncapped plan of every layer: :func:`repair_rows` on all (layer, node) rows; int64 [L, P].

    A layer already within its target whose groups sit on whole nodes keeps its placement. Otherwise the layer
    keeps the old group-to-node map when its heaviest node, spread evenly over its GPUs, is within the target, and
    takes the balanced plan's (renumbered) map otherwise."""
    L, E = load.shape
    P = old.shape[1]
    num_groups = old_maps.shape[1]
    group_size = E // num_groups
    En, Pn, Gn = E // num_nodes, P // num_nodes, num_gpus // num_nodes
    layers = np.arange(L)
    old_peak = raw_gpu_loads(load, old, num_gpus).max(axis=1)
    node_of_slot = np.arange(P) // Pn
    on_nodes = (old_maps[layers[:, None], old // group_size] == node_of_slot).all(axis=1)
    todo = np.flatnonzero(~(on_nodes & (old_peak <= target)))
    out = old.copy()
    if todo.size == 0:
        return out
    node_load = np.zeros((L, num_nodes))
    np.add.at(node_load, (layers[:, None], old_maps), load.reshape(L, num_groups, group_size).sum(axis=2))
    maps = np.where((node_load.max(axis=1) / Gn <= target)[:, None], old_maps, fresh_maps)[todo]
    n = todo.size
    expert_node = np.repeat(maps, group_size, axis=1)  # [n, E]
    experts_of = np.argsort(expert_node * E + np.arange(E), axis=1, kind="stable").reshape(n, num_nodes, En)
    local = np.empty((n, E), dtype=np.int64)
    np.put_along_axis(local, experts_of.reshape(n, E), np.broadcast_to(np.arange(E) % En, (n, E)), axis=1)
    o = old[todo]
    rows_idx = np.arange(n)[:, None]
    old_local = np.where(expert_node[rows_idx, o] == node_of_slot, local[rows_idx, o], -1).reshape(n * num_nodes, Pn)
    row_load = load[todo[:, None, None], experts_of].reshape(n * num_nodes, En)
    rows = repair_rows(old_local, row_load, np.repeat(target[todo], num_nodes), Gn,
                       np.repeat(_MAX_ITEM_SHARE * mean[todo], num_nodes))
    out[todo] = np.take_along_axis(experts_of, rows.reshape(n, num_nodes, Pn), axis=2).reshape(n, P)
    return out
