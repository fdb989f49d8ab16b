"""The :class:`Placement` value: phy2log plus the maps derived from it, and the trivial initial placement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fdeplb.errors import InputError, TopologyError
from fdeplb.placement._validate import check_int, check_phy2log


def derive_maps(phy2log: np.ndarray, num_logical_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log2phy, logcnt)`` of a checked int64 ``phy2log`` [L, P].

    ``logcnt`` int64 [L, E] counts each expert's slots; ``log2phy`` int64 [L, E, max(logcnt)] lists them in
    ascending phy_id order, padded with -1 (the same convention as vLLM's ``compute_logical_maps``).
    """
    L, P = phy2log.shape
    E = num_logical_experts
    logcnt = np.zeros((L, E), dtype=np.int64)
    np.add.at(logcnt, (np.arange(L)[:, None], phy2log), 1)
    order = np.argsort(phy2log, axis=1, kind="stable")  # phy ids grouped by expert, ascending within an expert
    starts = np.cumsum(logcnt, axis=1) - logcnt  # first position of each expert in `order`
    sorted_log = np.take_along_axis(phy2log, order, axis=1)
    replica = np.arange(P)[None, :] - np.take_along_axis(starts, sorted_log, axis=1)
    log2phy = np.full((L, E, int(logcnt.max())), -1, dtype=np.int64)
    log2phy[np.arange(L)[:, None], sorted_log, replica] = order
    return log2phy, logcnt


def replica_rank(log2phy: np.ndarray, num_physical_experts: int) -> np.ndarray:
    """int64 [L, P]: the position of every slot in its expert's list of ``log2phy`` [L, E, W] (-1: not listed).

    ``log2phy`` entries must lie in ``[-1, P)``. The inverse of building log2phy from replica ranks.
    """
    L, E, W = log2phy.shape
    rank = np.full((L, num_physical_experts + 1), -1, dtype=np.int64)
    where = np.where(log2phy >= 0, log2phy, num_physical_experts).reshape(L, -1)
    np.put_along_axis(rank, where, np.broadcast_to(np.tile(np.arange(W), E), where.shape), axis=1)
    return rank[:, :num_physical_experts]


