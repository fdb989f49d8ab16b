"""The "move_aware" policy: move as few experts as it can while staying within a tolerance of "balanced".

What it optimises: the number of moved experts (a replica on a GPU that did not hold it before, the unit of weight
traffic; :func:`fdeplb.placement.moved_experts`), subject to a bound on the GPU-load max/mean excess over the
"balanced" plan on the same loads (``tolerance``, absolute max/mean units).

Without a move cap (the default):

- Guarantee: the mean over layers of (max/mean of the plan - max/mean of "balanced") is at most ``tolerance``, and
  no layer exceeds it by more than ``LAYER_CAP`` tolerances. A forward pass costs the sum over layers of each
  layer's heaviest GPU, so the mean is what a step pays; the per-layer bound keeps any one layer close.
- How: every (layer, node) row is repaired from the old placement by :func:`fdeplb.placement.repair.repair_rows`
  (swaps and replica-count changes, chosen by excess above the target ``balanced + tolerance`` removed per moved
  expert), recording each row's trajectory; then :func:`fdeplb.placement.stops.choose_stops` stops every row at
  the point of its trajectory that minimises the total moved experts under the two bounds above (a layer that
  is cheap to balance goes below the tolerance so that an expensive one may stop above it).
- Layers the repair cannot bring within ``LAYER_CAP`` tolerances (or, when the mean bound cannot be met otherwise,
  every layer above one tolerance) are planned again, ending within one tolerance: in global mode by the
  per-layer repair below (then its fallback), in hierarchical mode directly by the fallback (step 3).

With a move cap (``max_moved_experts``), per layer (and per node in hierarchical mode), worst layers first so
that the budget goes where it helps most:

1. Target: the GPU-load max/mean that "balanced" reaches on the new loads, plus ``tolerance``.
2. Repair (from the old placement; experts stay in their slots unless moved): while the heaviest GPU is above the
   target, apply the action with the best gain per moved expert, gain capped at what the target needs:
   - *replace*: one slot gets another expert (a replica of an expert with >= 2 replicas is given to an expert that
     needs one), with the slot on the heaviest GPU or the new expert taken from it; costs one moved expert
     (zero when it restores an expert that was there in the old placement);
   - *swap*: a slot of the heaviest GPU trades experts with a slot of another GPU; costs up to two.
   An action is allowed only if it lowers the heaviest GPU and lifts no GPU to its level, so the loop ends.
3. Fallback when the repair gets stuck above the target (no cap only): the "balanced" plan with its GPUs
   renumbered to match the old GPUs (``scipy.optimize.linear_sum_assignment`` on shared experts), then every slot
   that can go back to its old expert without leaving the target does so.

In hierarchical mode every layer has up to two group-to-node maps: the old placement's (as it is when the old
placement keeps every group on one node; otherwise the packing with num_groups / num_nodes groups per node that
keeps the most old slots) and the node packing of the "balanced" plan, with nodes renumbered to match the old
placement. Without a cap a layer keeps the old map when its heaviest node, spread over its GPUs, is within the
target, else takes the balanced map; experts of groups that change node are placed first
(:func:`fdeplb.placement.fill.fill_rows`).
With a cap, for each map the relocation is charged to ``max_moved_experts`` like any other move, a map whose
relocation the remaining budget cannot pay is skipped, and of the others the layer keeps the plan within the
target that moves fewest experts, or, when none reaches it, the one with the lightest heaviest GPU (ties: the old
map). Moves that no map avoids (an old placement that spreads groups over nodes) are reserved before any layer is
repaired; a cap below them is an error. With the cap at 0 (and groups on nodes) the old placement comes back
unchanged. Deterministic: ties keep the first candidate in slot / expert order.

Sources: spreading the tolerance over layers by a price per unit of excess is Everett's generalized Lagrange
multiplier method for allocating a resource ("Generalized Lagrange multiplier method for solving problems of
optimum allocation of resources", Operations Research 11(3), 1963); the repair's objective (total load above the
target instead of the heaviest GPU alone), its actions and move weighting, and the slot bookkeeping are fdeplb's.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError
from fdeplb.placement.balanced import balanced_plan
from fdeplb.placement.fill import fill_rows, forced_copies, replica_counts
from fdeplb.placement.metrics import raw_gpu_loads
from fdeplb.placement.node_maps import node_of_groups, old_node_of_groups
from fdeplb.placement.repair import repair_rows
from fdeplb.placement.slots import align_slots, multiset_overlap, overlap_assignment
from fdeplb.placement.stops import choose_stops, replay_stops

_RTOL = 1e-12
#: without a move cap one layer may exceed "balanced" by this many tolerances (the mean over layers by one)
LAYER_CAP = 2.0
#: the uncapped repair aims every row at "balanced" + this share of the tolerance (its trajectory then offers the
#: stop choice points below the tolerance as well; on the drift pairs 0.9 moved 0.05-0.2 points fewer than 1.0)
_REPAIR_SHARE = 0.9


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


def move_aware_phy2log(
    expert_load: np.ndarray,
    old_phy2log: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    tolerance: float = 0.0005,
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
    fresh, fresh_peak = balanced_plan(expert_load, P, num_groups, num_nodes, num_gpus)
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = P // num_nodes
    S = P // num_gpus
    mean = load.sum(axis=1) / num_gpus
    # a hair under the tolerance so that the ratio recomputed from scratch stays within it
    target = np.maximum(fresh_peak, (fresh_peak / np.where(mean > 0, mean, 1) + tolerance * (1 - 1e-9)) * mean)
    group_size = E // num_groups
    # every layer's group-to-node maps: the old one (kept as is when the old placement keeps groups on nodes) and
    # the balanced plan's packing renumbered to match old
    if num_nodes > 1:
        group_node = node_of_groups(fresh, old, num_groups, num_nodes, group_size)
        old_maps = np.stack([old_node_of_groups(old[layer], num_groups, num_nodes, group_size) for layer in range(L)])
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

    if max_moved_experts is None:  # no cap: plan all (layer, node) rows at once, then spread the tolerance
        out, excess = _plan_all(load, old, fresh_peak, mean, tolerance, old_maps, group_node, num_nodes, num_gpus)
        # layers the repair leaves above LAYER_CAP tolerances, or every layer above one tolerance when the mean
        # cannot be met otherwise: the per-layer repair and its fallback, which end within one tolerance
        stuck = excess > LAYER_CAP * tolerance * (1 + 1e-9)
        if stuck.any() or excess.mean() > tolerance:
            rest = np.where(stuck, tolerance, excess)
            if rest.mean() > tolerance:
                stuck |= excess > tolerance
        for layer in np.flatnonzero(stuck):
            if num_nodes > 1:  # the balanced plan's nodes, GPUs matched to the old ones, then reverted
                out[layer] = _plan_layer(candidates_of(layer)[-1], fresh[layer], load[layer], target[layer], np.inf,
                                         gpus_per_node, S, repair=False)[0]
                continue
            best = None  # one row just above the cap: the exact per-layer repair usually closes it in a few moves
            for cand in candidates_of(layer):
                plan = _plan_layer(cand, fresh[layer], load[layer], target[layer], np.inf, gpus_per_node, S)
                if best is None or _better(plan, best, target[layer]):
                    best = plan
            out[layer] = best[0]
        return _align_where_needed(old, out, num_gpus)
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
#: a row whose experts need at least this many more replicas in all to bring every per-replica load under the
#: layer cap (``LAYER_CAP`` tolerances above "balanced": no stop above it is chosen while the layer can get under
#: it) gets its replica counts in bulk (:func:`fdeplb.placement.fill.fill_rows`) before the repair, which spends one
#: iteration per copy.
#: No row of the drift pairs of benchmarks/placement.py needs more than 3; under the zipf(1.5) loads of
#: benchmarks/control_plane.py (4 layers x 64 experts, 128 slots, 64 GPUs) every row needs 30-55.
_BULK_COPIES = 8


def _plan_all(load: np.ndarray, old: np.ndarray, fresh_peak: np.ndarray, mean: np.ndarray, tolerance: float,
              old_maps: np.ndarray, fresh_maps: np.ndarray, num_nodes: int,
              num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """The uncapped plan of every layer: :func:`fdeplb.placement.repair.repair_rows` on all (layer, node) rows,
    stopped by :func:`fdeplb.placement.stops.choose_stops`. Returns (phy2log int64 [L, P], excess float64 [L]:
    max/mean GPU load minus the "balanced" plan's, per layer).

    A layer keeps the old group-to-node map when its heaviest node, spread evenly over its GPUs, is within the
    target (so a layer already within it whose groups sit on whole nodes keeps its placement), and takes the
    balanced plan's (renumbered) map otherwise; experts of groups that change node fill the freed slots
    (:func:`fdeplb.placement.fill.fill_rows`) before the repair."""
    L, E = load.shape
    P = old.shape[1]
    num_groups = old_maps.shape[1]
    group_size = E // num_groups
    En, Pn, Gn = E // num_nodes, P // num_nodes, num_gpus // num_nodes
    layers = np.arange(L)
    safe_mean = np.where(mean > 0, mean, 1.0)
    # rows are repaired a little below the tolerance, so that the stop choice can let expensive layers stop above it
    target = fresh_peak + _REPAIR_SHARE * tolerance * safe_mean
    cap = fresh_peak + LAYER_CAP * tolerance * (1 - 1e-9) * safe_mean
    if num_nodes == 1:  # global: one row per layer, the layer's own ids
        start = old.copy()
        bulk = forced_copies(old, load, cap) >= _BULK_COPIES
        if bulk.any():
            start[bulk] = fill_rows(old[bulk], load[bulk], num_gpus, cap[bulk])
        points, log = repair_rows(start.copy(), load, old, target, num_gpus)
        stops, excess = choose_stops(points, layers, fresh_peak, safe_mean, tolerance * (1 - 1e-9),
                                     LAYER_CAP * tolerance * (1 - 1e-9))
        return replay_stops(start, log, stops), excess
    node_of_slot = np.arange(P) // Pn
    node_load = np.zeros((L, num_nodes))
    np.add.at(node_load, (layers[:, None], old_maps), load.reshape(L, num_groups, group_size).sum(axis=2))
    maps = np.where((node_load.max(axis=1) / Gn <= target)[:, None], old_maps, fresh_maps)
    expert_node = np.repeat(maps, group_size, axis=1)  # [L, E]
    experts_of = np.argsort(expert_node * E + np.arange(E), axis=1, kind="stable").reshape(L, num_nodes, En)
    local = np.empty((L, E), dtype=np.int64)
    np.put_along_axis(local, experts_of.reshape(L, E), np.broadcast_to(np.arange(E) % En, (L, E)), axis=1)
    rows_idx = layers[:, None]
    old_local = np.where(expert_node[rows_idx, old] == node_of_slot, local[rows_idx, old], -1).reshape(L * num_nodes, Pn)
    row_load = load[layers[:, None, None], experts_of].reshape(L * num_nodes, En)
    start = old_local.copy()
    held = replica_counts(old_local, En)
    free = (old_local < 0).any(axis=1) | (held[:, :En] == 0).any(axis=1)  # a slot to fill or an expert to place
    row_cap = np.repeat(cap, num_nodes)
    bulk = ~free & (forced_copies(old_local, row_load, row_cap) >= _BULK_COPIES)
    fill = free | bulk
    if fill.any():
        max_item = np.where(free, np.repeat(_MAX_ITEM_SHARE * mean, num_nodes), row_cap)
        start[fill] = fill_rows(old_local[fill], row_load[fill], Gn, max_item[fill])
    work = start.copy()
    points, log = repair_rows(work, row_load, old_local, np.repeat(target, num_nodes), Gn)
    stops, excess = choose_stops(points, np.repeat(layers, num_nodes), fresh_peak, safe_mean,
                                 tolerance * (1 - 1e-9), LAYER_CAP * tolerance * (1 - 1e-9))
    rows = replay_stops(start, log, stops)
    out = np.take_along_axis(experts_of, rows.reshape(L, num_nodes, Pn), axis=2).reshape(L, P)
    return out, excess


def _align_where_needed(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """:func:`align_slots` on the GPUs where an expert that stays on its GPU is not in its old slot (the repair keeps
    slots otherwise: a swap or a copy rewrites only the slots it names); int64 [L, P]."""
    L, P = old.shape
    S = P // num_gpus
    o2, n2 = old.reshape(L * num_gpus, S), new.reshape(L * num_gpus, S)
    # a slot whose new expert differs from its old one while the GPU held that expert before
    held = (n2[:, :, None] == o2[:, None, :]).any(axis=2)
    gpus = np.flatnonzero(((o2 != n2) & held).any(axis=1))
    if gpus.size == 0:
        return new
    out = new.copy().reshape(L * num_gpus, S)
    out[gpus] = align_slots(o2[gpus], n2[gpus], 1)
    return out.reshape(L, P)
