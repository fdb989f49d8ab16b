"""Placement quality metrics (DESIGN.md section 1).

GPU load of EP rank ``g`` in layer ``l`` = sum over the rank's slots ``p`` of
``expert_load[l, phy2log[l, p]] / logcnt[l, phy2log[l, p]]``: an expert's tokens are split evenly over its replicas.
All metrics are computed in float64 whatever the load dtype. ``phy2log`` arguments accept a :class:`Placement` too.

**Over the members.** With ``live_ranks`` (the EP ranks the placement is routed over, as
:func:`fdeplb.placement.check_live_ranks` takes them; None: every rank) a figure is what the engine sees when it
routes with :func:`fdeplb.placement.live_maps`: an expert's tokens are split over its replicas on those ranks only,
every other rank's GPU load is 0, and the per-layer mean / max of :func:`balancedness` and :func:`imbalance` are
over those ranks only (an excluded rank serves nothing: counting its slots would make a balanced placement look
unbalanced and stop every round after a rank is lost). An expert with no replica on them (orphaned: its tokens
reach no member) adds to no GPU. With every rank a member the figures are exactly those without ``live_ranks``.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError
from fdeplb.placement._validate import check_expert_load, check_int, check_phy2log, check_source_load
from fdeplb.placement.core import Placement
from fdeplb.placement.live_ranks import check_live_ranks, live_slots


def _phy2log_of(placement: object) -> np.ndarray:
    return placement.phy2log if isinstance(placement, Placement) else np.asarray(placement)


def _checked(expert_load: object, phy2log: object, num_gpus: object) -> tuple[np.ndarray, np.ndarray, int]:
    load = check_expert_load(expert_load)
    L, E = load.shape
    p2l = _phy2log_of(phy2log)
    if p2l.ndim != 2 or p2l.shape[0] != L:
        raise InputError(f"phy2log has shape {p2l.shape}, expected [{L}, num_physical_experts] to match expert_load")
    p2l = check_phy2log(p2l, E)
    G = check_int(num_gpus, "num_gpus")
    if p2l.shape[1] % G:
        raise InputError(f"num_physical_experts ({p2l.shape[1]}) is not a multiple of num_gpus ({G})")
    return load, p2l, G


def raw_gpu_loads(load: np.ndarray, phy2log: np.ndarray, num_gpus: int,
                  live: np.ndarray | None = None) -> np.ndarray:
    """:func:`gpu_loads` without input checks (callers pass checked float/int [L, E], int64 [L, P] and, for
    ``live``, a bool [num_gpus] mask or None)."""
    L, E = load.shape
    rows = np.arange(L)[:, None]
    routed = phy2log
    if live is not None:  # a slot of a rank not routed to holds the sentinel expert E: no replica, no load
        routed = np.where(live_slots(phy2log.shape[1], num_gpus, live)[None, :], phy2log, E)
    logcnt = np.zeros((L, E + 1), dtype=np.int64)
    np.add.at(logcnt, (rows, routed), 1)
    per_replica = load.astype(np.float64) / np.maximum(logcnt[:, :E], 1)
    if live is not None:
        per_replica = np.concatenate([per_replica, np.zeros((L, 1))], axis=1)
    return per_replica[rows, routed].reshape(L, num_gpus, -1).sum(axis=-1)


def gpu_loads(expert_load: object, phy2log: object, num_gpus: int, live_ranks: object = None) -> np.ndarray:
    """Load of every EP rank: float64 [num_layers, num_gpus], in the units of ``expert_load`` (tokens).

    Args:
        expert_load: [L, E] non-negative loads.
        phy2log: int [L, P] placement (or a :class:`Placement`); P a multiple of ``num_gpus``.
        num_gpus: EP size.
        live_ranks: the ranks routed to (module doc; None: every rank): the others' GPU load is 0.

    Raises:
        InputError: bad shapes or values (see :func:`fdeplb.placement.rebalance_experts`), or ``live_ranks`` that
            :func:`fdeplb.placement.check_live_ranks` refuses.
    """
    load, p2l, G = _checked(expert_load, phy2log, num_gpus)
    return raw_gpu_loads(load, p2l, G, None if live_ranks is None else check_live_ranks(live_ranks, G))


def _ratios(expert_load: object, phy2log: object, num_gpus: int,
            live_ranks: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer (mean, max, max > 0) of the GPU loads of the members (module doc): the one place figures are
    taken over the members."""
    load, p2l, G = _checked(expert_load, phy2log, num_gpus)
    live = None if live_ranks is None else check_live_ranks(live_ranks, G)
    loads = raw_gpu_loads(load, p2l, G, live)
    if live is not None:
        loads = loads[:, live]
    mean = loads.mean(axis=1)
    peak = loads.max(axis=1)
    return mean, peak, peak > 0


def balancedness(expert_load: object, phy2log: object, num_gpus: int, live_ranks: object = None) -> np.ndarray:
    """Per-layer mean(GPU load) / max(GPU load): float64 [L] in (0, 1]; 1.0 for a layer without load.

    ``live_ranks``: the ranks the placement is routed over (module doc; None: every rank): mean and max over
    them, each expert's tokens split over its replicas on them. Report the mean over layers. Raises
    :class:`InputError` on bad input.
    """
    mean, peak, nonzero = _ratios(expert_load, phy2log, num_gpus, live_ranks)
    return np.divide(mean, peak, out=np.ones_like(mean), where=nonzero)