def _ranked_log2phy(phy2log: np.ndarray, rank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """log2phy [L, E, max(logcnt)] listing every expert's slots by ``rank`` [L, P]; InputError unless valid."""
    L, P = phy2log.shape
    E, width = logcnt.shape[1], int(logcnt.max())
    if rank.shape != (L, P) or not np.issubdtype(rank.dtype, np.integer):
        raise InputError(f"replica_rank must be an integer array of shape {(L, P)}, got {rank.dtype} {rank.shape}")
    rank = rank.astype(np.int64)
    if not ((rank >= 0) & (rank < np.take_along_axis(logcnt, phy2log, axis=1))).all():
        raise InputError("replica_rank must rank every expert's slots 0 .. logcnt - 1")
    log2phy = np.full((L, E * width), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * width + rank, np.broadcast_to(np.arange(P, dtype=np.int64), (L, P)), 1)
    if np.count_nonzero(log2phy >= 0) != L * P:  # two slots of an expert with the same rank
        raise InputError("replica_rank must rank every expert's slots 0 .. logcnt - 1, each rank once")
    return log2phy.reshape(L, E, width)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every physical expert slot lives: the canonical ``phy2log`` and the maps derived from it.

    Attributes:
        phy2log: int64 [num_layers, num_physical_experts], logical expert id of every slot. Slots of EP rank ``r``
            are ``[r * P / num_gpus, (r + 1) * P / num_gpus)``.
        log2phy: int64 [num_layers, num_logical_experts, max_replicas], the slots of every logical expert, padded
            with -1: in ascending phy_id order, unless the policy gave its own order (policy "deepseek" lists them
            in replica-rank order, as DeepSeek's ``eplb.py`` does).
        logcnt: int64 [num_layers, num_logical_experts], replica count of every logical expert (>= 1, row sum = P).
        policy: name of the policy that produced the placement ("initial", "deepseek", ..., or "file").
        num_groups, num_nodes, num_gpus: the topology the placement was made for.

    All arrays are read-only. Two placements are equal when their phy2log and topology are equal.
    Build one with :meth:`from_phy2log`; the constructor does not check consistency.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    policy: str = "unknown"
    num_groups: int = 1
    num_nodes: int = 1
    num_gpus: int = 1

    @classmethod
    def from_phy2log(
        cls,
        phy2log: object,
        num_logical_experts: int,
        *,
        policy: str = "unknown",
        num_groups: int = 1,
        num_nodes: int = 1,
        num_gpus: int = 1,
        replica_rank: np.ndarray | None = None,
    ) -> "Placement":
        """Build a placement from ``phy2log`` [L, P] (any integer array-like), deriving log2phy and logcnt.

        ``replica_rank`` (int [L, P]) orders every expert's slots in log2phy by it instead of by phy_id (DeepSeek's
        replica ranks): for each expert its slots' ranks must be ``0 .. logcnt - 1``, once each.

        Raises:
            InputError: phy2log is not a 2-D integer array, holds an id outside ``[0, num_logical_experts)``, or
                leaves a logical expert without a slot.
                Or ``replica_rank`` is not of shape [L, P] or does not rank each expert's slots 0..logcnt-1.
            TopologyError: P is not a multiple of ``num_gpus`` or ``num_gpus`` not a multiple of ``num_nodes``.
        """
        E = check_int(num_logical_experts, "num_logical_experts")
        num_groups = check_int(num_groups, "num_groups")
        num_nodes = check_int(num_nodes, "num_nodes")
        num_gpus = check_int(num_gpus, "num_gpus")
        arr = check_phy2log(phy2log, E)
        if arr.shape[1] % num_gpus:
            raise TopologyError(f"num_physical_experts ({arr.shape[1]}) must be a multiple of num_gpus ({num_gpus})")
        if num_gpus % num_nodes:
            raise TopologyError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
        if arr is phy2log:
            arr = arr.copy()
        log2phy, logcnt = derive_maps(arr, E)
        if replica_rank is not None:
            log2phy = _ranked_log2phy(arr, np.asarray(replica_rank), logcnt)
        return cls(
            phy2log=_frozen(arr),
            log2phy=_frozen(log2phy),
            logcnt=_frozen(logcnt),
            policy=str(policy),
            num_groups=num_groups,
            num_nodes=num_nodes,
            num_gpus=num_gpus,
        )

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical_experts(self) -> int:
        """P, the number of slots per layer (= num_replicas)."""
        return int(self.phy2log.shape[1])

    num_replicas = num_physical_experts

    @property
    def num_logical_experts(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def num_redundant_experts(self) -> int:
        return self.num_physical_experts - self.num_logical_experts

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical_experts // self.num_gpus

    @property
    def max_replicas(self) -> int:
        return int(self.log2phy.shape[2])

    def gpu_of_slot(self) -> np.ndarray:
        """int64 [P], the EP rank of every slot."""
        return np.arange(self.num_physical_experts, dtype=np.int64) // self.slots_per_gpu

    def with_policy(self, policy: str) -> "Placement":
        """The same placement labelled with another policy name."""
        return Placement(self.phy2log, self.log2phy, self.logcnt, policy, self.num_groups, self.num_nodes, self.num_gpus)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.phy2log.shape == other.phy2log.shape
            and self.num_logical_experts == other.num_logical_experts
            and (self.num_groups, self.num_nodes, self.num_gpus) == (other.num_groups, other.num_nodes, other.num_gpus)
            and bool(np.array_equal(self.phy2log, other.phy2log))
        )

    __hash__ = None  # type: ignore[assignment]


def initial_placement(
    num_layers: int,
    num_logical_experts: int,
    num_replicas: int,
    *,
    num_groups: int = 1,
    num_nodes: int = 1,
    num_gpus: int = 1,
) -> Placement:
    """The trivial placement SGLang and vLLM start from: ``phy2log[l, p] = p % num_logical_experts``.

    The first E slots hold experts 0..E-1 in order; the redundant slots repeat experts 0, 1, ... again.

    Raises:
        InputError: a non-positive count.
        TopologyError: ``num_replicas < num_logical_experts``, or not a multiple of ``num_gpus``.
    """
    L = check_int(num_layers, "num_layers")
    E = check_int(num_logical_experts, "num_logical_experts")
    P = check_int(num_replicas, "num_replicas")
    if P < E:
        raise TopologyError(f"num_replicas ({P}) must be >= num_logical_experts ({E})")
    row = np.arange(P, dtype=np.int64) % E
    return Placement.from_phy2log(
        np.tile(row, (L, 1)), E, policy="initial", num_groups=num_groups, num_nodes=num_nodes, num_gpus=num_gpus
    )


__all__ = ["Placement", "derive_maps", "initial_placement", "replica_rank"]
