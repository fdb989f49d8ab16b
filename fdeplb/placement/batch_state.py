"""The bookkeeping of the batched repair (:mod:`fdeplb.placement.repair`): every array it keeps about its rows, and
the two actions that change them.

:class:`BatchState` owns the rows (``row`` int64 [R, P], updated in place through flat views), the replicas of
every expert on every GPU now and in the old placement (``M``/``Mo``, flat int16), the replica counts and the
per-replica loads derived from them (``per``, and ``dplus``/``pnew``/``dminus``: what one replica less or more
does), every slot's load (``item``) and flags (``m_slot``: replicas of its expert on its GPU, ``moved_slot``,
``multi_slot``), the GPU loads, the moved experts per row, the list of multi-replica slots and the action log.
:meth:`BatchState.swap` and :meth:`BatchState.copy` apply one action per given row and keep every one of those
arrays exact; :meth:`BatchState.copy_loads` is the exact GPU loads a copy would give, for the check before it.
"""

from __future__ import annotations

import numpy as np

_SWAP_STEP = np.array([[-1], [1], [-1], [1]], dtype=np.int16)  # count changes of the 4 (GPU, expert) keys of a swap


def compact(mask: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Column indices of the True entries of every row of ``mask`` [n, m], in order, at most ``limit`` per row:
    (int64 [n, k] indices padded with 0, bool [n, k] valid), k = the largest count (<= limit)."""
    n = mask.shape[0]
    rows, cols = np.divmod(mask.ravel().nonzero()[0], mask.shape[1])  # np.nonzero's order, ~4x faster on 2-D masks
    counts = np.bincount(rows, minlength=n)
    k = int(min(limit, counts.max(initial=0)))
    idx = np.zeros((n, k), dtype=np.int64)
    ok = np.zeros((n, k), dtype=bool)
    if k:
        pos = np.arange(rows.size) - (counts.cumsum() - counts).repeat(counts)
        keep = pos < k
        idx[rows[keep], pos[keep]] = cols[keep]
        ok[rows[keep], pos[keep]] = True
    return idx, ok


def _gpu_expert_counts(idx: np.ndarray, num_gpus: int, width: int) -> np.ndarray:
    """int16 [R, G, width]: replicas of every expert on every GPU, from slot contents ``idx`` int [R, P]."""
    R, P = idx.shape
    S = P // num_gpus
    flat = ((np.arange(R)[:, None] * num_gpus + np.arange(P) // S) * width + idx).reshape(R * num_gpus, S)
    M = np.zeros(R * num_gpus * width, dtype=np.int16)  # no int64 [R * G * width] temporary (page faults)
    M[flat] = 1
    ordered = np.sort(flat, axis=1)
    again = ordered[:, 1:] == ordered[:, :-1]  # a second (third...) replica of an expert on the same GPU
    if again.any():
        np.add.at(M, ordered[:, 1:][again], 1)
    return M.reshape(R, num_gpus, width)


class BatchState:
    """The rows under repair and every count derived from them (arguments: see
    :func:`fdeplb.placement.repair.repair_rows`; ``row`` must be C-contiguous and is updated in place)."""

    def __init__(self, row: np.ndarray, load: np.ndarray, old: np.ndarray, targets: np.ndarray, num_gpus: int):
        R, P = row.shape
        G = num_gpus
        S = P // G
        E = load.shape[1]
        E1 = E + 1  # expert E: the dummy of old slots with no expert of the row
        self.R, self.P, self.G, self.S, self.E, self.E1 = R, P, G, S, E, E1
        self.gos = gos = np.arange(P) // S
        self.arS, self.arG = np.arange(S), np.arange(G)
        M = _gpu_expert_counts(row, G, E1)
        Mo = _gpu_expert_counts(np.where(old >= 0, old, E), G, E1)
        self.Mf, self.Mof = Mf, Mof = M.reshape(-1), Mo.reshape(-1)
        slot_key = (np.arange(R)[:, None] * G + gos) * E1  # + expert: flat index into M of (row, GPU of slot, expert)
        count = np.bincount((np.arange(R)[:, None] * E1 + row).ravel(), minlength=R * E1).reshape(R, E1)
        count[:, E] = 1
        load1 = np.concatenate([np.asarray(load, dtype=np.float64), np.zeros((R, 1))], axis=1)
        per = load1 / count
        self.dplus = np.where(count >= 2, load1 / np.maximum(count - 1, 1) - per, 0.0)  # per-replica rise when one goes
        self.pnew = pnew = load1 / (count + 1)  # per-replica load with one more replica
        self.dminus = per - pnew  # per-replica drop when one more comes
        self.row, self.count, self.load1, self.per = row, count, load1, per
        self.item = item = np.take_along_axis(per, row, axis=1)  # load of every slot
        self.gpu_load = gpu_load = item.reshape(R, G, S).sum(axis=2)
        self.m_slot = m_slot = Mf[slot_key + row]  # replicas of the slot's expert on the slot's GPU
        old_slot = Mof[slot_key + row]
        self.moved_slot = moved_slot = m_slot > old_slot  # its expert is on its GPU more often than before
        self.multi_slot = multi_slot = np.take_along_axis(count, row, axis=1) >= 2  # its expert has >= 2 replicas
        # moved experts, sum over (GPU, expert) of max(M - Mo, 0): each of an expert's m replicas on a GPU carries
        # 1/m of it (rounded: the float sum is within 1e-12 of the integer)
        self.moved = np.rint((np.maximum(m_slot - old_slot, 0) / m_slot).sum(axis=1)).astype(np.int64)
        self.T = np.asarray(targets, dtype=np.float64)
        # flat views of the same arrays
        self.rowf, self.itemf, self.loadf = row.reshape(-1), item.reshape(-1), gpu_load.reshape(-1)
        self.m_slotf, self.moved_slotf = m_slot.reshape(-1), moved_slot.reshape(-1)
        self.multi_slotf = multi_slot.reshape(-1)
        self.slot_keyf = slot_key.reshape(-1)
        #: the multi-replica slots of every row (indices, valid), kept up to date
        self.mlist = list(compact(multi_slot, P))
        self.buffers = [np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float32), np.empty(0)]
        #: one ``(rows, kind, i, j)`` entry per applied batch (see repair_rows); the driver adds ``None`` per iteration
        self.log: list = []

    def scratch(self, i: int, shape: tuple[int, int, int]) -> np.ndarray:
        """A reused work array (large temporaries cost page faults every iteration): float32 for ``i`` 0 and 1,
        float64 for 2."""
        buffers = self.buffers
        size = shape[0] * shape[1] * shape[2]
        if buffers[i].size < size:
            buffers[i] = np.empty(size, dtype=buffers[i].dtype)
        return buffers[i][:size].reshape(shape)

    def refresh(self, rr: np.ndarray, gpus: np.ndarray) -> None:
        """Per-slot counts of the slots of GPUs ``gpus`` [k] of rows ``rr`` [k]."""
        sl = (rr * self.P + gpus * self.S)[:, None] + self.arS
        key = self.slot_keyf[sl] + self.rowf[sl]
        self.m_slotf[sl] = self.Mf[key]
        self.moved_slotf[sl] = self.Mf[key] > self.Mof[key]

    def swap(self, rr: np.ndarray, sa: np.ndarray, sb: np.ndarray) -> None:
        """Exchange the experts of slots sa and sb of rows rr (one slot pair per row)."""
        P, G, E1, gos = self.P, self.G, self.E1, self.gos
        rowf, itemf, loadf, Mf, Mof = self.rowf, self.itemf, self.loadf, self.Mf, self.Mof
        multi_slotf, mlist, moved = self.multi_slotf, self.mlist, self.moved
        fa, fb = rr * P + sa, rr * P + sb
        va, vb = rowf[fa], rowf[fb]
        same = va == vb  # nothing to do (a 3-cycle's second swap may meet the same expert)
        if same.any():
            rr, sa, sb, fa, fb, va, vb = rr[~same], sa[~same], sb[~same], fa[~same], fb[~same], va[~same], vb[~same]
        ga, gb = rr * G + gos[sa], rr * G + gos[sb]
        keys = np.array([ga * E1 + va, ga * E1 + vb, gb * E1 + vb, gb * E1 + va])  # distinct per row
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
        self.refresh(np.concatenate([rr, rr]), np.concatenate([gos[sa], gos[sb]]))
        self.log.append((rr, 0, sa, sb))

    def copy_loads(self, rr: np.ndarray, sl: np.ndarray, f: np.ndarray) -> np.ndarray:
        """float64 [k, G]: the exact GPU loads of rows ``rr`` [k] if slot ``sl`` [k] took expert ``f`` [k]."""
        E1, Mf, dplus, dminus = self.E1, self.Mf, self.dplus, self.dminus
        e = self.row[rr, sl]
        gs = self.gos[sl]
        kg = ((rr * self.G)[:, None] + self.arG) * E1
        new = (self.gpu_load[rr] + Mf[kg + e[:, None]] * dplus[rr, e][:, None]
               - Mf[kg + f[:, None]] * dminus[rr, f][:, None])
        new[np.arange(rr.size), gs] += self.pnew[rr, f] - self.per[rr, e] - dplus[rr, e]
        return new

    def copy(self, rr: np.ndarray, sl: np.ndarray, f: np.ndarray, new: np.ndarray) -> None:
        """Slot sl of rows rr takes expert f; new: the rows' GPU loads after it (:meth:`copy_loads`)."""
        P, G, E1, row, rowf, Mf, Mof = self.P, self.G, self.E1, self.row, self.rowf, self.Mf, self.Mof
        count, load1, per = self.count, self.load1, self.per
        fs = rr * P + sl
        e, gs = rowf[fs], self.gos[sl]
        ke, kf = (rr * G + gs) * E1 + e, (rr * G + gs) * E1 + f
        self.moved[rr] += (Mf[kf] >= Mof[kf]).astype(np.int64) - (Mf[ke] > Mof[ke])
        rowf[fs] = f
        Mf[ke] -= 1
        Mf[kf] += 1
        r2, x = np.concatenate([rr, rr]), np.concatenate([e, f])
        count[r2, x] += np.repeat([-1, 1], rr.size)
        c, ld = count[r2, x], load1[r2, x]
        per[r2, x] = ld / c
        self.dplus[r2, x] = np.where(c >= 2, ld / np.maximum(c - 1, 1) - ld / c, 0.0)
        self.pnew[r2, x] = ld / (c + 1)
        self.dminus[r2, x] = ld / c - ld / (c + 1)
        rows = row[rr]
        self.item[rr] = per[rr[:, None], rows]
        self.multi_slot[rr] = count[rr[:, None], rows] >= 2
        self.gpu_load[rr] = new
        self.refresh(rr, gs)
        self._relist(rr, sl, e, f)
        self.log.append((rr, 1, sl, f))

    def _relist(self, rr: np.ndarray, sl: np.ndarray, e: np.ndarray, f: np.ndarray) -> None:
        """The multi-replica slot list after a copy of f over e in slot sl of rows rr: e's last replica leaves it,
        f's first other replica joins it (sl stays)."""
        row, count, mlist = self.row, self.count, self.mlist
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