def imbalance(expert_load: object, phy2log: object, num_gpus: int, live_ranks: object = None) -> np.ndarray:
    """Per-layer (max - mean) / mean of the GPU loads (TensorRT-LLM's figure): float64 [L] >= 0; 0.0 without load.

    ``1 + imbalance`` is the max/mean ratio; ``live_ranks`` as in :func:`balancedness`. Raises
    :class:`InputError` on bad input.
    """
    mean, peak, nonzero = _ratios(expert_load, phy2log, num_gpus, live_ranks)
    return np.divide(peak - mean, mean, out=np.zeros_like(mean), where=nonzero)


def _gpu_expert_counts(phy2log: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """int64 [L, num_gpus, E]: how many slots of each GPU hold each expert."""
    L, P = phy2log.shape
    gpu = np.arange(P) // (P // num_gpus)
    flat = (np.arange(L)[:, None] * num_gpus + gpu) * num_logical_experts + phy2log
    return np.bincount(flat.ravel(), minlength=L * num_gpus * num_logical_experts).reshape(
        L, num_gpus, num_logical_experts
    )


def moved_experts(old_phy2log: object, new_phy2log: object, num_gpus: int, *, per_layer: bool = False) -> int | np.ndarray:
    """Experts a GPU must receive to go from ``old_phy2log`` to ``new_phy2log``.

    Sum over layers and GPUs of the multiset difference new-minus-old of the experts on the GPU (an expert that
    stays on its GPU costs nothing, whatever slot it ends up in).

    Args:
        old_phy2log, new_phy2log: int [L, P] placements (or :class:`Placement`) of the same shape.
        num_gpus: EP size; P must be a multiple of it.
        per_layer: return int64 [L] instead of the total.

    Raises:
        InputError: shapes differ, negative ids, or P not a multiple of ``num_gpus``.
    """
    old = _phy2log_of(old_phy2log)
    new = _phy2log_of(new_phy2log)
    if old.shape != new.shape or old.ndim != 2:
        raise InputError(f"old_phy2log {old.shape} and new_phy2log {new.shape} must be 2-D with the same shape")
    G = check_int(num_gpus, "num_gpus")
    if old.shape[1] % G:
        raise InputError(f"num_physical_experts ({old.shape[1]}) is not a multiple of num_gpus ({G})")
    if old.dtype.kind not in "iu" or new.dtype.kind not in "iu" or min(old.min(), new.min()) < 0:
        raise InputError("phy2log arrays must hold non-negative integer expert ids")
    E = int(max(old.max(), new.max())) + 1
    diff = _gpu_expert_counts(new.astype(np.int64), G, E) - _gpu_expert_counts(old.astype(np.int64), G, E)
    moved = np.maximum(diff, 0).sum(axis=(1, 2))
    return moved if per_layer else int(moved.sum())


def moved_bytes(old_phy2log: object, new_phy2log: object, num_gpus: int, expert_nbytes: int) -> int:
    """Bytes of expert weights to transfer: :func:`moved_experts` x ``expert_nbytes`` (one expert's size, bytes)."""
    nbytes = check_int(expert_nbytes, "expert_nbytes", minimum=0)
    return int(moved_experts(old_phy2log, new_phy2log, num_gpus)) * nbytes


def node_local_load(source_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """float64 [L, num_nodes, E]: tokens the source ranks of every node route to every expert, from a checked
    ``source_load`` [L, R, E] (R a multiple of ``num_nodes``; EP ranks contiguous by node)."""
    L, R, E = source_load.shape
    return np.asarray(source_load, dtype=np.float64).reshape(L, num_nodes, R // num_nodes, E).sum(axis=2)


def cross_node_fraction(source_load: object, phy2log: object, num_gpus: int, num_nodes: int) -> np.ndarray:
    """Per-layer share of tokens that leave their source rank's node: float64 [L] in [0, 1] (0.0 without load).

    Model: an expert's tokens from every source rank are split evenly over its replicas (as in :func:`gpu_loads`);
    a token crosses nodes when the replica it reaches is on another node than the EP rank that sent it.

    Args:
        source_load: [L, num_gpus, E] tokens every source EP rank routed to every expert.
        phy2log: int [L, P] placement (or a :class:`Placement`); P a multiple of ``num_gpus``.
        num_gpus: EP size (= source ranks); a multiple of ``num_nodes``.
        num_nodes: nodes; EP ranks (and slots) are contiguous by node.

    Raises:
        InputError: bad shapes or values, source ranks != ``num_gpus``, or ``num_gpus`` not a multiple of
            ``num_nodes``.
    """
    source = check_source_load(source_load)
    load, p2l, G = _checked(source.sum(axis=1), phy2log, num_gpus)
    N = check_int(num_nodes, "num_nodes")
    if source.shape[1] != G or G % N:
        raise InputError(f"source_load has {source.shape[1]} source ranks; expected num_gpus ({G}), a multiple of "
                         f"num_nodes ({N})")
    L, P = p2l.shape
    logcnt = np.zeros(load.shape, dtype=np.int64)
    np.add.at(logcnt, (np.arange(L)[:, None], p2l), 1)
    local = node_local_load(source, N) / np.maximum(logcnt, 1)[:, None, :]
    node = np.arange(P) // (P // N)
    kept = local[np.arange(L)[:, None], node[None, :], p2l].sum(axis=1)
    total = load.sum(axis=1, dtype=np.float64)
    return np.divide(total - kept, total, out=np.zeros(L), where=total > 0).clip(0.0, 1.0)
