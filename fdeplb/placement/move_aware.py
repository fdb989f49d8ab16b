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

Without a move cap every layer is independent: step 2 then runs on all (layer, node) rows at once
(:func:`repair_rows`, one action per active row per iteration, candidates narrowed to the heaviest GPU's slots,
the lightest GPUs' slots and a few new experts), which is an order of magnitude faster than the per-row loop and
moves a few percent more experts. With a cap the layers are repaired one at a time, worst first, so that the
budget goes where it helps most.
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


# ---- all rows at once (no move cap) ------------------------------------------------------------------------------------
#: swap and replace partners are looked for on this many lightest GPUs of the row (besides the heaviest one)
_LIGHT_GPUS = 6
#: experts tried as the new expert of a slot of the heaviest GPU (half of them restoring old contents)
_NEW_EXPERTS = 16
#: hard cap on iterations of the batched repair (each applies one action per active row)
_MAX_ITER = 10_000


def _take(a: np.ndarray, *idx: np.ndarray) -> np.ndarray:
    """``a[r, idx...]`` for every row r of ``a`` (idx broadcast against a leading row axis)."""
    r = np.arange(a.shape[0]).reshape((-1,) + (1,) * (max(i.ndim for i in idx) - 1))
    return a[(r, *idx)]


def repair_rows(rows: list[_Row], targets: np.ndarray) -> None:
    """:meth:`_Row.repair` without a move budget, on many rows of one shape at once; rows are modified in place.

    Same greedy (best gain per moved expert, gain capped at what the target needs; an action must lower the heaviest
    GPU and lift no GPU to its level), on a narrower candidate set so that one iteration is a few numpy expressions
    over all active rows: swaps of a slot of the heaviest GPU with a slot of the ``_LIGHT_GPUS`` lightest GPUs;
    a slot of the heaviest GPU given to one of ``_NEW_EXPERTS`` experts (those that lower that GPU most, restoring
    old contents first); a slot of a light GPU given to an expert of the heaviest GPU. Loads of GPUs that only lose
    load are not tracked (the gain is the bound on the raised ones). Deterministic: ties keep the first candidate.

    Args:
        rows: :class:`_Row` objects with equal ``G``, ``S`` and expert count.
        targets: float64 [len(rows)], absolute GPU load each row must come down to.
    """
    if not rows:
        return
    G, S, E = rows[0].G, rows[0].S, rows[0].load.size
    P = G * S
    if G < 2:
        return
    row = np.stack([r.row for r in rows])
    M = np.stack([r.M for r in rows]).astype(np.int16)  # counts <= S: small ints keep the gathers cheap
    Mo = np.stack([r.Mo for r in rows]).astype(np.int16)
    c = np.stack([r.c for r in rows])
    load = np.stack([r.load for r in rows])
    T = np.asarray(targets, dtype=np.float64)
    K = min(_LIGHT_GPUS, G - 1)
    KF = min(_NEW_EXPERTS, E)
    half = KF // 2
    active = np.arange(len(rows))
    for _ in range(_MAX_ITER):
        ca, rowa, la = c[active], row[active], load[active]
        per = la / np.maximum(ca, 1)
        loads = np.take_along_axis(per, rowa, axis=1).reshape(-1, G, S).sum(axis=2)
        gmax = loads.argmax(axis=1)
        r = np.arange(active.size)
        peak = loads[r, gmax]
        keep = peak > T[active]
        if not keep.all():
            active, ca, rowa, la, per, loads, gmax, peak = (
                x[keep] for x in (active, ca, rowa, la, per, loads, gmax, peak))
            r = np.arange(active.size)
        n = active.size
        if n == 0:
            break
        A1, A2, A3 = active[:, None], active[:, None, None], active
        eps = peak * _RTOL
        need = peak - T[active]
        lim = peak - eps
        # light GPUs and their slots
        masked = loads.copy()
        masked[r, gmax] = np.inf
        light = np.argsort(masked, axis=1, kind="stable")[:, :K]  # [n, K]
        a = gmax[:, None] * S + np.arange(S)  # [n, S] slots of the heaviest GPU
        b = (light[:, :, None] * S + np.arange(S)).reshape(n, K * S)  # [n, KS]
        gb = b // S
        ea, eb = _take(rowa, a), _take(rowa, b)
        pa, pb = _take(per, ea), _take(per, eb)
        Mg = M[A3, gmax]  # [n, E] heaviest GPU's contents
        Mog = Mo[A3, gmax]
        # -- swap a <-> b
        d = pa[:, :, None] - pb[:, None, :]
        na = peak[:, None, None] - d
        nb = _take(loads, gb)[:, None, :] + d
        M_gb_eb, Mo_gb_eb = M[A1, gb, eb], Mo[A1, gb, eb]
        cost_s = ((_take(Mg, eb) >= _take(Mog, eb)).astype(np.int64)[:, None, :]
                  - (_take(Mg, ea) > _take(Mog, ea))[:, :, None]
                  + (M[A2, gb[:, None, :], ea[:, :, None]] >= Mo[A2, gb[:, None, :], ea[:, :, None]])
                  - (M_gb_eb > Mo_gb_eb)[:, None, :])
        ok = (na < lim[:, None, None]) & (nb < lim[:, None, None]) & (ea[:, :, None] != eb[:, None, :])
        score_s = np.where(ok, np.minimum(peak[:, None, None] - np.maximum(na, nb), need[:, None, None])
                           / np.maximum(cost_s, 0.5), -np.inf).reshape(n, -1)
        # -- replace: slot a of the heaviest GPU gets expert f
        ce = _take(ca, ea)
        two = ce >= 2
        ne = np.where(two, _take(la, ea) / np.maximum(ce - 1, 1), 0.0)
        de = ne - pa  # rise of every replica of ea
        Mea = M[A1, :, ea]  # [n, S, G]
        up = np.where(Mea > 0, loads[:, None, :] + Mea * de[:, :, None], -np.inf)  # GPUs holding ea rise
        up[r, :, gmax] = -np.inf
        up_max = up.max(axis=2)  # [n, S]
        nf_all = la / (ca + 1)
        hf = nf_all + Mg * (nf_all - per)  # what expert f adds to the heaviest GPU
        restoring = Mog > Mg
        order = np.argpartition(np.where(restoring, hf, np.inf), half - 1, axis=1)[:, :half]
        order2 = np.argpartition(hf, KF - half - 1, axis=1)[:, : KF - half]
        f = np.concatenate([order, order2], axis=1)  # [n, KF]
        base = peak[:, None] + _take(Mg, ea) * de - ne  # [n, S]
        ng = base[:, :, None] + _take(hf, f)[:, None, :]
        cost_r = ((_take(Mg, f) >= _take(Mog, f)).astype(np.int64)[:, None, :]
                  - (_take(Mg, ea) > _take(Mog, ea))[:, :, None])
        ok = (two[:, :, None] & (ea[:, :, None] != f[:, None, :]) & (ng < lim[:, None, None])
              & (up_max < lim[:, None])[:, :, None])
        local = np.maximum(ng, up_max[:, :, None])
        score_r = np.where(ok, np.minimum(peak[:, None, None] - local, need[:, None, None])
                           / np.maximum(cost_r, 0.5), -np.inf).reshape(n, -1)
        # -- replace: slot b of a light GPU gets expert ea (an expert of the heaviest GPU)
        cb = _take(ca, eb)
        twob = cb >= 2
        nbe = np.where(twob, _take(la, eb) / np.maximum(cb - 1, 1), 0.0)
        dbe = nbe - pb  # [n, KS] rise of every replica of eb
        Meb = M[A1, :, eb]  # [n, KS, G]
        upb = np.where(Meb > 0, loads[:, None, :] + Meb * dbe[:, :, None], -np.inf)
        upb[r, :, gmax] = -np.inf
        upb[r[:, None], np.arange(K * S)[None, :], gb] = -np.inf
        upb_max = upb.max(axis=2)  # [n, KS]
        nfa = _take(la, ea) / (ce + 1)  # [n, S] new per-replica load of ea
        dfa = nfa - pa
        ng2 = (peak[:, None, None] + (_take(Mg, eb) * dbe)[:, :, None]
               + (_take(Mg, ea) * dfa)[:, None, :])  # [n, KS, S]
        mgb_ea = M[A2, gb[:, :, None], ea[:, None, :]]  # [n, KS, S]
        nlb = (_take(loads, gb) + M_gb_eb * dbe - nbe)[:, :, None] + mgb_ea * dfa[:, None, :] + nfa[:, None, :]
        cost_b = ((mgb_ea >= Mo[A2, gb[:, :, None], ea[:, None, :]]).astype(np.int64)
                  - (M_gb_eb > Mo_gb_eb)[:, :, None])
        ok = (twob[:, :, None] & (eb[:, :, None] != ea[:, None, :]) & (ng2 < lim[:, None, None])
              & (nlb < lim[:, None, None]) & (upb_max < lim[:, None])[:, :, None])
        local = np.maximum(np.maximum(ng2, nlb), upb_max[:, :, None])
        score_b = np.where(ok, np.minimum(peak[:, None, None] - local, need[:, None, None])
                           / np.maximum(cost_b, 0.5), -np.inf).reshape(n, -1)
        # -- best per row: replace first on ties (as _Row.repair), then swaps
        scores = np.concatenate([score_r, score_b, score_s], axis=1)
        best = scores.argmax(axis=1)
        found = scores[r, best] > -np.inf
        n_r, n_b = score_r.shape[1], score_b.shape[1]
        kind = np.where(best < n_r, 0, np.where(best < n_r + n_b, 1, 2))
        rows_g = active
        # replace on the heaviest GPU
        sel = found & (kind == 0)
        if sel.any():
            i, j = np.divmod(best[sel], KF)
            slot = a[sel, i]
            _apply_replace(row, M, c, rows_g[sel], slot, f[sel, j], S)
        sel = found & (kind == 1)
        if sel.any():
            i, j = np.divmod(best[sel] - n_r, S)
            _apply_replace(row, M, c, rows_g[sel], b[sel, i], ea[sel, j], S)
        sel = found & (kind == 2)
        if sel.any():
            i, j = np.divmod(best[sel] - n_r - n_b, K * S)
            _apply_swap(row, M, rows_g[sel], a[sel, i], b[sel, j], S)
        active = active[found]
    for k, rr in enumerate(rows):
        rr.row, rr.M, rr.c = row[k].copy(), M[k].astype(np.int64), c[k].copy()


def _apply_replace(row, M, c, rr, slot, f, S):
    e = row[rr, slot]
    g = slot // S
    row[rr, slot] = f
    np.add.at(M, (rr, g, e), -1)
    np.add.at(M, (rr, g, f), 1)
    np.add.at(c, (rr, e), -1)
    np.add.at(c, (rr, f), 1)


def _apply_swap(row, M, rr, sa, sb, S):
    ea, eb = row[rr, sa], row[rr, sb]
    ga, gb = sa // S, sb // S
    row[rr, sa], row[rr, sb] = eb, ea
    np.add.at(M, (rr, ga, ea), -1)
    np.add.at(M, (rr, ga, eb), 1)
    np.add.at(M, (rr, gb, eb), -1)
    np.add.at(M, (rr, gb, ea), 1)


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
    # every layer's candidates: the old group-to-node map (kept as is when the old placement keeps groups on nodes)
    # first, then the balanced plan's packing renumbered to match old (when it differs)
    if num_nodes > 1:
        group_node = _node_of_groups(fresh, old, num_groups, num_nodes, group_size)
    else:
        group_node = np.zeros((L, num_groups), dtype=np.int64)
    candidates = []
    for layer in range(L):
        fresh_node = np.empty(num_groups, dtype=np.int64)
        fresh_node[fresh[layer] // group_size] = np.arange(P) // slots_per_node
        node_perm = np.empty(num_nodes, dtype=np.int64)
        node_perm[group_node[layer]] = fresh_node
        cands = []
        if num_nodes > 1:
            old_map = _old_node_of_groups(old[layer], num_groups, num_nodes, group_size)
            if not (old_map == group_node[layer]).all():
                cands.append(_Candidate(old_map, load[layer], old[layer], num_nodes, gpus_per_node, group_size))
        cands.append(_Candidate(group_node[layer], load[layer], old[layer], num_nodes, gpus_per_node, group_size,
                                node_perm))
        candidates.append(cands)
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
    if budget == np.inf:  # no cap: every layer is independent, repair all rows at once
        rows = [(n[-1], target[layer]) for layer in range(L) for cand in candidates[layer] for n in cand.nodes]
        before = [_cost(row) for row, _ in rows]
        repair_rows([row for row, _ in rows], np.array([t for _, t in rows]))
        for (row, _), b in zip(rows, before):
            row.repaired = _cost(row) - b
        for layer in range(L):
            best = None
            for cand in candidates[layer]:
                plan = _plan_layer(cand, fresh[layer], load[layer], target[layer], np.inf, gpus_per_node, S, True)
                if best is None or _better(plan, best, target[layer]):
                    best = plan
            out[layer] = best[0]
        return align_slots(old, out, num_gpus)
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
