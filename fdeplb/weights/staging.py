"""Staging: the experts a plan loads from disk, read once each into host memory, with their checksums, and the
device buffer a chunked swap moves them through.

Staging happens in LOADING, while the old placement still serves: the budget is checked and every tensor name is
resolved before a byte is read, so a bad checkpoint or a too-small budget fails the round here (LOAD_FAILED), never
at swap time. Staged tensors are pinned when the live experts sit on a GPU, so host-to-device copies run at full
PCIe/NVLink-C2C speed.

A swap applied in chunks of layers (one chunk per safe point) also gets a :class:`DeviceBuffer` on the live
experts' device, sized for its largest chunk and counted in the same budget: before a chunk's switch step its
staged experts are copied into it, so the pause itself is a device-to-device copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fdeplb.errors import StagingBudgetError, WeightError
from fdeplb.weights import _paddle
from fdeplb.weights.checkpoint import CheckpointReader
from fdeplb.weights.peer_staging import PeerFetch, fetch_from_peers
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
class LoadedChunk:
    """One chunk of a swap as :meth:`fdeplb.weights.LiveExperts.load_chunk` worked it out and checked it against the
    live experts, before the chunk's switch step, so that the pause (:meth:`~fdeplb.weights.LiveExperts.swap_layers`)
    only copies: it checks that nothing it relied on moved since (the same plan, the same rows of the new
    placement, the live experts' :attr:`~fdeplb.weights.LiveExperts.epoch`) and applies what is here.

    Attributes:
        layers: the chunk (sorted layer indices).
        plan: the plan it was loaded for (``plan_key``: its :attr:`~fdeplb.weights.TransferPlan.key`).
        new_rows: int64 ``[len(layers), P]``: the chunk's rows of the new placement.
        live, live_epoch: the live experts it was checked against (another's pause refuses it) and their epoch then (a reload, a clear, a whole swap or a change of the
            routed ranks moves it, and the pause then refuses the chunk: load it again).
        slot_nbytes: bytes of one slot (every suffix), for the report's byte counts.
        loaded: index into ``plan.disk`` -> buffer entry.
        local: the chunk's local copies and snapshots (``(kind, layer, slot, source)``), in the plan's order.
        disk_batch, disk_written: the disk writes as one :class:`~fdeplb.weights._paddle.CheckedCopies` (checked
            when built) and, behind each of its copies, ``(kind, layer, first slot, first buffer entry, slots,
            suffix)`` (consecutive slots from consecutive entries are one run).
        routing: the chunk's new routing rows (phy2log / log2phy / logcnt, one block per run of consecutive
            layers) as one :class:`~fdeplb.weights._paddle.CheckedCopies` onto the live tables.
        counts: the report's counts (``keep``, ``local``, ``disk``, ``disk_slots``, ``snapshots``: slots, or
            experts for ``disk``).
        checksums: ``((layer, expert), checksum)`` of the chunk's staged experts, recorded once the chunk lands.
    """

    layers: tuple[int, ...]
    plan: TransferPlan
    plan_key: str
    new_rows: Any
    live: Any
    live_epoch: int
    slot_nbytes: int
    loaded: dict[int, int]
    local: list[tuple[str, int, int, int]]
    disk_batch: Any
    disk_written: list[tuple[str, int, int, int, int, str]]
    routing: Any
    counts: dict[str, int]
    checksums: list[tuple[tuple[int, int], ExpertChecksum]]


class DeviceBuffer:
    """Room for one chunk's staged experts on the live experts' device (``capacity`` experts, each every suffix of
    ``spec``), filled before the chunk's switch step (:meth:`fdeplb.weights.LiveExperts.load_chunk`), with what the
    chunk's pause applies (:class:`LoadedChunk`).

    Attributes:
        tensors: ``suffix -> tensor [capacity, *shape]`` on ``device``; entries: one ``suffix -> view`` per entry.
        nbytes: device bytes held (0 after :meth:`release`).
        chunk: the :class:`LoadedChunk` it holds (None: none, or the last one was applied).
    """

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], Any]], capacity: int, device: str) -> None:
        self.device = device
        self.capacity = int(capacity)
        self.tensors = {suffix: _paddle.empty([self.capacity, *shape], dtype, device)
                        for suffix, (shape, dtype) in spec.items()} if self.capacity else {}
        self.entries = [{suffix: t[i] for suffix, t in self.tensors.items()} for i in range(self.capacity)]
        self.nbytes = sum(_paddle.nbytes(t) for t in self.tensors.values())
        self.chunk: LoadedChunk | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers of the chunk it holds (``()``: none)."""
        return () if self.chunk is None else self.chunk.layers

    def release(self) -> None:
        """Free the device memory (idempotent)."""
        self.tensors, self.entries, self.nbytes = {}, [], 0
        self.chunk = None


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
        buffer: the chunked swap's :class:`DeviceBuffer` (None: the swap copies from host staging at once).
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
    buffer: DeviceBuffer | None = field(default=None, repr=False)
    #: bytes taken from peers' live slots (:mod:`fdeplb.weights.peer_staging`) instead of the checkpoint
    peer_bytes: int = 0
    #: experts of ``plan.disk`` that arrived from peers (each verified), and those their peer did not deliver
    from_peers: int = 0
    fallbacks: list[Any] = field(default_factory=list)

    def release(self, keep_buffers: bool = False) -> None:
        """Drop every staged tensor (abort, or after the swap); the live tensors are not touched. Idempotent.
        ``keep_buffers`` (after a swap): the tensors go to the reader's pool of pre-faulted staging buffers
        (:meth:`CheckpointReader.recycle`), which the next staging reuses; otherwise their memory is freed."""
        if keep_buffers and self.recycle is not None and self.experts:
            self.recycle([t for tensors in self.experts for t in tensors.values()])
        if self.buffer is not None:
            self.buffer.release()
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
    buffer_experts: int = 0,
    peers: PeerFetch | None = None,
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
        buffer_experts: experts a :class:`DeviceBuffer` on ``device`` must hold (a chunked swap's largest chunk;
            0 = none); its bytes count against ``budget_bytes`` too.
        peers: take the experts whose source is a peer from its live slots, verified on arrival
            (:func:`fdeplb.weights.peer_staging.fetch_from_peers`); one a peer does not deliver is read from the
            checkpoint (``StagedExperts.fallbacks``). None: every expert from the checkpoint.

    Returns:
        :class:`StagedExperts` with ``nbytes == plan.counts["disk"] * reader.expert_nbytes`` (and ``buffer``).

    Raises:
        StagingBudgetError: the experts and the device buffer would need more than ``budget_bytes``; raised before
            anything is read or allocated.
        CheckpointError: a tensor of a staged expert is missing or malformed; raised before anything is read.
    """
    dev = _paddle.resolve_device(device)
    buffer_bytes = int(buffer_experts) * reader.expert_nbytes
    need = len(plan.disk) * reader.expert_nbytes + buffer_bytes
    if budget_bytes is not None and need > budget_bytes:
        buffer = f" (with a device buffer of {buffer_experts} experts, {buffer_bytes} bytes)" if buffer_bytes else ""
        raise StagingBudgetError(
            f"rank {plan.ep_rank}: staging {len(plan.disk)} experts{buffer} needs {need} bytes, over the budget of "
            f"{int(budget_bytes)} bytes; nothing was read"
        )
    for layer, expert in plan.disk:
        reader.check_expert(layer, expert)
    pinned = _paddle.is_gpu(dev)
    staged = StagedExperts(plan_key=plan.key, device=dev,
                           recycle=lambda tensors: reader.recycle(tensors, pinned=pinned))
    start = time.perf_counter()
    try:
        read = _read(plan, reader, pinned, workers, peers, staged)
        for tensors, checksum in read:
            staged.checksums.append(checksum)
            staged.experts.append(tensors)
            staged.nbytes += sum(_paddle.nbytes(t) for t in tensors.values())
        if buffer_experts:
            staged.buffer = DeviceBuffer(reader.spec, buffer_experts, dev)
    except BaseException:
        staged.release()
        raise
    staged.read_seconds = time.perf_counter() - start
    return staged


def _read(plan: TransferPlan, reader: CheckpointReader, pinned: bool, workers: int | None, peers: PeerFetch | None,
          staged: StagedExperts) -> list[tuple[dict[str, Any], ExpertChecksum]]:
    """``plan.disk``'s experts with their checksums, in order: from peers where ``peers`` names one that delivers,
    the rest from the checkpoint; records the peers' share and fallbacks on ``staged``."""
    if peers is None:
        return reader.read_experts(plan.disk, pinned=pinned, workers=workers, on_read=expert_checksum)
    spec = reader.spec
    got = fetch_from_peers(plan.disk, peers,
                           lambda _l, _e: {s: reader.buffer(shape, dtype, pinned)
                                           for s, (shape, dtype) in spec.items()},
                           _paddle.host_buffer, lambda views: tuple(_paddle.crc32c(v) for v in views.values()))
    rest = [i for i in range(len(plan.disk)) if i not in got.got]
    merged = dict(got.got)
    merged.update(zip(rest, reader.read_experts([plan.disk[i] for i in rest], pinned=pinned, workers=workers,
                                                on_read=expert_checksum)))
    staged.peer_bytes, staged.from_peers, staged.fallbacks = got.peer_bytes, len(got.got), got.fallbacks
    return [merged[i] for i in range(len(plan.disk))]


def check_staged_for(plan: TransferPlan, staged: StagedExperts) -> None:
    """Raise WeightError unless ``staged`` holds exactly ``plan``'s disk experts (not released, same plan)."""
    if staged.released:
        raise WeightError(f"rank {plan.ep_rank}: the staged experts were released; stage the plan again")
    if staged.plan_key != plan.key or len(staged.experts) != len(plan.disk):
        raise WeightError(f"rank {plan.ep_rank}: the staged experts belong to another plan ({staged.plan_key} != {plan.key})")
