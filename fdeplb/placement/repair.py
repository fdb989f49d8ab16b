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
- when none of these lowers the excess: a swap with any slot, then a 3-cycle ``h -> g1 -> g2 -> h``, then (with
  ``pair_swaps``, the hierarchical node rows) a 2-2 swap with one of the ``_LIGHT_GPUS`` lightest GPUs.

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

This module owns the evaluation of the actions and the loop: every iteration sees the active rows from their
heaviest GPU (``_Focus``), scores each action kind by a named function (``_best_swaps``, ``_best_copies_into``,
``_best_copies_out``, then ``_fallback_swaps`` and ``_fallback_cycles`` for rows where none helps) and applies the
best (``_apply_best``). The arrays the rows carry and the two actions that update them live in
:class:`fdeplb.placement.batch_state.BatchState`.
"""

from __future__ import annotations

import numpy as np

from fdeplb.placement.batch_state import BatchState, compact

#: swap partners: every slot of this many lightest GPUs of the row ...
_LIGHT_GPUS = 8
#: ... and up to this many slots (on GPUs under their target) whose expert was moved there
_MOVED_PARTNERS = 48
#: an action's excess reduction is divided by _MOVE_BASE ** (moved experts it adds)
_MOVE_BASE = 1.5
#: _POW[k + 3] = _MOVE_BASE ** -k for k in -3..3
_POW = _MOVE_BASE ** -np.arange(-3, 4, dtype=np.float64)
_POW32 = _POW.astype(np.float32)
#: "copy into h" is tried on rows of at most this many GPUs: with more, swap partners nearly always do as well (on
#: the DeepSeek-V3 32-GPU drift pairs of benchmarks/placement.py it changed the moved share by at most 0.2 points
#: and cost about a fifth of the repair's time; on the Qwen3-235B EP16 drift of /work/exp/harness.py 16 GPUs gave
#: 27.57% of a fresh plan's moves in 105 ms, 8 gave 27.55% in 79 ms; on the 8-GPU Qwen2 pair it saves about 1.3
#: points)
_INTO_MAX_GPUS = 8
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


class _Focus:
    """The active rows ``A`` of one iteration, seen from their heaviest GPU ``h``: load above target per GPU
    (``LT``, negative: room), its excess, the GPU order (lightest first), h's slots (``aS``) with their experts,
    loads and moved flags, and the rows' per-replica tables flattened for per-(row, expert) lookups."""

    def __init__(self, st: BatchState, A: np.ndarray):
        S, G, E1 = st.S, st.G, st.E1
        self.A = A
        self.n = n = A.size
        self.q = q = np.arange(n)
        self.q1 = q1 = q[:, None]
        self.AP = AP = A[:, None] * st.P  # flat offset of the rows' slots
        self.qE = q1 * E1
        rows_of = (lambda x: x) if n == st.R else (lambda x: x[A])  # all rows active: views, not copies
        self.rows_of = rows_of
        self.LT = LT = rows_of(st.gpu_load) - rows_of(st.T)[:, None]  # load above target per GPU (negative: room)
        self.ex = ex = _relu(LT)
        self.thr = ex.sum(axis=1) * _RTOL
        self.order = order = LT.argsort(axis=1, kind="stable")  # lightest first
        self.rank = rank = np.empty_like(order)
        rank[q1, order] = st.arG
        self.h = h = order[:, -1]
        self.LTh = LT[q, h]
        self.u = ex[q, h]  # excess of h
        self.mv = rows_of(st.moved_slot)
        self.LTf = LT.ravel()
        self.aS = aS = h[:, None] * S + st.arS  # [n,S] slots of h
        self.ia = ia = AP + aS
        self.ea, self.xa, self.lva = st.rowf[ia], st.itemf[ia], st.moved_slotf[ia]
        self.hkey = hkey = ((A * G + h) * E1)[:, None]  # + expert: M[row, h, expert]
        self.dpf, self.pnf, self.dmf = rows_of(st.dplus).ravel(), rows_of(st.pnew).ravel(), rows_of(st.dminus).ravel()
        self.Mh_a = st.Mf[hkey + self.ea].astype(np.float64)  # M[h, e_a]


