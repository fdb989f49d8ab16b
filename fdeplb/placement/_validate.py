"""Input checks shared by the placement policies, metrics and file readers.

Every check raises a typed error from :mod:`fdeplb.errors` (never ``assert``): :class:`InputError` for bad arrays
and arguments, :class:`TopologyError` for a topology that cannot hold a placement.
"""

from __future__ import annotations

import numpy as np

from fdeplb.checks import check_int as strict_int
from fdeplb.errors import InputError, TopologyError


def check_int(value: object, name: str, *, minimum: int = 1) -> int:
    """``value`` as a Python int >= ``minimum``; bools, floats and strings are refused with :class:`InputError`
    (:func:`fdeplb.checks.check_int`)."""
    return strict_int(value, name, lo=minimum)


#: largest expert_load value accepted (tokens): 2**53, the last integer float64 holds exactly.
MAX_LOAD = 2**53

#: most physical expert slots accepted per layer (DeepSeek-V3 at EP320 uses 320; this only stops absurd input).
MAX_REPLICAS = 1 << 20


def check_expert_load(expert_load: object, name: str = "expert_load") -> np.ndarray:
    """``expert_load`` as a 2-D numeric array [num_layers, num_logical_experts] (not copied when already an array).

    Raises:
        InputError: not 2-D, an empty dimension, a non-numeric dtype (bool, complex, object, str), NaN or inf, a
            negative value, or a value above 2**53.
    """
    try:
        arr = np.asarray(expert_load)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise InputError(f"{name} is not a rectangular array: {exc}") from None
    if arr.dtype.kind not in "iuf":
        raise InputError(f"{name} must have an integer or float dtype, got {arr.dtype}")
    if arr.ndim != 2:
        raise InputError(f"{name} must be 2-D [num_layers, num_logical_experts], got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{name} must have at least one layer and one expert, got shape {arr.shape}")
    _check_values(arr, name, ("layer", "expert"))
    return arr


def _check_values(arr: np.ndarray, name: str, dims: tuple[str, ...]) -> None:
    """The one rule on load values (finite, >= 0, <= :data:`MAX_LOAD`); the first bad value is named by its index
    along ``dims``. :class:`InputError` otherwise."""
    def at(bad: np.ndarray) -> str:
        return "[" + ", ".join(f"{d} {i}" for d, i in zip(dims, bad)) + "]"

    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"{name} has a NaN or inf value at {at(np.argwhere(~np.isfinite(arr))[0])}")
    if arr.dtype.kind != "u" and (arr < 0).any():
        bad = np.argwhere(arr < 0)[0]
        raise InputError(f"{name} has a negative value {arr[tuple(bad)]} at {at(bad)}")
    if (arr > MAX_LOAD).any():  # counts stay exact in float64 and summable in int64 below this
        bad = np.argwhere(arr > MAX_LOAD)[0]
        raise InputError(f"{name} has a value {arr[tuple(bad)]:.4g} above 2**53 at {at(bad)}")


