"""Placement quality metrics (DESIGN.md section 1).

GPU load of EP rank ``g`` in layer ``l`` = sum over the rank's slots ``p`` of
``expert_load[l, phy2log[l, p]] / logcnt[l, phy2log[l, p]]``: an expert's tokens are split evenly over its replicas.
All metrics are computed in float64 whatever the load dtype. ``phy2log`` arguments accept a :class:`Placement` too.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError
from fdeplb.placement._validate import check_expert_load, check_int, check_phy2log, check_source_load
from fdeplb.placement.core import Placement


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


def raw_gpu_loads(load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """:func:`gpu_loads` without input checks (callers pass checked float/int [L, E] and int64 [L, P])."""
    L, E = load.shape
    rows = np.arange(L)[:, None]
    logcnt = np.zeros((L, E), dtype=np.int64)
    np.add.at(logcnt, (rows, phy2log), 1)
    per_replica = load.astype(np.float64) / np.maximum(logcnt, 1)
    return per_replica[rows, phy2log].reshape(L, num_gpus, -1).sum(axis=-1)


def gpu_loads(expert_load: object, phy2log: object, num_gpus: int) -> np.ndarray:
    """Load of every EP rank: float64 [num_layers, num_gpus], in the units of ``expert_load`` (tokens).

    Args:
        expert_load: [L, E] non-negative loads.
        phy2log: int [L, P] placement (or a :class:`Placement`); P a multiple of ``num_gpus``.
        num_gpus: EP size.

    Raises:
        InputError: bad shapes or values (see :func:`fdeplb.placement.rebalance_experts`).
    """
    return raw_gpu_loads(*_checked(expert_load, phy2log, num_gpus))


def _ratios(loads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = loads.mean(axis=1)
    peak = loads.max(axis=1)
    return mean, peak, peak > 0


def balancedness(expert_load: object, phy2log: object, num_gpus: int) -> np.ndarray:
    """Per-layer mean(GPU load) / max(GPU load): float64 [L] in (0, 1]; 1.0 for a layer without load.

    Report the mean over layers. Raises :class:`InputError` on bad input.
    """
    mean, peak, nonzero = _ratios(gpu_loads(expert_load, phy2log, num_gpus))
    return np.divide(mean, peak, out=np.ones_like(mean), where=nonzero)


def imbalance(expert_load: object, phy2log: object, num_gpus: int) -> np.ndarray:
    """Per-layer (max - mean) / mean of the GPU loads (TensorRT-LLM's figure): float64 [L] >= 0; 0.0 without load.

    ``1 + imbalance`` is the max/mean ratio. Raises :class:`InputError` on bad input.
    """
    mean, peak, nonzero = _ratios(gpu_loads(expert_load, phy2log, num_gpus))
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