class _Partners:
    """Swap partner slots of every active row: every slot of the lightest GPUs, then slots with a moved expert on
    GPUs under target (``bidx`` [n, nb], ``bok`` valid), with their loads, excesses and experts."""

    def __init__(self, st: BatchState, fo: _Focus):
        S = st.S
        light = min(_LIGHT_GPUS, st.G - 1)
        lightest = (fo.order[:, :light, None] * S + st.arS).reshape(fo.n, -1)
        extra = fo.mv & ((fo.LT < 0) & (fo.rank >= light)).repeat(S, axis=1)
        extra_idx, extra_ok = compact(extra, _MOVED_PARTNERS)
        self.bidx = bidx = np.concatenate([lightest, extra_idx], axis=1)
        self.bok = bok = np.concatenate([np.ones(lightest.shape, dtype=bool), extra_ok], axis=1)
        self.nb = bidx.shape[1]
        self.ib = ib = fo.AP + bidx
        self.xb = np.where(bok, st.itemf[ib], np.inf)
        self.LTb, eb = fo.LTf[fo.q1 * st.G + st.gos[bidx]], st.rowf[ib]
        Mh_b = st.Mf[fo.hkey + eb]  # M[h, e_b]
        self.arrive_b = (Mh_b >= st.Mof[fo.hkey + eb]).astype(np.int8)  # e_b arriving on h is a moved expert


def _best_swaps(st: BatchState, fo: _Focus, pt: _Partners) -> tuple[np.ndarray, np.ndarray]:
    """Every row's best swap of a slot of h with a partner slot: (flat index into [S, nb], score; -inf: none).
    Ranked in float32 for speed; the chosen swap's gain is recomputed in float64."""
    n, S, nb, q, u, xa = fo.n, st.S, pt.nb, fo.q, fo.u, fo.xa
    xb, LTb = pt.xb, pt.LTb
    d = np.subtract(xa.astype(np.float32)[:, :, None], xb.astype(np.float32)[:, None, :],
                    out=st.scratch(0, (n, S, nb)))
    LTb32 = LTb.astype(np.float32)
    t = np.add(LTb32[:, None, :], d, out=st.scratch(1, (n, S, nb)))
    np.maximum(t, 0.0, out=t)
    gain = np.minimum(d, u.astype(np.float32)[:, None, None], out=d)
    gain -= t
    gain += _relu(LTb32)[:, None, :]
    gain *= _POW32[4 - fo.lva.astype(np.int8)][:, :, None]
    gain *= _POW32[3 + pt.arrive_b - st.moved_slotf[pt.ib].astype(np.int8)][:, None, :]
    i0 = gain.reshape(n, -1).argmax(axis=1)
    pa, pb = np.divmod(i0, nb)
    d0 = xa[q, pa] - xb[q, pb]
    g0 = np.minimum(d0, u) + _relu(LTb[q, pb]) - _relu(LTb[q, pb] + d0)
    return i0, np.where(g0 > fo.thr, gain.reshape(n, -1)[q, i0], -np.inf)