def check_source_load(source_load: object) -> np.ndarray:
    """``source_load`` [num_layers, source_ranks, num_logical_experts] (tokens every source EP rank routed to every
    expert) as a numeric array, every value as :func:`check_expert_load` requires, and so its sum over source ranks.

    Raises:
        InputError: not 3-D, or a value or a sum over source ranks :func:`check_expert_load` refuses.
    """
    try:
        arr = np.asarray(source_load)
    except (TypeError, ValueError) as exc:
        raise InputError(f"source_load is not a rectangular array: {exc}") from None
    if arr.ndim != 3 or 0 in arr.shape:
        raise InputError(f"source_load must be 3-D [num_layers, source_ranks, num_logical_experts] and non-empty, "
                         f"got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise InputError(f"source_load must have an integer or float dtype, got {arr.dtype}")
    _check_values(arr, "source_load", ("layer", "source rank", "expert"))
    check_expert_load(arr.sum(axis=1), name="source_load summed over source ranks")
    return arr


def check_counts(expert_load: object, name: str = "expert_load") -> np.ndarray:
    """``expert_load`` (see :func:`check_expert_load`) as int64 token counts, never truncated.

    Raises:
        InputError: what :func:`check_expert_load` refuses, or a float value that is not a whole number (a
            fractional load is refused, not rounded).
    """
    arr = check_expert_load(expert_load, name)
    if arr.dtype.kind == "f":
        frac = arr != np.floor(arr)
        if frac.any():
            bad = np.argwhere(frac)[0]
            raise InputError(f"{name} has a fractional value {float(arr[tuple(bad)])!r} at [layer {bad[0]}, expert "
                             f"{bad[1]}]; loads are token counts (whole numbers)")
    return arr.astype(np.int64)


def check_topology(
    num_logical_experts: int, num_replicas: object, num_groups: object, num_nodes: object, num_gpus: object
) -> tuple[int, int, int, int, bool]:
    """Check a topology; return ``(num_replicas, num_groups, num_nodes, num_gpus, hierarchical)``.

    ``hierarchical`` is DeepSeek's rule: groups are packed onto nodes when ``num_groups % num_nodes == 0``,
    otherwise the global policy runs (one group, one node).

    Raises:
        InputError: a non-integer or non-positive count.
        TopologyError: ``num_replicas`` not a multiple of ``num_gpus`` or smaller than ``num_logical_experts``,
            ``num_gpus`` not a multiple of ``num_nodes``, or (hierarchical) ``num_logical_experts`` not a multiple of
            ``num_groups``.
    """
    num_replicas = check_int(num_replicas, "num_replicas")
    num_groups = check_int(num_groups, "num_groups")
    num_nodes = check_int(num_nodes, "num_nodes")
    num_gpus = check_int(num_gpus, "num_gpus")
    if num_replicas > MAX_REPLICAS:
        raise TopologyError(f"num_replicas ({num_replicas}) above {MAX_REPLICAS} slots per layer")
    if num_replicas % num_gpus:
        raise TopologyError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_replicas < num_logical_experts:
        raise TopologyError(
            f"num_replicas ({num_replicas}) must be >= num_logical_experts ({num_logical_experts}): "
            "every logical expert needs at least one slot"
        )
    if num_gpus % num_nodes:
        raise TopologyError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    hierarchical = num_groups % num_nodes == 0
    if hierarchical and num_logical_experts % num_groups:
        raise TopologyError(
            f"num_logical_experts ({num_logical_experts}) must be a multiple of num_groups ({num_groups}) "
            f"for the hierarchical policy (num_groups % num_nodes == 0)"
        )
    return num_replicas, num_groups, num_nodes, num_gpus, hierarchical


def check_phy2log(
    phy2log: object,
    num_logical_experts: int,
    *,
    name: str = "phy2log",
    shape: tuple[int, int] | None = None,
    error: type[InputError] = InputError,
) -> np.ndarray:
    """``phy2log`` as a C-contiguous int64 [num_layers, num_physical_experts] array; every logical expert present.

    Raises:
        ``error`` (InputError by default): not 2-D integer, wrong ``shape``, an id outside
            ``[0, num_logical_experts)``, or a logical expert with no slot in some layer.
    """
    try:
        arr = np.asarray(phy2log)
    except (TypeError, ValueError) as exc:
        raise error(f"{name} is not a rectangular array: {exc}") from None
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size and np.isfinite(arr).all() and (arr == np.round(arr)).all():
            arr = arr.astype(np.int64)
        else:
            raise error(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.ndim != 2 or 0 in arr.shape:
        raise error(f"{name} must be 2-D [num_layers, num_physical_experts] and non-empty, got shape {arr.shape}")
    if shape is not None and arr.shape != tuple(shape):
        raise error(f"{name} has shape {arr.shape}, expected {tuple(shape)}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= num_logical_experts:
        bad = np.argwhere((arr < 0) | (arr >= num_logical_experts))[0]
        raise error(
            f"{name}[{bad[0]}, {bad[1]}] = {arr[tuple(bad)]} is not a logical expert id in [0, {num_logical_experts})"
        )
    L = arr.shape[0]
    present = np.zeros((L, num_logical_experts), dtype=bool)
    present[np.arange(L)[:, None], arr] = True
    if not present.all():
        layer, expert = np.argwhere(~present)[0]
        raise error(f"{name}: logical expert {expert} has no slot in layer {layer}")
    return arr
