"""Public test helpers (as ``structlog.testing``): a numpy weight backend, so that orchestration runs without paddle.

:class:`NumpyWeights` implements :class:`~fdeplb.weights.WeightBackend` with one numpy array per rank,
``[num_layers, slots_per_rank, expert_size]`` float32, where every logical expert ``(layer, expert)`` has its own
deterministic content (:func:`expert_tensor`). Staging copies the experts new to the rank, the swap writes them
into the live array in place (local moves from the rank's own slots, as the paddle backend does) and verifies every
written slot against :func:`expert_tensor`, so a wrong expert in a slot is caught exactly as a checksum mismatch
would be.

Use ``NumpyWeights.factory()`` as a rank agent's ``backend_factory``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from fdeplb.errors import StagingBudgetError, VerificationError, WeightError
from fdeplb.placement.digest import routing_digest
from fdeplb.weights.backend import BackendFactory, layout_of, served_slot
from fdeplb.weights.peer_staging import PeerFetch, PeerResult, fetch_from_peers
from fdeplb.weights.plan import PauseBudget, TransferPlan, plan_transfer, rank_slots
from fdeplb.weights.reports import SlotCheck, StageReport, SwapReport

#: float32 values per expert in :class:`NumpyWeights` (its bytes per expert are 4x this)
EXPERT_SIZE = 64

__all__ = ["EXPERT_SIZE", "NumpyWeights", "expert_tensor"]


@functools.lru_cache(maxsize=1 << 16)
def expert_tensor(layer: int, expert: int, size: int = EXPERT_SIZE) -> np.ndarray:
    """The weights of logical expert ``expert`` of ``layer``: float32 [size], distinct for every (layer, expert).
    Read-only and cached (the same array for the same arguments): copy it to write."""
    rng = np.random.default_rng([int(layer), int(expert)])
    out = rng.standard_normal(size, dtype=np.float32)
    out.flags.writeable = False
    return out


def _crc(arr: np.ndarray) -> tuple[int]:
    """The numpy backend's expert checksum: (CRC-32 of the array's bytes,)."""
    return (zlib.crc32(np.ascontiguousarray(arr).tobytes()),)


@dataclass
class _NumpyStaged:
    transfer: TransferPlan
    experts: dict[tuple[int, int], np.ndarray]
    report: StageReport
    released: bool = field(default=False)
    starts: tuple[int, ...] = ()
    #: the chunk :meth:`NumpyWeights.prepare` moved to the "device" (layers, its staged experts)
    buffer: tuple[tuple[int, ...], dict[tuple[int, int], np.ndarray]] | None = None
    #: experts a peer did not deliver, read from the "checkpoint" (:func:`expert_tensor`) instead
    fallbacks: list = field(default_factory=list)

    def release(self) -> None:
        self.experts.clear()
        self.buffer = None
        self.released = True


class NumpyWeights:
    """:class:`~fdeplb.weights.WeightBackend` over numpy arrays (see the module doc).

    Args:
        phy2log: int [L, P], the placement to load.
        ep_rank, ep_size: the rank; P must be a multiple of ep_size.
        expert_size: float32 values per expert.

    Attributes:
        slots: float32 [L, slots_per_rank, expert_size], the live slots (written in place by :meth:`swap`); None
            while cleared (:meth:`clear`).
        swaps: number of whole swaps applied (:meth:`swap`); chunks_applied: chunks applied (:meth:`swap_layers`).
    """

    def __init__(self, phy2log: np.ndarray, ep_rank: int, ep_size: int, *, expert_size: int = EXPERT_SIZE) -> None:
        self._phy2log = np.array(phy2log, dtype=np.int64)
        self.ep_rank = int(ep_rank)
        self.ep_size = int(ep_size)
        self.expert_size = int(expert_size)
        self._slice = rank_slots(self._phy2log.shape[1], self.ep_rank, self.ep_size)
        per_rank = self._slice.stop - self._slice.start
        self.slots = np.empty((self._phy2log.shape[0], per_rank, self.expert_size), dtype=np.float32)
        self.swaps = 0
        self.live_ranks = tuple(range(self.ep_size))
        self.chunks_applied = 0
        self.reload()

    @classmethod
    def factory(cls, *, expert_size: int = EXPERT_SIZE) -> BackendFactory:
        """A backend factory for rank agents (the checkpoint argument is ignored)."""
        return lambda _checkpoint, phy2log, ep_rank, ep_size: cls(phy2log, ep_rank, ep_size,
                                                                  expert_size=expert_size)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert."""
        return self.expert_size * 4

    @property
    def phy2log(self) -> np.ndarray:
        return self._phy2log.copy()

    @property
    def slots_total(self) -> int:
        return int(self.slots.shape[0] * self.slots.shape[1])

    def _expected(self, phy2log: np.ndarray) -> np.ndarray:
        rank = phy2log[:, self._slice]
        return np.stack([np.stack([expert_tensor(layer, e, self.expert_size) for e in row])
                         for layer, row in enumerate(rank)])

    def reload(self) -> None:
        self.slots[...] = self._expected(self._phy2log)

    @property
    def cleared(self) -> bool:
        return self.slots is None

    def clear(self) -> int:
        """Drop the live array (its memory returns); returns the bytes freed."""
        freed = 0 if self.slots is None else int(self.slots.nbytes)
        self.slots = None
        return freed

    def reload_in(self, phy2log: np.ndarray) -> SlotCheck:
        new = np.array(phy2log, dtype=np.int64, copy=True)
        if new.shape != self._phy2log.shape:
            raise WeightError(f"rank {self.ep_rank}: phy2log has shape {new.shape}, expected {self._phy2log.shape}")
        if self.slots is None:
            self.slots = np.empty((new.shape[0], self._slice.stop - self._slice.start, self.expert_size),
                                  dtype=np.float32)
        self._phy2log = new
        self.reload()
        return self.verify()

    def stage(self, new_phy2log: np.ndarray, budget_bytes: int | None,
              pause: PauseBudget | None = None, peers: PeerFetch | None = None) -> _NumpyStaged:
        transfer = plan_transfer(self._phy2log, new_phy2log, self.ep_rank, self.ep_size)
        starts, buffer_experts = (), 0
        if pause is not None:
            starts, chunks = layout_of(transfer, self._phy2log, new_phy2log, self.expert_nbytes, pause)
            buffer_experts = max((sum(1 for layer, _ in transfer.disk if layer in c) for c in chunks), default=0)
        need = (len(transfer.disk) + buffer_experts) * self.expert_nbytes
        if budget_bytes is not None and need > budget_bytes:
            raise StagingBudgetError(f"rank {self.ep_rank}: staging {len(transfer.disk)} experts (and a device "
                                     f"buffer of {buffer_experts}) needs {need} bytes, over the budget of "
                                     f"{int(budget_bytes)} bytes; nothing was read")
        got = PeerResult() if peers is None else fetch_from_peers(
            transfer.disk, dataclasses.replace(peers, known={key: _crc(expert_tensor(*key, self.expert_size))
                                                             for key in transfer.disk}),
            lambda _l, _e: {"w": np.empty(self.expert_size, np.float32)}, lambda a: memoryview(a).cast("B"),
            lambda views: (zlib.crc32(views["w"]),))
        experts = {key: got.got[k][0]["w"] if k in got.got else expert_tensor(*key, self.expert_size)
                   for k, key in enumerate(transfer.disk)}
        return _NumpyStaged(transfer, experts, StageReport.of(transfer, self.expert_nbytes, len(got.got)),
                            starts=starts, fallbacks=got.fallbacks)

    def serve_expert(self, layer: int, expert: int, placement: str) -> tuple[list[tuple[str, bytes]], tuple[int]]:
        """:meth:`fdeplb.weights.peer.ExpertSource.serve_expert` over the numpy slots (suffix ``"w"``; checksum:
        CRC-32 of :func:`expert_tensor`'s bytes)."""
        slot = served_slot(routing_digest(self._phy2log), self._phy2log[:, self._slice], layer, expert, placement,
                           self.ep_rank)
        return [("w", self.slots[int(layer), slot].tobytes())], _crc(expert_tensor(layer, expert, self.expert_size))

    def set_live_ranks(self, live_ranks: tuple[int, ...]) -> None:
        """Record the ranks routed to (:attr:`live_ranks`; a numpy backend has no routing tables)."""
        self.live_ranks = tuple(int(r) for r in live_ranks)

    def swap(self, staged: _NumpyStaged, new_phy2log: np.ndarray, live_ranks: tuple[int, ...] | None = None
             ) -> SwapReport:
        report = self._write(staged, new_phy2log, range(self._phy2log.shape[0]), staged.experts)
        if live_ranks is not None:
            self.set_live_ranks(live_ranks)
        self.swaps += 1
        return report

    def prepare(self, staged: _NumpyStaged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> None:
        """Copy the chunk's staged experts aside (the numpy stand-in for the device buffer)."""
        if staged.released:
            raise WeightError(f"rank {self.ep_rank}: the staged experts were released; stage the plan again")
        staged.buffer = (tuple(layers), {k: v.copy() for k, v in staged.experts.items() if k[0] in layers})

    def swap_layers(self, staged: _NumpyStaged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> SwapReport:
        if staged.buffer is None or staged.buffer[0] != tuple(layers):
            raise WeightError(f"rank {self.ep_rank}: chunk {tuple(layers)} was not prepared")
        report = self._write(staged, new_phy2log, layers, staged.buffer[1])
        self.chunks_applied += 1
        return report

    def _write(self, staged: _NumpyStaged, new_phy2log: np.ndarray, layers, experts) -> SwapReport:
        """Write ``layers`` of the staged plan from ``experts`` ((layer, expert) -> array), verify every written
        slot (VerificationError: ``layers`` keep the old placement), then switch their phy2log rows."""
        if staged.released:
            raise WeightError(f"rank {self.ep_rank}: the staged experts were released; stage the plan again")
        new = np.asarray(new_phy2log, dtype=np.int64)
        layers = [int(layer) for layer in layers]
        t0 = time.perf_counter()
        old_rank = self._phy2log[:, self._slice]
        new_rank = new[:, self._slice]
        before = self.slots.copy()  # local moves read the old contents (the paddle backend orders its copies)
        bytes_staged = bytes_local = 0
        for layer in layers:
            for s, e in enumerate(new_rank[layer].tolist()):
                if old_rank[layer, s] == e:
                    continue
                held = np.flatnonzero(old_rank[layer] == e)
                if held.size:
                    self.slots[layer, s] = before[layer, int(held[0])]
                    bytes_local += self.expert_nbytes
                else:
                    self.slots[layer, s] = experts[(layer, e)]
                    bytes_staged += self.expert_nbytes
        t1 = time.perf_counter()
        changed = np.zeros_like(old_rank, dtype=bool)
        changed[layers] = old_rank[layers] != new_rank[layers]
        mixed = self._phy2log.copy()
        mixed[layers] = new[layers]
        expected = self._expected(mixed)
        bad = np.argwhere(changed & ~np.all(self.slots == expected, axis=-1))
        if bad.size:
            raise VerificationError(f"rank {self.ep_rank}: {len(bad)} swapped slot(s) differ from their expert: "
                                    f"{bad[:8].tolist()}")
        self._phy2log = mixed
        transfer, counts = staged.transfer, staged.transfer.counts
        return SwapReport(ep_rank=self.ep_rank, plan_key=transfer.key, keep=counts["keep"], local=counts["local"],
                          disk=counts["disk"], disk_slots=transfer.disk_slots, snapshots=0,
                          slots_verified=int(np.count_nonzero(changed)), bytes_from_staging=bytes_staged,
                          bytes_local=bytes_local, bytes_snapshot=0, copy_seconds=t1 - t0,
                          verify_seconds=time.perf_counter() - t1, routing_seconds=0.0)

    def verify(self) -> SlotCheck:
        ok = np.all(self.slots == self._expected(self._phy2log), axis=-1)
        return SlotCheck(int(ok.sum()), int(ok.size))
