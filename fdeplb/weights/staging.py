"""Staging: the experts a plan loads from disk, read once each into host memory, with their checksums.

Staging happens in LOADING, while the old placement still serves: the budget is checked and every tensor name is
resolved before a byte is read, so a bad checkpoint or a too-small budget fails the round here (LOAD_FAILED), never
at swap time. Staged tensors are pinned when the live experts sit on a GPU, so the swap's host-to-device copies run
at full PCIe/NVLink-C2C speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fdeplb.errors import StagingBudgetError, WeightError
from fdeplb.weights import _paddle
from fdeplb.weights.checkpoint import CheckpointReader
from fdeplb.weights.plan import TransferPlan

#: checksum of one expert: CRC-32C of each suffix's raw bytes, in template order
ExpertChecksum = tuple[int, ...]


def expert_checksum(tensors: dict[str, Any]) -> ExpertChecksum:
    """CRC-32C (Castagnoli polynomial, google-crc32c, hardware-accelerated) of the raw bytes of each tensor of one
    expert, in the dict's order.

    Exact for what it guards against (a slot written with the wrong bytes): any change of up to 32 consecutive bits is
    always caught, any other with probability 1 - 2**-32 per tensor. Host tensors are hashed in place; device
    tensors are copied to the host first.
    """
    return tuple(_paddle.checksum(t) for t in tensors.values())


@dataclass(eq=False)
class StagedExperts:
    """Experts read from the checkpoint for one plan, waiting in host memory for the swap.

    Attributes:
        plan_key: :attr:`TransferPlan.key` of the plan they were staged for (the swap refuses another plan).
        device: the device the live experts are on (staging is pinned host memory when it is a GPU).
        experts: one ``suffix -> paddle.Tensor`` dict per entry of ``plan.disk``, same order.
        checksums: :data:`ExpertChecksum` per entry, computed from the tensors as read from the checkpoint.
        nbytes: host bytes held (0 after :meth:`release`).
        read_seconds: wall time of allocating, reading and checksumming.
    """

    plan_key: str
    device: str
    experts: list[dict[str, Any]] = field(default_factory=list)
    checksums: list[ExpertChecksum] = field(default_factory=list)
    nbytes: int = 0
    read_seconds: float = 0.0
    released: bool = False
    #: where released tensors go for reuse (the reader's buffer pool), or None to drop them
    recycle: Any = field(default=None, repr=False)

    def release(self, keep_buffers: bool = False) -> None:
        """Drop every staged tensor (abort, or after the swap); the live tensors are not touched. Idempotent.
        ``keep_buffers`` (after a swap): the tensors go to the reader's pool of pre-faulted staging buffers
        (:meth:`CheckpointReader.recycle`), which the next staging reuses; otherwise their memory is freed."""
        if keep_buffers and self.recycle is not None and self.experts:
            self.recycle([t for tensors in self.experts for t in tensors.values()])
        self.experts.clear()
        self.checksums.clear()
        self.nbytes = 0
        self.released = True

    def __len__(self) -> int:
        return len(self.experts)


def stage_experts(
    plan: TransferPlan,
    reader: CheckpointReader,
    budget_bytes: int | None = None,
    device: str | None = None,
    *,
    workers: int | None = None,
) -> StagedExperts:
    """Read the experts ``plan`` loads from disk (``plan.disk``, each once) into host memory.

    Every destination tensor is allocated (pinned on a GPU) before reading; ``workers`` threads then read whole
    experts by offset into them and checksum each expert right after reading it
    (:meth:`CheckpointReader.read_experts`).

    Args:
        plan: the rank's :class:`TransferPlan`.
        reader: the checkpoint.
        budget_bytes: most host bytes staging may hold; ``None`` is unlimited.
        device: the live experts' device (``None``: paddle's current one); a GPU gets pinned staging.
        workers: reading threads (default :meth:`CheckpointReader.read_experts`'s); 1 reads serially.

    Returns:
        :class:`StagedExperts` with ``nbytes == plan.counts["disk"] * reader.expert_nbytes``.

    Raises:
        StagingBudgetError: the experts would need more than ``budget_bytes``; raised before anything is read.
        CheckpointError: a tensor of a staged expert is missing or malformed; raised before anything is read.
    """
    dev = _paddle.resolve_device(device)
    need = len(plan.disk) * reader.expert_nbytes
    if budget_bytes is not None and need > budget_bytes:
        raise StagingBudgetError(
            f"rank {plan.ep_rank}: staging {len(plan.disk)} experts needs {need} bytes, over the budget of "
            f"{int(budget_bytes)} bytes; nothing was read"
        )
    for layer, expert in plan.disk:
        reader.check_expert(layer, expert)
    pinned = _paddle.is_gpu(dev)
    staged = StagedExperts(plan_key=plan.key, device=dev,
                           recycle=lambda tensors: reader.recycle(tensors, pinned=pinned))
    start = time.perf_counter()
    try:
        read = reader.read_experts(plan.disk, pinned=pinned, workers=workers, on_read=expert_checksum)
        for tensors, checksum in read:
            staged.checksums.append(checksum)
            staged.experts.append(tensors)
            staged.nbytes += sum(_paddle.nbytes(t) for t in tensors.values())
    except BaseException:
        staged.release()
        raise
    staged.read_seconds = time.perf_counter() - start
    return staged


def check_staged_for(plan: TransferPlan, staged: StagedExperts) -> None:
    """Raise WeightError unless ``staged`` holds exactly ``plan``'s disk experts (not released, same plan)."""
    if staged.released:
        raise WeightError(f"rank {plan.ep_rank}: the staged experts were released; stage the plan again")
    if staged.plan_key != plan.key or len(staged.experts) != len(plan.disk):
        raise WeightError(f"rank {plan.ep_rank}: the staged experts belong to another plan ({staged.plan_key} != {plan.key})")
