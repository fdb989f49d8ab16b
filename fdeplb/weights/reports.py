"""What the weight seam reports: the typed records a :class:`~fdeplb.weights.backend.WeightBackend` returns for
staging a plan (:class:`StageReport`), for a swap (:class:`SwapReport`) and for a verification of the live slots
(:class:`SlotCheck`). Plain data, no I/O: a leaf that the backends and the live experts both import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from fdeplb.weights.plan import TransferPlan

__all__ = ["SlotCheck", "StageReport", "SwapReport"]


@dataclass(frozen=True)
class StageReport:
    """What staging a plan costs one rank (the counts its rank record reports)."""

    keep: int
    """Slots whose expert stays in place."""
    local: int
    """Slots filled by copying an expert the rank already holds."""
    disk: int
    """Experts read from the checkpoint (each once)."""
    disk_slots: int
    """Slots filled from those experts."""
    disk_bytes: int
    """Bytes read from the checkpoint."""
    local_bytes: int
    """Bytes copied between slots of the rank."""
    peer: int = 0
    """Experts taken from a peer rank's live slot (each once, verified); ``disk`` counts the rest."""
    peer_bytes: int = 0
    """Bytes taken from peers' live slots instead of the checkpoint (``disk_bytes`` counts the rest)."""

    @classmethod
    def of(cls, transfer: TransferPlan, expert_nbytes: int, peer: int = 0) -> "StageReport":
        """The report of ``transfer`` for experts of ``expert_nbytes`` bytes each, ``peer`` of its new experts
        taken from peers."""
        nbytes = transfer.nbytes(expert_nbytes)
        counts = transfer.counts
        return cls(keep=counts["keep"], local=counts["local"], disk=counts["disk"] - peer,
                   disk_slots=transfer.disk_slots, disk_bytes=nbytes["disk"] - peer * int(expert_nbytes),
                   local_bytes=nbytes["local"], peer=peer, peer_bytes=peer * int(expert_nbytes))


@dataclass(frozen=True)
class SwapReport:
    """What one swap did (:meth:`~fdeplb.weights.backend.WeightBackend.swap`). Bytes are device bytes written into
    live slots; seconds are wall time.

    ``keep`` / ``local`` / ``disk`` / ``disk_slots``: the transfer's counts (as :class:`StageReport`);
    ``slots_verified``: slots the swap wrote and verified; ``bytes_from_staging``: staged (disk) experts copied in,
    one per disk slot; ``bytes_local``: slot-to-slot copies; ``bytes_snapshot``: slots copied aside to break copy
    cycles; ``copy_seconds``: the writes including the final device synchronisation; ``verify_seconds``:
    checksumming every changed slot; ``routing_seconds``: switching the routing tables.
    """

    ep_rank: int
    plan_key: str
    keep: int
    local: int
    disk: int
    disk_slots: int
    snapshots: int
    slots_verified: int
    bytes_from_staging: int
    bytes_local: int
    bytes_snapshot: int
    copy_seconds: float
    verify_seconds: float
    routing_seconds: float

    @property
    def seconds(self) -> float:
        return self.copy_seconds + self.verify_seconds + self.routing_seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds}


class SlotCheck(NamedTuple):
    """A verification of a rank's live slots against the source of truth
    (:meth:`~fdeplb.weights.backend.WeightBackend.verify`, :meth:`~fdeplb.weights.backend.WeightBackend.reload_in`);
    ``verified < total`` means corrupted slots."""

    verified: int
    """Slots holding exactly their logical expert's weights."""
    total: int
    """Slots of the rank (num_layers x slots per rank)."""