class _Replicas:
    """The multi-replica slots of the active rows (``ridx`` [n, Nm], ``rok`` valid) and how the excess of the GPUs
    holding an expert changes when it loses a replica (``RISE``) or gains one (``FALL``), summed per expert."""

    def __init__(self, st: BatchState, fo: _Focus, ridx: np.ndarray, rok: np.ndarray):
        self.ridx, self.rok, self.Nm = ridx, rok, ridx.shape[1]
        n, E1 = fo.n, st.E1
        self.ir = ir = fo.AP + ridx
        self.g2 = g2 = st.gos[ridx]
        e2, LT2, m2 = st.rowf[ir], fo.LTf[fo.q1 * st.G + g2], st.m_slotf[ir].astype(np.float64)
        self.e2, self.LT2, self.m2 = e2, LT2, m2
        self.ie2 = ie2 = fo.qE + e2
        self.dp2 = dp2 = fo.dpf[ie2]
        self.ex2 = ex2 = _relu(LT2)
        self.rise2 = rise2 = np.where(rok, _relu(LT2 + m2 * dp2) - ex2, 0.0)
        fall2 = np.where(rok, ex2 - _relu(LT2 - m2 * fo.dmf[ie2]), 0.0)
        self.RISE = np.bincount(ie2.ravel(), (rise2 / m2).ravel(), n * E1)
        self.FALL = np.bincount(ie2.ravel(), (fall2 / m2).ravel(), n * E1)
        self.iea = iea = fo.qE + fo.ea
        self.dma = fo.dmf[iea]
        self.same = fo.ea.astype(np.int32)[:, :, None] == e2.astype(np.int32)[:, None, :]  # [n,S,Nm]


def _best_copies_into(st: BatchState, fo: _Focus, rp: _Replicas):
    """Every row's best *copy into h* [n,S,S]: slot a of h, whose expert has another replica on GPU g, takes the
    expert of a slot b of g (e_a's load moves to g, e_b's is split between g and h). Returns (flat index into
    [S, S], score; -inf: none, pm [n, S]: the multi slot holding e_a on another GPU, or None when not tried)."""
    n = fo.n
    i1, s1 = np.zeros(n, dtype=np.int64), np.full(n, -np.inf)
    if st.G > _INTO_MAX_GPUS:
        return i1, s1, None
    match = rp.same & ((rp.g2 != fo.h[:, None]) & rp.rok)[:, None, :]
    has = match.any(axis=2)
    if not has.any():
        return i1, s1, None
    S, arS, Mf, Mof, rowf, m_slotf, multi_slotf = st.S, st.arS, st.Mf, st.Mof, st.rowf, st.m_slotf, st.multi_slotf
    q, q1, AP, qE, LT, LTh, u, ea, xa = fo.q, fo.q1, fo.AP, fo.qE, fo.LT, fo.LTh, fo.u, fo.ea, fo.xa
    lva, hkey, dpf, pnf, dmf, Mh_a = fo.lva, fo.hkey, fo.dpf, fo.pnf, fo.dmf, fo.Mh_a
    g2, m2, iea, RISE, FALL = rp.g2, rp.m2, rp.iea, rp.RISE, rp.FALL
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
    s1[~(s1 > fo.thr)] = -np.inf
    return i1, s1, pm


