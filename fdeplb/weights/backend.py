"""The seam between a rank agent and its expert weights.

A rank agent needs these things of the weights it serves: which placement its live slots hold, to stage the experts
a new placement needs, to swap them in (whole, or in chunks of layers, one per safe point: :meth:`WeightBackend.prepare`
before a chunk's switch step, :meth:`WeightBackend.swap_layers` at it), to verify the slots, to reload them, and to clear them and reload them in a
given placement (the dynamic weight clear / update). :class:`WeightBackend` names those, with the typed records they
return (:class:`~fdeplb.weights.reports.StageReport`, :class:`~fdeplb.weights.reports.SwapReport`,
:class:`~fdeplb.weights.reports.SlotCheck`, in :mod:`fdeplb.weights.reports`);
:class:`CheckpointBackend` implements them with paddle tensors read from a safetensors checkpoint
(:class:`~fdeplb.weights.LiveExperts`), and :class:`fdeplb.testing.NumpyWeights` with numpy arrays, so that the
coordinator, the agent, gating, replay and the kill tests run without paddle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from fdeplb.errors import CheckpointError, PeerTransferError
from fdeplb.placement.digest import routing_digest
from fdeplb.weights.peer_staging import PeerFetch
from fdeplb.weights.plan import PauseBudget, TransferPlan, changed_layers, chunk_layers, chunk_starts, plan_transfer
from fdeplb.weights.reports import SlotCheck, StageReport, SwapReport


class Staged(Protocol):
    """A staged plan held by a backend until it is swapped in or released."""

    report: StageReport
    fallbacks: list
    """Experts a peer did not deliver, read from the checkpoint instead
    (:class:`~fdeplb.weights.peer_staging.Fallback`; the agent audits them)."""
    starts: tuple[int, ...]
    """This rank's chunk layout of the swap within the pause budget it was staged for (the first layer of each
    chunk, :func:`~fdeplb.weights.plan.chunk_starts`); () when staged for a swap at once."""

    def release(self) -> None:
        """Free the staging memory (idempotent)."""


@runtime_checkable
class WeightBackend(Protocol):
    """The live expert slots of one EP rank, as the rank agent drives them.

    Every method may raise :class:`~fdeplb.errors.WeightError` (a subclass says which: staging over budget, a
    checkpoint problem, a failed verification); the agent turns it into a rank transition or an alarm.
    """

    @property
    def phy2log(self) -> np.ndarray:
        """int64 [L, P]: the cluster placement the live slots hold (a copy)."""

    @property
    def slots_total(self) -> int:
        """Slots of the rank: num_layers x slots per rank."""

    def stage(self, new_phy2log: np.ndarray, budget_bytes: int | None, pause: PauseBudget | None = None,
              peers: PeerFetch | None = None) -> Staged:
        """Read what ``new_phy2log`` needs on this rank into staging memory (StagingBudgetError, checked before any
        read, when it needs more than ``budget_bytes``). With ``pause``, the swap is applied in chunks of layers
        within it (``Staged.starts``) and a device buffer for the largest chunk is allocated too, counted in the
        same budget. With ``peers``, experts a peer holds live are taken from it (``Staged.fallbacks``: those
        read from the checkpoint instead)."""

    def swap(self, staged: Staged, new_phy2log: np.ndarray, live_ranks: tuple[int, ...] | None = None
             ) -> SwapReport:
        """Write the staged plan into the live slots in place and switch the routing tables to ``new_phy2log``
        over ``live_ranks``' slots (None: the ranks routed to so far); every written slot is verified
        (VerificationError). Returns what the swap did (:class:`SwapReport`)."""

    def set_live_ranks(self, live_ranks: tuple[int, ...]) -> None:
        """Route only to ``live_ranks`` (the members the current placement was committed for): log2phy / logcnt
        name no slot of another rank. RedundancyError when an expert would have no live replica."""

    def prepare(self, staged: Staged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> None:
        """Before a chunk's switch step: move the staged experts (and new routing rows) of ``layers`` to the
        device, replacing the previous chunk's (staged with a ``pause``; WeightError otherwise)."""

    def swap_layers(self, staged: Staged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> SwapReport:
        """At a chunk's switch step: write the prepared chunk ``layers`` into the live slots, check every written
        slot on the device (VerificationError: those layers' routing stays old), then switch those layers'
        routing rows to ``new_phy2log``'s. Returns what the chunk did."""

    def verify(self) -> SlotCheck:
        """(slots holding exactly their logical expert's weights, slots in total)."""

    def reload(self) -> None:
        """Rewrite every slot of the current placement from the source of truth (repair after a failed swap)."""

    @property
    def cleared(self) -> bool:
        """True while the slots are freed (:meth:`clear`) and not reloaded."""

    def clear(self) -> int:
        """Free the live slots' memory (FastDeploy's ``clear_load_weight``); returns the bytes freed."""

    def reload_in(self, phy2log: np.ndarray) -> SlotCheck:
        """Reload every slot from the source of truth for placement ``phy2log`` (int64 [L, P], the cluster's
        current one: vLLM PR #55228), re-allocating cleared slots, switch the routing tables to it and verify every
        slot; returns the verification (:class:`SlotCheck`). Raises WeightError subclasses when it cannot."""


def served_slot(live_digest: str, rank_phy2log: np.ndarray, layer: int, expert: int, placement: str,
                ep_rank: int) -> int:
    """The first rank-local slot holding ``expert`` in ``layer`` of the live placement (``live_digest``: its
    :func:`~fdeplb.placement.digest.routing_digest`; ``rank_phy2log``: int64 [L, S], its columns of this rank),
    which must be the one named ``placement``; the refusals of
    :meth:`fdeplb.weights.peer.ExpertSource.serve_expert` (PeerTransferError) otherwise."""
    if live_digest != placement:
        raise PeerTransferError(f"rank {ep_rank} holds placement {live_digest} live, the request names {placement}")
    if not 0 <= int(layer) < rank_phy2log.shape[0]:
        raise PeerTransferError(f"rank {ep_rank}: layer {layer} outside [0, {rank_phy2log.shape[0]})")
    held = np.flatnonzero(rank_phy2log[int(layer)] == int(expert))
    if not held.size:
        raise PeerTransferError(f"rank {ep_rank} holds no live slot of expert {expert} in layer {layer}")
    return int(held[0])


#: builds a rank's backend: (checkpoint {"path", "preset"}, placement int64 [L, P], ep_rank, ep_size) -> backend
BackendFactory = Callable[[dict, np.ndarray, int, int], WeightBackend]


def layout_of(transfer: TransferPlan, old_phy2log: np.ndarray, new_phy2log: np.ndarray, expert_nbytes: int,
              pause: PauseBudget) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(chunk starts, chunks) of ``transfer`` within ``pause``: a backend's layout of a chunked swap."""
    changed = changed_layers(old_phy2log, new_phy2log)
    starts = chunk_starts(changed, transfer.layer_nbytes(expert_nbytes), pause)
    return starts, chunk_layers(starts, changed)


@dataclass
class _CheckpointStaged:
    transfer: TransferPlan
    experts: Any  # StagedExperts
    report: StageReport
    starts: tuple[int, ...] = ()

    @property
    def fallbacks(self) -> list:
        return self.experts.fallbacks

    def release(self) -> None:
        self.experts.release()


class CheckpointBackend:
    """:class:`WeightBackend` over paddle tensors loaded from a safetensors checkpoint (the ``[paddle]`` extra).

    Build with :meth:`open` (loads the rank's slots from the checkpoint) or wrap an engine's own
    :class:`~fdeplb.weights.LiveExperts` (``LiveExperts.attach``) and its :class:`~fdeplb.weights.CheckpointReader`;
    :meth:`factory` and :meth:`attached` give the matching :data:`BackendFactory` for a rank agent.
    """

    def __init__(self, live: Any, reader: Any, *, device: str | None = None) -> None:
        self.live = live
        self.reader = reader
        self.device = device
        self._served: tuple[int, str, Any] = (-1, "", None)  # (epoch, its placement's digest, its rank columns)

    @classmethod
    def open(cls, checkpoint: dict, phy2log: np.ndarray, ep_rank: int, ep_size: int, *,
             device: str | None = None) -> "CheckpointBackend":
        """Load ``ep_rank``'s slots of ``phy2log`` from ``checkpoint`` (``{"path": ..., "preset": ...}``) onto
        ``device``. Raises CheckpointError (no path, missing tensors), DependencyError (paddle not installed)."""
        from fdeplb.weights.checkpoint import CheckpointReader
        from fdeplb.weights.live import LiveExperts

        if not checkpoint.get("path"):
            raise CheckpointError("the cluster has no checkpoint path: a CheckpointBackend needs one")
        reader = CheckpointReader(checkpoint["path"], preset=checkpoint.get("preset", "ernie"))
        live = LiveExperts.from_checkpoint(reader, phy2log, ep_rank, ep_size, device=device)
        return cls(live, reader, device=device)

    @classmethod
    def factory(cls, *, device: str | None = None) -> BackendFactory:
        """A :data:`BackendFactory` that opens checkpoint backends on ``device``."""
        return lambda checkpoint, phy2log, ep_rank, ep_size: cls.open(checkpoint, phy2log, ep_rank, ep_size,
                                                                     device=device)

    @classmethod
    def attached(cls, tensors: dict[str, list[Any]], device: str | None = None) -> BackendFactory:
        """A :data:`BackendFactory` that wraps the engine's own live expert tensors (``suffix -> [tensor per MoE
        layer, each [slots_per_rank, *shape]]``: :meth:`fdeplb.weights.LiveExperts.attach`, verified against the
        checkpoint, never copied) instead of allocating new ones. The factory raises CheckpointError when the
        cluster has no checkpoint path, InputError for suffixes, shapes or dtypes unlike the checkpoint's (any key
        order is taken), VerificationError when a slot does not hold its expert."""

        def build(checkpoint: dict, phy2log: np.ndarray, ep_rank: int, ep_size: int) -> "CheckpointBackend":
            from fdeplb.weights.checkpoint import CheckpointReader
            from fdeplb.weights.live import LiveExperts

            if not checkpoint.get("path"):
                raise CheckpointError("the cluster has no checkpoint path: attached tensors are verified against it")
            reader = CheckpointReader(checkpoint["path"], preset=checkpoint.get("preset", "ernie"))
            live = LiveExperts.attach(tensors, phy2log, ep_rank, ep_size, reader, device=device)
            return cls(live, reader, device=device)

        return build

    @property
    def phy2log(self) -> np.ndarray:
        return self.live.phy2log

    @property
    def slots_total(self) -> int:
        return self.live.slots_per_rank * self.live.num_layers

    def stage(self, new_phy2log: np.ndarray, budget_bytes: int | None,
              pause: PauseBudget | None = None, peers: PeerFetch | None = None) -> _CheckpointStaged:
        from fdeplb.weights.staging import stage_experts

        old = self.live.phy2log
        transfer = plan_transfer(old, new_phy2log, self.live.ep_rank, self.live.ep_size)
        starts, buffer_experts = (), 0
        if pause is not None:
            starts, chunks = layout_of(transfer, old, new_phy2log, self.reader.expert_nbytes, pause)
            buffer_experts = max((sum(1 for layer, _ in transfer.disk if layer in set(c)) for c in chunks), default=0)
        if peers is not None:
            peers = dataclasses.replace(peers, known={**peers.known, **{
                key: c for key in transfer.disk if (c := self.live.checksum(*key)) is not None}})
        experts = stage_experts(transfer, self.reader, budget_bytes=budget_bytes, device=self.device,
                                buffer_experts=buffer_experts, peers=peers)
        report = StageReport.of(transfer, self.reader.expert_nbytes, experts.from_peers)
        return _CheckpointStaged(transfer, experts, report, starts)

    def serve_expert(self, layer: int, expert: int, placement: str) -> tuple[list[tuple[str, Any]], tuple[int, ...]]:
        """:meth:`fdeplb.weights.peer.ExpertSource.serve_expert` over the live slots: the first slot of this rank
        holding ``expert`` in ``layer``, with its checkpoint checksum. Host slots are sent from their memory
        without a copy, device slots through a host copy; the epoch of the live experts must not move meanwhile
        (it does not in LOADING: slots change only at a committed swap), and the receiver checks the bytes against
        the checkpoint's checksum whatever happens. PeerTransferError when the live placement is not
        ``placement`` (routing digest), the rank holds no slot of that expert, its checksum is not known, or the
        slots changed while it was being read."""
        from fdeplb.weights import _paddle

        live = self.live
        epoch = live.epoch
        if self._served[0] != epoch:  # the live placement's digest, once per epoch
            self._served = (epoch, routing_digest(live.phy2log), live.rank_phy2log)
        slot = served_slot(self._served[1], self._served[2], layer, expert, placement, live.ep_rank)
        checksum = live.checksum(layer, expert)
        if checksum is None:
            raise PeerTransferError(f"rank {live.ep_rank}: no checkpoint checksum of expert {expert} of layer "
                                    f"{layer} (slots not verified)")
        parts = [(suffix, _paddle.host_view(t)) for suffix, t in live.slot(layer, slot).items()]
        if live.epoch != epoch:
            raise PeerTransferError(f"rank {live.ep_rank}: live slots changed while serving expert {expert} of "
                                    f"layer {layer}")
        return parts, checksum

    def serving(self, abort: Callable[[], None]) -> Any:
        """:meth:`fdeplb.weights.peer.ExpertSource.serving`: :meth:`fdeplb.weights.LiveExperts.serving`."""
        return self.live.serving(abort)

    def swap(self, staged: _CheckpointStaged, new_phy2log: np.ndarray, live_ranks: tuple[int, ...] | None = None
             ) -> SwapReport:
        report = self.live.swap(staged.transfer, staged.experts, new_phy2log, live_ranks)
        staged.experts.release(keep_buffers=True)  # next round's staging reuses the pre-faulted buffers
        return report

    def set_live_ranks(self, live_ranks: tuple[int, ...]) -> None:
        self.live.set_live_ranks(live_ranks)

    def prepare(self, staged: _CheckpointStaged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> None:
        self.live.load_chunk(staged.transfer, staged.experts, new_phy2log, layers)

    def swap_layers(self, staged: _CheckpointStaged, new_phy2log: np.ndarray, layers: tuple[int, ...]) -> SwapReport:
        return self.live.swap_layers(staged.transfer, staged.experts, new_phy2log, layers)

    def verify(self) -> SlotCheck:
        return SlotCheck(*self.live.verify(self.reader))

    def reload(self) -> None:
        self.live.reload(self.reader)

    @property
    def cleared(self) -> bool:
        return self.live.cleared

    def clear(self) -> int:
        return self.live.clear()

    def reload_in(self, phy2log: np.ndarray) -> SlotCheck:
        self.live.reload_in(self.reader, phy2log)
        return self.verify()
