"""Placement over a live-rank mask: which slots may be routed to when some EP ranks are not members, how the
experts orphaned by a lost rank get a live slot, and the routing maps an elastic engine dispatches with.

A *live-rank mask* is bool [ep_size]: True for the EP ranks that serve (membership ACTIVE, see DESIGN.md section
3). The slots of a rank that is not live keep their phy2log entries (the rank loads exactly them when it rejoins),
but no route names them: :func:`live_maps` builds log2phy / logcnt over live slots only.

Re-placement (:func:`replace_orphans`) follows what elastic EP engines do when a rank is lost (vLLM's fault-tolerant
EPLB redistribution, TensorRT-LLM's active-rank mask): every logical expert whose replicas were all on lost ranks
takes over the slot of a *redundant* replica on a live rank (an expert that keeps at least one other live replica),
the least loaded replica first; nothing else moves. When no redundant replica is left for some orphan the call
fails closed with :class:`~fdeplb.errors.RedundancyError` naming the uncovered experts, and changes nothing.

Deterministic: orphans are served hottest first (ties: lower layer, then lower expert id), each takes the donor
slot with the lowest (per-replica load, -live replicas, phy_id). Pure numpy, no I/O.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError, RedundancyError, TopologyError

__all__ = ["check_live_ranks", "live_maps", "live_slots", "orphaned_experts", "replace_orphans"]


def check_live_ranks(live_ranks: object, ep_size: int) -> np.ndarray:
    """``live_ranks`` as bool [ep_size] (None: every rank live).

    Accepts a bool sequence / array of length ``ep_size``, or an iterable of live ep_rank integers (a set or a
    list of ints, each in ``[0, ep_size)``, no repeats). Raises :class:`~fdeplb.errors.InputError` for anything
    else, or when no rank is live."""
    if live_ranks is None:
        return np.ones(ep_size, dtype=bool)
    arr = np.asarray(sorted(live_ranks) if isinstance(live_ranks, (set, frozenset)) else live_ranks)
    if arr.dtype == bool:
        if arr.shape != (ep_size,):
            raise InputError(f"live_ranks as a mask must have shape ({ep_size},), got {arr.shape}")
        mask = arr.copy()
    elif arr.dtype.kind in "iu" and arr.ndim == 1:
        if arr.size and (arr.min() < 0 or arr.max() >= ep_size):
            raise InputError(f"live_ranks names a rank outside [0, {ep_size}): {arr.tolist()}")
        if np.unique(arr).size != arr.size:
            raise InputError(f"live_ranks names a rank twice: {arr.tolist()}")
        mask = np.zeros(ep_size, dtype=bool)
        mask[arr] = True
    else:
        raise InputError(f"live_ranks must be a bool mask of {ep_size} ranks or a list of ep_rank integers, "
                         f"got {arr.dtype} {arr.shape}")
    if not mask.any():
        raise InputError("live_ranks: no rank is live")
    return mask


def live_slots(num_physical_experts: int, ep_size: int, live: np.ndarray) -> np.ndarray:
    """bool [P]: the slots of the live ranks (slots of rank r are ``[r*P/ep_size, (r+1)*P/ep_size)``).
    :class:`~fdeplb.errors.TopologyError` when P is not a multiple of ``ep_size``."""
    if num_physical_experts % ep_size:
        raise TopologyError(f"num_physical_experts ({num_physical_experts}) must be a multiple of ep_size "
                            f"({ep_size})")
    return np.repeat(np.asarray(live, dtype=bool), num_physical_experts // ep_size)


def _live_counts(phy2log: np.ndarray, slots: np.ndarray, num_logical_experts: int) -> np.ndarray:
    """int64 [L, E]: replicas of every expert on live slots."""
    L = phy2log.shape[0]
    cnt = np.zeros((L, num_logical_experts), dtype=np.int64)
    np.add.at(cnt, (np.arange(L)[:, None], phy2log[:, slots]), 1)
    return cnt


def orphaned_experts(phy2log: np.ndarray, num_logical_experts: int, ep_size: int,
                     live: np.ndarray) -> list[tuple[int, int]]:
    """``(layer, log_id)`` of every logical expert with no replica on a live slot of ``phy2log`` (int64 [L, P]),
    in (layer, log_id) order."""
    cnt = _live_counts(phy2log, live_slots(phy2log.shape[1], ep_size, live), num_logical_experts)
    return [(int(l), int(e)) for l, e in np.argwhere(cnt == 0)]


def replace_orphans(phy2log: np.ndarray, num_logical_experts: int, ep_size: int, live: np.ndarray,
                    expert_load: np.ndarray | None = None) -> np.ndarray:
    """A copy of ``phy2log`` (int64 [L, P]) in which every orphaned expert (no replica on a live rank) takes the
    slot of a redundant live replica; every other slot is unchanged, so exactly one slot changes per orphan.

    ``expert_load`` ([L, E], non-negative; None: all zero) orders the work: hotter orphans choose first, and a donor
    is the live replica with the lowest per-replica load ``load[e] / live_replicas[e]`` of an expert that keeps at
    least one other live replica (ties: the expert with more live replicas, then the lower phy_id).

    Raises :class:`~fdeplb.errors.RedundancyError` (``.orphans``: every expert left uncovered, as (layer, log_id))
    when the live ranks lack redundant replicas for all orphans; nothing is returned then.
    """
    L, P = phy2log.shape
    E = num_logical_experts
    slots = live_slots(P, ep_size, live)
    load = np.zeros((L, E)) if expert_load is None else np.asarray(expert_load, dtype=np.float64)
    if load.shape != (L, E):
        raise InputError(f"expert_load must have shape {(L, E)}, got {load.shape}")
    new = np.array(phy2log, dtype=np.int64, copy=True)
    cnt = _live_counts(new, slots, E)
    orphans = np.argwhere(cnt == 0)
    if orphans.size == 0:
        return new
    order = np.lexsort((orphans[:, 1], orphans[:, 0], -load[orphans[:, 0], orphans[:, 1]]))
    live_idx = np.flatnonzero(slots)
    uncovered: list[tuple[int, int]] = []
    for l, e in orphans[order]:
        experts = new[l, live_idx]
        c = cnt[l, experts]
        donors = np.flatnonzero(c >= 2)
        if donors.size == 0:
            uncovered.append((int(l), int(e)))
            continue
        per_replica = load[l, experts[donors]] / c[donors]
        pick = donors[np.lexsort((live_idx[donors], -c[donors], per_replica))[0]]
        slot = live_idx[pick]
        cnt[l, new[l, slot]] -= 1
        new[l, slot] = e
        cnt[l, e] = 1
    if uncovered:
        uncovered.sort()
        shown = ", ".join(f"layer {l} expert {e}" for l, e in uncovered[:20])
        more = f" and {len(uncovered) - 20} more" if len(uncovered) > 20 else ""
        raise RedundancyError(f"redundancy insufficient: {len(orphans)} logical experts lost every replica and the "
                              f"live ranks' redundant replicas cover {len(orphans) - len(uncovered)} of them: "
                              f"{len(uncovered)} would have no replica on a live rank ({shown}{more})", uncovered)
    return new


def live_maps(phy2log: np.ndarray, num_logical_experts: int, ep_size: int,
              live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log2phy, logcnt)`` over the live slots of ``phy2log`` (int64 [L, P]): what the engine routes with while
    some ranks are not members. ``logcnt`` int64 [L, E] counts live replicas; ``log2phy`` int64 [L, E, W] lists
    them in ascending phy_id order, -1 padded, W = max live replicas. No entry names a slot of a non-live rank.

    Raises :class:`~fdeplb.errors.RedundancyError` when an expert has no live replica (route nothing to nowhere)."""
    from fdeplb.placement.core import derive_maps

    L, P = phy2log.shape
    E = num_logical_experts
    slots = live_slots(P, ep_size, live)
    masked = np.where(slots[None, :], phy2log, E)  # dead slots hold a sentinel expert E, dropped below
    log2phy, logcnt = derive_maps(masked, E + 1)
    logcnt = np.ascontiguousarray(logcnt[:, :E])
    if (logcnt == 0).any():
        orphans = [(int(l), int(e)) for l, e in np.argwhere(logcnt == 0)]
        raise RedundancyError(f"{len(orphans)} logical experts have no replica on a live rank (first: layer "
                              f"{orphans[0][0]} expert {orphans[0][1]})", orphans)
    width = int(logcnt.max())
    return np.ascontiguousarray(log2phy[:, :E, :width]), logcnt