def _best_copies_out(st: BatchState, fo: _Focus, rp: _Replicas) -> tuple[np.ndarray, np.ndarray]:
    """Every row's best *copy out of h* [n,S,Nm]: a multi-replica slot b on another GPU takes e_a. Returns (flat
    index into [S, Nm], score; -inf: none). Ranked in float32, the chosen copy's gain recomputed in float64."""
    n, S, Nm, Mf, itemf, moved_slotf = fo.n, st.S, rp.Nm, st.Mf, st.itemf, st.moved_slotf
    q, LTh, u, ea, hkey, pnf, Mh_a = fo.q, fo.LTh, fo.u, fo.ea, fo.hkey, fo.pnf, fo.Mh_a
    rok, ir, g2, e2, LT2, m2, ie2 = rp.rok, rp.ir, rp.g2, rp.e2, rp.LT2, rp.m2, rp.ie2
    dp2, ex2, rise2, RISE, FALL, iea, dma = rp.dp2, rp.ex2, rp.rise2, rp.RISE, rp.FALL, rp.iea, rp.dma
    fall_h = _relu(LTh[:, None]) - _relu(LTh[:, None] - Mh_a * dma)
    termA = u[:, None] + FALL[iea] - np.where(st.multi_slotf[fo.ia], fall_h, 0.0)  # [n,S]
    Mh_2 = Mf[hkey + e2].astype(np.float64)  # M[h, e_b]
    termB = ex2 - RISE[ie2] + _relu(LTh[:, None] + Mh_2 * dp2) - u[:, None] + rise2  # [n,Nm]
    base_b = np.where(rok & (g2 != fo.h[:, None]), LT2 - itemf[ir] + (m2 - 1) * dp2, np.inf)
    cut = np.add(termA.astype(np.float32)[:, :, None], termB.astype(np.float32)[:, None, :],
                 out=st.scratch(0, (n, S, Nm)))
    t = np.add(base_b.astype(np.float32)[:, None, :], pnf[iea].astype(np.float32)[:, :, None],
               out=st.scratch(1, (n, S, Nm)))
    np.maximum(t, 0.0, out=t)
    cut -= t
    np.subtract((LTh[:, None] + Mh_2 * dp2).astype(np.float32)[:, None, :],
                (Mh_a * dma).astype(np.float32)[:, :, None], out=t)
    np.maximum(t, 0.0, out=t)
    cut -= t
    np.copyto(cut, -np.inf, where=rp.same)
    cut *= _POW32[4 - moved_slotf[ir].astype(np.int8)][:, None, :]
    i2 = cut.reshape(n, -1).argmax(axis=1)
    pa, pb = np.divmod(i2, Nm)
    g2x = (termA[q, pa] + termB[q, pb] - _relu(base_b[q, pb] + pnf[iea][q, pa])
           - _relu(LTh + Mh_2[q, pb] * dp2[q, pb] - Mh_a[q, pa] * dma[q, pa]))
    return i2, np.where((g2x > fo.thr) & (e2[q, pb] != ea[q, pa]), cut.reshape(n, -1)[q, i2], -np.inf)


def _apply_best(st: BatchState, fo: _Focus, pt: _Partners, rp: _Replicas | None, swaps, into, out):
    """Apply every row's best action (a copy only after an exact check on every GPU, else the row takes its best
    swap). ``swaps``/``into``/``out``: the evaluators' results. Returns (is_copy, stuck) bool [n]."""
    (i0, s0), (i1, s1, pm), (i2, s2) = swaps, into, out
    S, gos, A, aS, ea = st.S, st.gos, fo.A, fo.aS, fo.ea
    kind = np.array([s0, s1, s2]).argmax(axis=0)
    best = np.maximum(np.maximum(s0, s1), s2)
    is_copy = (kind > 0) & (best > -np.inf)
    is_swap = (kind == 0) & (best > -np.inf)
    if is_copy.any():  # only when copies were evaluated: rp is set
        ridx, Nm = rp.ridx, rp.Nm
        k = is_copy.nonzero()[0]
        pa, pb = np.divmod(i1[k], S)
        slot1 = aS[k, pa]
        f1 = st.row[A[k], gos[ridx[k, pm[k, pa]]] * S + pb] if Nm and (kind[k] == 1).any() else slot1
        pa, pb = np.divmod(i2[k], max(Nm, 1))
        slot2, f2 = ridx[k, pb], ea[k, pa]
        sl = np.where(kind[k] == 1, slot1, slot2)
        f = np.where(kind[k] == 1, f1, f2)
        rr = A[k]
        new = st.copy_loads(rr, sl, f)
        ok = _relu(new - st.T[rr][:, None]).sum(axis=1) < fo.ex[k].sum(axis=1) - fo.thr[k]
        is_swap[k[~ok]] = s0[k[~ok]] > -np.inf
        is_copy[k[~ok]] = False
        if ok.any():
            st.copy(rr[ok], sl[ok], f[ok], new[ok])
    if is_swap.any():
        k = is_swap.nonzero()[0]
        pa, pb = np.divmod(i0[k], pt.nb)
        st.swap(A[k], aS[k, pa], pt.bidx[k, pb])
    return is_copy, ~(is_copy | is_swap)


