"""Move-aware repair of many rows at once: the engine of the uncapped "move_aware" policy.

A row is one layer (global mode) or one node of a layer (hierarchical mode): ``P`` slots on ``G`` GPUs of ``S =
P / G`` slots each, local expert ids ``0..E-1``. A row starts from a full placement (every slot holds an expert)
and is compared with its old placement; a *moved expert* is a replica on a GPU that did not hold it before
(:func:`fdeplb.placement.moved_experts` on one row).

:func:`repair_rows` lowers the row's *excess*, ``sum over GPUs of max(load - target, 0)``, one action per
iteration on the row's heaviest GPU ``h``: the action whose excess reduction, divided by ``_MOVE_BASE ** (moved
experts it adds)``, is largest. Actions:

- *swap*: a slot of ``h`` trades experts with a partner slot: every slot of the ``_LIGHT_GPUS`` lightest GPUs
  and up to ``_MOVED_PARTNERS`` slots holding an already moved expert on GPUs under their target;
- *copy out of h*: a slot of another GPU whose expert has >= 2 replicas takes an expert of ``h``, which then has
  one more replica, so ``h`` (and every GPU holding it) sheds load;
- *copy into h* (rows of at most ``_INTO_MAX_GPUS`` GPUs): a slot of ``h`` whose expert has another replica on a
  GPU ``g`` takes the expert of a slot of ``g`` (the first expert's load moves to ``g``, the second's is split
  between ``g`` and ``h``);
- when none of these lowers the excess: a swap with any slot, then a 3-cycle ``h -> g1 -> g2 -> h``.

Copies are evaluated in every iteration while more than ``_COPY_SHARE`` of the active rows took one in the last
iteration (they split the hottest experts early on), then only every ``_COPY_EVERY``-th iteration and whenever a
row found nothing else; on the DeepSeek-V3 drift pairs this cut the repair's time by about a tenth and changed
the moved share by at most 0.1 point.

A copy changes the per-replica load of two experts on every GPU that holds them: its effect is computed exactly
on ``h`` and on the other GPU it names, through per-expert sums for the rest, and the chosen copy is checked
exactly (every GPU) before it is applied (else the row takes its best swap). Candidates are ranked in float32 and
the chosen one's reduction is recomputed in float64. Every applied action lowers the excess strictly, so a row
ends within its target or where no action helps.

The loop is vectorised over rows (one action per active row per iteration; numpy only) and records every row's
trajectory, (moved experts, heaviest GPU) after each of its actions, so that
:func:`fdeplb.placement.stops.choose_stops` can stop each row at an earlier point and
:func:`fdeplb.placement.stops.replay_stops` rebuild it.
"""

from __future__ import annotations

import numpy as np