def _fallback_swaps(st: BatchState, fo: _Focus, stuck: np.ndarray) -> None:
    """Rows ``stuck`` (bool [n], cleared where it acts) where no action helps: a swap of h with any slot of
    another GPU."""
    P, S, gos, item, A = st.P, st.S, st.gos, st.item, fo.A
    LT, u, h, xa, aS, thr = fo.LT, fo.u, fo.h, fo.xa, fo.aS, fo.thr
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
        st.swap(A[k], aS[k, pa], sb)
        stuck[k] = False


def _fallback_cycles(st: BatchState, fo: _Focus, pt: _Partners, stuck: np.ndarray) -> None:
    """Rows still ``stuck`` (cleared where it acts): a 3-cycle h -> g1 -> g2 -> h over partner slots (two swaps
    in a row)."""
    bidx, bok, xb, LTb, nb = pt.bidx, pt.bok, pt.xb, pt.LTb, pt.nb
    u, LTh, xa, aS, thr, S = fo.u, fo.LTh, fo.xa, fo.aS, fo.thr, st.S
    k = np.flatnonzero(stuck)
    gb_k = st.gos[bidx[k]]
    xk = np.where(bok[k], xb[k], 0.0)
    x_a = xa[k][:, :, None, None]
    x_b = xk[:, None, :, None]  # item leaving g1 (for g2)
    x_c = xk[:, None, None, :]  # item leaving g2 (for h)
    lt1 = LTb[k][:, None, :, None]
    lt2 = LTb[k][:, None, None, :]
    bad = ((gb_k[:, None, :, None] == gb_k[:, None, None, :]) | ~bok[k][:, None, :, None]
           | ~bok[k][:, None, None, :])
    first = u[k][:, None, None, None] - _relu(LTh[k][:, None, None, None] - x_a + x_c)
    second, third, fourth = _relu(lt1 + x_a - x_b), _relu(lt2), _relu(lt2 + x_b - x_c)
    best3, top = np.zeros(k.size, dtype=np.int64), np.zeros(k.size)
    # row by row: each term spans two of the axes [a, b, c], their sum all three; one reused [S, nb, nb] array
    # updated in place (the plain expression's operations in its order, so the same values)
    for i in range(k.size):
        gain = np.add(first[i], _relu(lt1[i]), out=st.scratch(2, (S, nb, nb)))
        gain -= second[i]
        gain += third[i]
        gain -= fourth[i]
        np.copyto(gain, -np.inf, where=bad[i])
        best3[i] = gain.argmax()
        top[i] = gain.ravel()[best3[i]]
    ok3 = top > thr[k]
    if ok3.any():
        k, best3 = k[ok3], best3[ok3]
        pa, rest = np.divmod(best3, nb * nb)
        pb, pc = np.divmod(rest, nb)
        rr = fo.A[k]
        st.swap(rr, aS[k, pa], bidx[k, pb])
        st.swap(rr, aS[k, pa], bidx[k, pc])
        stuck[k] = False


def _fallback_pairs(st: BatchState, fo: _Focus, stuck: np.ndarray) -> None:
    """Rows still ``stuck`` (cleared where it acts): a 2-2 swap, two slots of h with two slots of one of the
    ``_LIGHT_GPUS`` lightest GPUs (the exchange "balanced" ends with, :mod:`fdeplb.placement.balanced`), the one
    that lowers the excess most."""
    S, G, item = st.S, st.G, st.item
    first, second = np.triu_indices(S, 1)
    k = np.flatnonzero(stuck)
    if first.size == 0 or k.size == 0:
        return
    light = min(_LIGHT_GPUS, G - 1)
    rr, q = fo.A[k], np.arange(k.size)[:, None]
    gpus = fo.order[k, :light]  # [k, light]
    w = item[rr].reshape(k.size, G, S)
    pa = (w[q[:, 0], fo.h[k]][:, first] + w[q[:, 0], fo.h[k]][:, second])  # [k, Q]
    wg = w[q, gpus]  # [k, light, S]
    pb = wg[:, :, first] + wg[:, :, second]  # [k, light, Q]
    LTg = fo.LT[k[:, None], gpus][:, None, :, None]
    d = pa[:, :, None, None] - pb[:, None, :, :]  # [k, Q, light, Q]
    gain = np.minimum(d, fo.u[k][:, None, None, None]) - _relu(LTg + d) + _relu(LTg)
    flat = gain.reshape(k.size, -1)
    best = flat.argmax(axis=1)
    ok = flat[q[:, 0], best] > fo.thr[k]
    if ok.any():
        k, best, rr = k[ok], best[ok], rr[ok]
        qa, rest = np.divmod(best, light * first.size)
        gi, qb = np.divmod(rest, first.size)
        g = fo.order[k, gi]
        h = fo.h[k]
        st.swap(rr, h * S + first[qa], g * S + first[qb])
        st.swap(rr, h * S + second[qa], g * S + second[qb])
        stuck[k] = False