#: swap partners: every slot of this many lightest GPUs of the row ...
_LIGHT_GPUS = 8
#: ... and up to this many slots (on GPUs under their target) whose expert was moved there
_MOVED_PARTNERS = 48
#: an action's excess reduction is divided by _MOVE_BASE ** (moved experts it adds)
_MOVE_BASE = 1.5
#: _POW[k + 3] = _MOVE_BASE ** -k for k in -3..3
_POW = _MOVE_BASE ** -np.arange(-3, 4, dtype=np.float64)
_POW32 = _POW.astype(np.float32)
_SWAP_STEP = np.array([[-1], [1], [-1], [1]], dtype=np.int16)  # count changes of the 4 (GPU, expert) keys of a swap
#: "copy into h" is tried on rows of at most this many GPUs: with more, swap partners nearly always do as well (on
#: the DeepSeek-V3 32-GPU drift pairs of benchmarks/placement.py it changed the moved share by at most 0.2 points
#: and cost about a fifth of the repair's time; on the 8-GPU Qwen2 pair it saves about 1.3 points)
_INTO_MAX_GPUS = 16
#: copies are evaluated every iteration while more than this share of the active rows took one in the last
#: iteration, then every _COPY_EVERY-th iteration (and whenever a row found no swap)
_COPY_SHARE = 0.02
_COPY_EVERY = 4
#: relative excess reduction below which an action does not count (float noise on loads of ~1e8 tokens)
_RTOL = 1e-9
#: hard cap on iterations (each applies at most one action per active row)
_MAX_ITER = 100_000


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _compact(mask: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Column indices of the True entries of every row of ``mask`` [n, m], in order, at most ``limit`` per row:
    (int64 [n, k] indices padded with 0, bool [n, k] valid), k = the largest count (<= limit)."""
    n = mask.shape[0]
    rows, cols = np.divmod(np.flatnonzero(mask), mask.shape[1])  # np.nonzero's order, ~4x faster on 2-D masks
    counts = np.bincount(rows, minlength=n)
    k = int(min(limit, counts.max(initial=0)))
    idx = np.zeros((n, k), dtype=np.int64)
    ok = np.zeros((n, k), dtype=bool)
    if k:
        pos = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        keep = pos < k
        idx[rows[keep], pos[keep]] = cols[keep]
        ok[rows[keep], pos[keep]] = True
    return idx, ok


def _gpu_expert_counts(idx: np.ndarray, num_gpus: int, width: int) -> np.ndarray:
    """int16 [R, G, width]: replicas of every expert on every GPU, from slot contents ``idx`` int [R, P]."""
    R, P = idx.shape
    flat = (np.arange(R)[:, None] * num_gpus + np.arange(P) // (P // num_gpus)) * width + idx
    return np.bincount(flat.ravel(), minlength=R * num_gpus * width).reshape(R, num_gpus, width).astype(np.int16)


def repair_rows(row: np.ndarray, load: np.ndarray, old: np.ndarray, targets: np.ndarray, num_gpus: int):
    """Repair rows toward their targets (see the module docstring); ``row`` is modified in place.

    Args:
        row: C-contiguous int64 [R, P] expert of every slot (local ids 0..E-1, every expert at least once).
        load: float64 [R, E] load of every expert of the row (tokens).
        old: int64 [R, P] expert of every slot in the old placement; -1 where the old expert is not one of the
            row's (hierarchical mode: its group now lives on another node).
        targets: float64 [R] load every GPU of the row should come down to (tokens).
        num_gpus: GPUs per row (P a multiple of it).

    Returns:
        (points, log): ``points`` is a list with one ``(rows, moved, peak)`` entry per iteration, the first for
        the start (every row): int64 row indices, int64 moved experts and float64 heaviest-GPU load of those rows
        after that iteration. ``log`` is a list with one ``(rows, kind, i, j)`` or ``None`` (end of an iteration)
        entry per applied batch: kind 0 swaps slots i and j, kind 1 puts expert j into slot i. Deterministic: ties
        take the first candidate (lowest slot / partner position).

    Raises:
        ValueError: ``row`` is not C-contiguous (it is updated through flat views).
    """
    if not row.flags.c_contiguous:
        raise ValueError("repair_rows: row must be C-contiguous")
    R, P = row.shape
    G = num_gpus
    S = P // G
    E = load.shape[1]
    E1 = E + 1  # expert E: the dummy of old slots with no expert of the row
    gos = np.arange(P) // S
    arS, arG = np.arange(S), np.arange(G)
    M = _gpu_expert_counts(row, G, E1)
    Mo = _gpu_expert_counts(np.where(old >= 0, old, E), G, E1)
    Mf, Mof = M.reshape(-1), Mo.reshape(-1)
    slot_key = (np.arange(R)[:, None] * G + gos) * E1  # + expert: flat index into M of (row, GPU of slot, expert)
    count = M.sum(axis=1).astype(np.int64)
    count[:, E] = 1
    load1 = np.concatenate([np.asarray(load, dtype=np.float64), np.zeros((R, 1))], axis=1)
    per = load1 / count
    dplus = np.where(count >= 2, load1 / np.maximum(count - 1, 1) - per, 0.0)  # per-replica rise when one goes
    pnew = load1 / (count + 1)  # per-replica load with one more replica
    dminus = per - pnew  # per-replica drop when one more comes
    item = np.take_along_axis(per, row, axis=1)  # load of every slot
    gpu_load = item.reshape(R, G, S).sum(axis=2)
    m_slot = Mf[slot_key + row]  # replicas of the slot's expert on the slot's GPU
    moved_slot = m_slot > Mof[slot_key + row]  # the slot's expert is on its GPU more often than before
    multi_slot = np.take_along_axis(count, row, axis=1) >= 2  # the slot's expert has >= 2 replicas
    moved = np.maximum(M.astype(np.int32) - Mo, 0)[:, :, :E].sum(axis=(1, 2)).astype(np.int64)
    T = np.asarray(targets, dtype=np.float64)
    points = [(np.arange(R), moved.copy(), gpu_load.max(axis=1))]
    log: list = []
    if G < 2:
        return points, log
    light = min(_LIGHT_GPUS, G - 1)
    nb = min(P - S, light * S + _MOVED_PARTNERS)

    rowf, itemf, loadf = row.reshape(-1), item.reshape(-1), gpu_load.reshape(-1)
    m_slotf, moved_slotf, multi_slotf = m_slot.reshape(-1), moved_slot.reshape(-1), multi_slot.reshape(-1)
    slot_keyf = slot_key.reshape(-1)
    mlist = list(_compact(multi_slot, P))  # the multi-replica slots of every row (indices, valid), kept up to date
    buffers = [np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float32)]

    def scratch(i, shape):  # a reused float32 work array (large temporaries cost page faults every iteration)
        size = shape[0] * shape[1] * shape[2]
        if buffers[i].size < size:
            buffers[i] = np.empty(size, dtype=np.float32)
        return buffers[i][:size].reshape(shape)

    def refresh(rr, gpus):  # per-slot counts of the slots of GPUs ``gpus`` [k] of rows ``rr`` [k]
        sl = (rr * P + gpus * S)[:, None] + arS
        key = slot_keyf[sl] + rowf[sl]
        m_slotf[sl] = Mf[key]
        moved_slotf[sl] = Mf[key] > Mof[key]

    def swap(rr, sa, sb):  # exchange the experts of slots sa and sb of rows rr (one slot pair per row)
        fa, fb = rr * P + sa, rr * P + sb
        va, vb = rowf[fa], rowf[fb]
        same = va == vb  # nothing to do (a 3-cycle's second swap may meet the same expert)
        if same.any():
            rr, sa, sb, fa, fb, va, vb = rr[~same], sa[~same], sb[~same], fa[~same], fb[~same], va[~same], vb[~same]
        ga, gb = rr * G + gos[sa], rr * G + gos[sb]
        keys = np.stack([ga * E1 + va, ga * E1 + vb, gb * E1 + vb, gb * E1 + va])  # distinct per row
        mk, mok = Mf[keys], Mof[keys]
        moved[rr] += (mk[1] >= mok[1]).astype(np.int64) + (mk[3] >= mok[3]) - (mk[0] > mok[0]) - (mk[2] > mok[2])
        Mf[keys] = mk + _SWAP_STEP
        rowf[fa], rowf[fb] = vb, va
        wa, wb = itemf[fa], itemf[fb]
        itemf[fa], itemf[fb] = wb, wa
        loadf[ga] += wb - wa
        loadf[gb] += wa - wb
        ma, mb = multi_slotf[fa], multi_slotf[fb]
        multi_slotf[fa], multi_slotf[fb] = mb, ma
        if (ma != mb).any():  # the multi-replica slot list follows the expert that changed slot
            lst, okl = mlist[0][rr], mlist[1][rr]
            mlist[0][rr] = np.where(okl & (lst == sa[:, None]), sb[:, None], np.where(okl & (lst == sb[:, None]),
                                                                                    sa[:, None], lst))
        refresh(np.concatenate([rr, rr]), np.concatenate([gos[sa], gos[sb]]))
        log.append((rr, 0, sa, sb))

    def copy(rr, sl, f, new):  # slot sl of rows rr takes expert f; new: the rows' GPU loads after it
        fs = rr * P + sl
        e, gs = rowf[fs], gos[sl]
        ke, kf = (rr * G + gs) * E1 + e, (rr * G + gs) * E1 + f
        moved[rr] += (Mf[kf] >= Mof[kf]).astype(np.int64) - (Mf[ke] > Mof[ke])
        rowf[fs] = f
        Mf[ke] -= 1
        Mf[kf] += 1
        r2, x = np.concatenate([rr, rr]), np.concatenate([e, f])
        count[r2, x] += np.repeat([-1, 1], rr.size)
        c, ld = count[r2, x], load1[r2, x]
        per[r2, x] = ld / c
        dplus[r2, x] = np.where(c >= 2, ld / np.maximum(c - 1, 1) - ld / c, 0.0)
        pnew[r2, x] = ld / (c + 1)
        dminus[r2, x] = ld / c - ld / (c + 1)
        rows = row[rr]
        item[rr] = np.take_along_axis(per[rr], rows, axis=1)
        multi_slot[rr] = np.take_along_axis(count[rr], rows, axis=1) >= 2
        gpu_load[rr] = new
        refresh(rr, gs)
        # the multi-replica slot list: e's last replica leaves it, f's first other replica joins it (sl stays)
        gone = count[rr, e] == 1
        if gone.any():
            r_g = rr[gone]
            s_g = np.argmax(row[r_g] == e[gone][:, None], axis=1)  # the one slot e keeps
            hit = mlist[1][r_g] & (mlist[0][r_g] == s_g[:, None])
            mlist[1][r_g] &= ~hit
        came = count[rr, f] == 2
        if came.any():
            r_c = rr[came]
            other = (row[r_c] == f[came][:, None])
            other[np.arange(r_c.size), sl[came]] = False
            s_c = np.argmax(other, axis=1)  # f's replica that was alone
            free = ~mlist[1][r_c]
            if not free.any(axis=1).all():
                mlist[0] = np.pad(mlist[0], ((0, 0), (0, 1)))
                mlist[1] = np.pad(mlist[1], ((0, 0), (0, 1)))
                free = ~mlist[1][r_c]
            col = np.argmax(free, axis=1)
            mlist[0][r_c, col] = s_c
            mlist[1][r_c, col] = True
        log.append((rr, 1, sl, f))

    active = np.flatnonzero(gpu_load.max(axis=1) > T)
    copies_recent, forced = True, False
    for it_no in range(_MAX_ITER):
        if active.size == 0:
            break
        A = active
        n = A.size
        q = np.arange(n)
        q1 = q[:, None]
        AP = A[:, None] * P  # flat offset of the rows' slots
        qE = q1 * E1
        rows_of = (lambda x: x) if n == R else (lambda x: x[A])  # all rows active: views, not copies
        LT = rows_of(gpu_load) - rows_of(T)[:, None]  # load above target per GPU (negative: room)
        ex = _relu(LT)
        thr = ex.sum(axis=1) * _RTOL
        order = np.argsort(LT, axis=1, kind="stable")  # lightest first
        rank = np.empty_like(order)
        rank[q1, order] = arG
        h = order[:, -1]
        LTh = LT[q, h]
        u = ex[q, h]  # excess of h
        mv = rows_of(moved_slot)
        LTf = LT.ravel()
        aS = h[:, None] * S + arS  # [n,S] slots of h
        ia = AP + aS
        ea, xa, lva = rowf[ia], itemf[ia], moved_slotf[ia]
        hkey = ((A * G + h) * E1)[:, None]  # + expert: M[row, h, expert]
        dpf, pnf, dmf = rows_of(dplus).ravel(), rows_of(pnew).ravel(), rows_of(dminus).ravel()
        Mh_a = Mf[hkey + ea].astype(np.float64)  # M[h, e_a]
        # ---- partner slots: every slot of the lightest GPUs, then slots with a moved expert on GPUs under target
        lightest = (order[:, :light, None] * S + arS).reshape(n, -1)
        extra = mv & np.repeat((LT < 0) & (rank >= light), S, axis=1)
        extra_idx, extra_ok = _compact(extra, _MOVED_PARTNERS)
        bidx = np.concatenate([lightest, extra_idx], axis=1)
        bok = np.concatenate([np.ones(lightest.shape, dtype=bool), extra_ok], axis=1)
        nb = bidx.shape[1]
        ib = AP + bidx
        xb = np.where(bok, itemf[ib], np.inf)
        LTb, eb = LTf[q1 * G + gos[bidx]], rowf[ib]
        Mh_b = Mf[hkey + eb]  # M[h, e_b]
        arrive_b = (Mh_b >= Mof[hkey + eb]).astype(np.int8)  # e_b arriving on h is a moved expert
        # ---- swap [n,S,nb] (float32 for speed; the chosen swap's gain is recomputed in float64)
        d = np.subtract(xa.astype(np.float32)[:, :, None], xb.astype(np.float32)[:, None, :],
                        out=scratch(0, (n, S, nb)))
        LTb32 = LTb.astype(np.float32)
        t = np.add(LTb32[:, None, :], d, out=scratch(1, (n, S, nb)))
        np.maximum(t, 0.0, out=t)
        gain = np.minimum(d, u.astype(np.float32)[:, None, None], out=d)
        gain -= t
        gain += _relu(LTb32)[:, None, :]
        gain *= _POW32[4 - lva.astype(np.int8)][:, :, None]
        gain *= _POW32[3 + arrive_b - moved_slotf[ib].astype(np.int8)][:, None, :]
        i0 = gain.reshape(n, -1).argmax(axis=1)
        pa, pb = np.divmod(i0, nb)
        d0 = xa[q, pa] - xb[q, pb]
        g0 = np.minimum(d0, u) + _relu(LTb[q, pb]) - _relu(LTb[q, pb] + d0)
        s0 = np.where(g0 > thr, gain.reshape(n, -1)[q, i0], -np.inf)
        # ---- replicas of multi-replica experts: how the excess of the GPUs holding them changes when an expert
        # loses a replica (RISE) or gains one (FALL), summed per expert
        ridx, rok = rows_of(mlist[0]), rows_of(mlist[1])
        # copies: every iteration while rows still take them, then every _COPY_EVERY-th (they are rare by then)
        with_copies = copies_recent or it_no % _COPY_EVERY == 0 or forced
        Nm = ridx.shape[1] if with_copies else 0
        s1 = np.full(n, -np.inf)
        s2 = np.full(n, -np.inf)
        i1 = np.zeros(n, dtype=np.int64)
        i2 = np.zeros(n, dtype=np.int64)
        if Nm:
            ir = AP + ridx
            g2 = gos[ridx]
            e2, LT2, m2 = rowf[ir], LTf[q1 * G + g2], m_slotf[ir].astype(np.float64)
            ie2 = qE + e2
            dp2 = dpf[ie2]
            ex2 = _relu(LT2)
            rise2 = np.where(rok, _relu(LT2 + m2 * dp2) - ex2, 0.0)
            fall2 = np.where(rok, ex2 - _relu(LT2 - m2 * dmf[ie2]), 0.0)
            RISE = np.bincount(ie2.ravel(), (rise2 / m2).ravel(), n * E1)
            FALL = np.bincount(ie2.ravel(), (fall2 / m2).ravel(), n * E1)
            iea = qE + ea
            dma = dmf[iea]
            # ---- copy into h [n,S,S]: slot a of h, whose expert has another replica on GPU g, takes the expert
            # of a slot b of g (e_a's load moves to g, e_b's is split between g and h)
            same = ea.astype(np.int32)[:, :, None] == e2.astype(np.int32)[:, None, :]  # [n,S,Nm]
            if G <= _INTO_MAX_GPUS:
                match = same & ((g2 != h[:, None]) & rok)[:, None, :]
                has = match.any(axis=2)
            if G <= _INTO_MAX_GPUS and has.any():
                pm = match.argmax(axis=2)  # [n,S] a multi slot holding e_a on another GPU
                gg = g2[q1, pm]
                dp1 = dpf[iea]
                base_h = np.where(has, LTh[:, None] - xa + (Mh_a - 1) * dp1, np.inf)  # [n,S]
                bs = (AP + gg * S)[:, :, None] + arS  # [n,S,S] flat slots of g
                eb1 = rowf[bs]
                ie1 = qE[:, :, None] + eb1
                dmb = dmf[ie1]
                Mhb1 = Mf[hkey[:, :, None] + eb1].astype(np.float64)
                LTg = LT[q1, gg][:, :, None]
                exg = _relu(LTg)
                msb = m_slotf[bs] * dmb
                rise_g = (m2[q1, pm] * dp1)[:, :, None]  # e_a's replicas on g gain
                g1 = (u[:, None, None] - _relu(base_h[:, :, None] + pnf[ie1] - Mhb1 * dmb) + exg
                      - _relu(LTg + rise_g - msb)
                      - (RISE[iea] - _relu(LTh[:, None] + Mh_a * dp1) + u[:, None])[:, :, None]
                      + _relu(LTg + rise_g) - exg + FALL[ie1]
                      - (_relu(LTh)[:, None, None] - _relu(LTh[:, None, None] - Mhb1 * dmb))
                      - np.where(multi_slotf[bs], exg - _relu(LTg - msb), 0.0))
                np.copyto(g1, -np.inf, where=eb1 == ea[:, :, None])
                g1 *= _POW[3 + (Mhb1 >= Mof[hkey[:, :, None] + eb1]).astype(np.int8) - lva.astype(np.int8)[:, :, None]]
                i1 = g1.reshape(n, -1).argmax(axis=1)
                s1 = g1.reshape(n, -1)[q, i1]
                s1[~(s1 > thr)] = -np.inf
            # ---- copy out of h [n,S,Nm]: a multi-replica slot b on another GPU takes e_a
            fall_h = _relu(LTh[:, None]) - _relu(LTh[:, None] - Mh_a * dma)
            termA = u[:, None] + FALL[iea] - np.where(multi_slotf[ia], fall_h, 0.0)  # [n,S]
            Mh_2 = Mf[hkey + e2].astype(np.float64)  # M[h, e_b]
            termB = ex2 - RISE[ie2] + _relu(LTh[:, None] + Mh_2 * dp2) - u[:, None] + rise2  # [n,Nm]
            base_b = np.where(rok & (g2 != h[:, None]), LT2 - itemf[ir] + (m2 - 1) * dp2, np.inf)
            cut = np.add(termA.astype(np.float32)[:, :, None], termB.astype(np.float32)[:, None, :],
                         out=scratch(0, (n, S, Nm)))
            t = np.add(base_b.astype(np.float32)[:, None, :], pnf[iea].astype(np.float32)[:, :, None],
                       out=scratch(1, (n, S, Nm)))
            np.maximum(t, 0.0, out=t)
            cut -= t
            np.subtract((LTh[:, None] + Mh_2 * dp2).astype(np.float32)[:, None, :],
                        (Mh_a * dma).astype(np.float32)[:, :, None], out=t)
            np.maximum(t, 0.0, out=t)
            cut -= t
            np.copyto(cut, -np.inf, where=same)
            cut *= _POW32[4 - moved_slotf[ir].astype(np.int8)][:, None, :]
            i2 = cut.reshape(n, -1).argmax(axis=1)
            pa, pb = np.divmod(i2, Nm)
            g2x = (termA[q, pa] + termB[q, pb] - _relu(base_b[q, pb] + pnf[iea][q, pa])
                   - _relu(LTh + Mh_2[q, pb] * dp2[q, pb] - Mh_a[q, pa] * dma[q, pa]))
            s2 = np.where((g2x > thr) & (e2[q, pb] != ea[q, pa]), cut.reshape(n, -1)[q, i2], -np.inf)
        # ---- apply the best action of every row (a copy only after an exact check)
        kind = np.stack([s0, s1, s2], axis=1).argmax(axis=1)
        best = np.maximum(np.maximum(s0, s1), s2)
        is_copy = (kind > 0) & (best > -np.inf)
        is_swap = (kind == 0) & (best > -np.inf)
        if is_copy.any():
            k = np.flatnonzero(is_copy)
            pa, pb = np.divmod(i1[k], S)
            slot1 = aS[k, pa]
            f1 = row[A[k], gos[ridx[k, pm[k, pa]]] * S + pb] if Nm and (kind[k] == 1).any() else slot1
            pa, pb = np.divmod(i2[k], max(Nm, 1))
            slot2, f2 = ridx[k, pb], ea[k, pa]
            sl = np.where(kind[k] == 1, slot1, slot2)
            f = np.where(kind[k] == 1, f1, f2)
            rr = A[k]
            e = row[rr, sl]
            gs = gos[sl]
            kg = ((rr * G)[:, None] + arG) * E1
            new = (gpu_load[rr] + Mf[kg + e[:, None]] * dplus[rr, e][:, None]
                   - Mf[kg + f[:, None]] * dminus[rr, f][:, None])
            new[np.arange(k.size), gs] += pnew[rr, f] - per[rr, e] - dplus[rr, e]
            ok = _relu(new - T[rr][:, None]).sum(axis=1) < ex[k].sum(axis=1) - thr[k]
            is_swap[k[~ok]] = s0[k[~ok]] > -np.inf
            is_copy[k[~ok]] = False
            if ok.any():
                copy(rr[ok], sl[ok], f[ok], new[ok])
        if is_swap.any():
            k = np.flatnonzero(is_swap)
            pa, pb = np.divmod(i0[k], nb)
            swap(A[k], aS[k, pa], bidx[k, pb])
        stuck = ~(is_copy | is_swap)
        if stuck.any() and nb < P - S:  # no action helps: a swap of h with any slot of another GPU
            k = np.flatnonzero(stuck)
            LTk = np.repeat(LT[k], S, axis=1).astype(np.float32)
            d = xa[k].astype(np.float32)[:, :, None] - item[A[k]].astype(np.float32)[:, None, :]
            t = LTk[:, None, :] + d
            np.maximum(t, 0.0, out=t)
            gain = np.minimum(d, u[k].astype(np.float32)[:, None, None], out=d)
            gain -= t
            gain += _relu(LTk)[:, None, :]
            np.copyto(gain, -np.inf, where=(gos == h[k][:, None])[:, None, :])
            gain = gain.reshape(k.size, -1)
            j = gain.argmax(axis=1)
            pa, sb = np.divmod(j, P)
            dj = xa[k, pa] - item[A[k], sb]
            LTj = LT[k, gos[sb]]
            ok = (np.minimum(dj, u[k]) + _relu(LTj) - _relu(LTj + dj) > thr[k]) & (gos[sb] != h[k])
            if ok.any():
                k, pa, sb = k[ok], pa[ok], sb[ok]
                swap(A[k], aS[k, pa], sb)
                stuck[k] = False
        if stuck.any():  # still none: a 3-cycle h -> g1 -> g2 -> h (two swaps in a row)
            k = np.flatnonzero(stuck)
            gb_k = gos[bidx[k]]
            xk = np.where(bok[k], xb[k], 0.0)
            x_a = xa[k][:, :, None, None]
            x_b = xk[:, None, :, None]  # item leaving g1 (for g2)
            x_c = xk[:, None, None, :]  # item leaving g2 (for h)
            lt1 = LTb[k][:, None, :, None]
            lt2 = LTb[k][:, None, None, :]
            gain = (u[k][:, None, None, None] - _relu(LTh[k][:, None, None, None] - x_a + x_c)
                    + _relu(lt1) - _relu(lt1 + x_a - x_b) + _relu(lt2) - _relu(lt2 + x_b - x_c))
            bad = ((gb_k[:, None, :, None] == gb_k[:, None, None, :]) | ~bok[k][:, None, :, None]
                   | ~bok[k][:, None, None, :])
            gain = np.where(bad, -np.inf, gain).reshape(k.size, -1)
            best3 = gain.argmax(axis=1)
            ok3 = gain[np.arange(k.size), best3] > thr[k]
            if ok3.any():
                k, best3 = k[ok3], best3[ok3]
                pa, rest = np.divmod(best3, nb * nb)
                pb, pc = np.divmod(rest, nb)
                rr = A[k]
                swap(rr, aS[k, pa], bidx[k, pb])
                swap(rr, aS[k, pa], bidx[k, pc])
                stuck[k] = False
        copies_recent = with_copies and int(is_copy.sum()) > _COPY_SHARE * n
        forced = bool(stuck.any()) and not with_copies  # a stuck row gets a try with copies before it stops
        if forced:
            stuck[:] = False
        done = A[~stuck]
        points.append((done, moved[done].copy(), gpu_load[done].max(axis=1)))
        log.append(None)
        active = done[gpu_load[done].max(axis=1) > T[done]]
    return points, log