def repair_rows(row: np.ndarray, load: np.ndarray, old: np.ndarray, targets: np.ndarray, num_gpus: int, *,
                pair_swaps: bool = False):
    """Repair rows toward their targets (see the module docstring); ``row`` is modified in place.

    Args:
        row: C-contiguous int64 [R, P] expert of every slot (local ids 0..E-1, every expert at least once).
        load: float64 [R, E] load of every expert of the row (tokens).
        old: int64 [R, P] expert of every slot in the old placement; -1 where the old expert is not one of the
            row's (hierarchical mode: its group now lives on another node).
        targets: float64 [R] load every GPU of the row should come down to (tokens).
        num_gpus: GPUs per row (P a multiple of it).
        pair_swaps: a row that no other action helps tries a 2-2 swap (:func:`_fallback_pairs`) before it stops.

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
    st = BatchState(row, load, old, targets, num_gpus)
    points = [(np.arange(st.R), st.moved.copy(), st.gpu_load.max(axis=1))]
    if st.G < 2:
        return points, st.log
    active = np.flatnonzero(st.gpu_load.max(axis=1) > st.T)
    copies_recent, forced = True, False
    for it_no in range(_MAX_ITER):
        if active.size == 0:
            break
        fo = _Focus(st, active)
        pt = _Partners(st, fo)
        swaps = _best_swaps(st, fo, pt)
        ridx, rok = fo.rows_of(st.mlist[0]), fo.rows_of(st.mlist[1])
        # copies: every iteration while rows still take them, then every _COPY_EVERY-th (they are rare by then)
        with_copies = copies_recent or it_no % _COPY_EVERY == 0 or forced
        rp = _Replicas(st, fo, ridx, rok) if with_copies and ridx.shape[1] else None
        if rp is None:
            none = (np.zeros(fo.n, dtype=np.int64), np.full(fo.n, -np.inf))
            into, out = (*none, None), none
        else:
            into, out = _best_copies_into(st, fo, rp), _best_copies_out(st, fo, rp)
        is_copy, stuck = _apply_best(st, fo, pt, rp, swaps, into, out)
        if stuck.any() and pt.nb < st.P - st.S:  # no action helps: a swap of h with any slot of another GPU
            _fallback_swaps(st, fo, stuck)
        if stuck.any():  # still none: a 3-cycle h -> g1 -> g2 -> h
            _fallback_cycles(st, fo, pt, stuck)
        if pair_swaps and stuck.any():  # still none: a 2-2 swap
            _fallback_pairs(st, fo, stuck)
        copies_recent = with_copies and int(is_copy.sum()) > _COPY_SHARE * fo.n
        forced = bool(stuck.any()) and not with_copies  # a stuck row gets a try with copies before it stops
        if forced:
            stuck[:] = False
        done = active[~stuck]
        peak = st.gpu_load[done].max(axis=1)
        points.append((done, st.moved[done], peak))
        st.log.append(None)
        active = done[peak > st.T[done]]
    return points, st.log
