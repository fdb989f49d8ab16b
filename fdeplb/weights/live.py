"""The expert slots of one EP rank as live paddle tensors, swapped in place and verified.

``tensors[suffix][layer]`` is one tensor ``[slots_per_rank, *shape]`` per MoE layer and expert tensor suffix, the
layout of a fused-MoE layer's stacked expert parameters. A swap writes into those tensors (their storage never
changes, so CUDA graphs and every reference the serving engine holds stay valid), then updates the routing tables
``phy2log`` / ``log2phy`` / ``logcnt`` (paddle int64 tensors on the same device, also updated in place).

This module owns the slot storage (the live tensors, reload, clear, verify) and the whole swap (:meth:`LiveExperts.swap`,
from host staging, every written slot checksummed); :class:`LiveExperts` is also the face of the two other parts of a
rank's live state: the routing tables (:mod:`fdeplb.weights.routing`) and the chunked swap, one chunk of layers per
safe point (:mod:`fdeplb.weights.chunk_swap`, as :meth:`LiveExperts.load_chunk` / :meth:`LiveExperts.swap_layers`).
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from fdeplb.errors import InputError, PeerTransferError, VerificationError, WeightError
from fdeplb.weights import _paddle, chunk_swap
from fdeplb.weights.checkpoint import CheckpointReader
from fdeplb.weights.plan import LOCAL, TransferPlan, rank_slots
from fdeplb.weights.reports import SwapReport
from fdeplb.weights.routing import RoutingTables
from fdeplb.weights.staging import ExpertChecksum, StagedExperts, check_staged_for, expert_checksum

#: longest :meth:`LiveExperts.clear` waits for the peer sends it cut short to let go of the slots' memory (seconds)
SERVING_WAIT_S = 30.0


class LiveExperts:
    """The expert slots of one EP rank (live paddle tensors) and its routing tables.

    Build with :meth:`from_checkpoint`, or wrap tensors the serving engine already holds with :meth:`attach`.

    Args:
        tensors: ``suffix -> one tensor per MoE layer``, each ``[slots_per_rank, *shape]`` on ``device``.
        phy2log: int [L, P], the cluster placement these slots hold (this rank's columns).
        ep_rank, ep_size: the rank; ``P`` must be a multiple of ``ep_size``.
        device: where ``tensors`` live (``None``: paddle's current device); routing tables go there too.
        num_logical_experts: E (default ``phy2log.max() + 1``).
        max_replicas: width of ``log2phy`` (default ``P - E + 1``, the most any placement can need), fixed so the
            routing tensors are updated in place.
        checksums: ``(layer, expert) -> ExpertChecksum`` known to match the checkpoint (else :meth:`verify` first).

    Raises:
        InputError / TopologyError: tensors of the wrong count or leading size, a malformed ``phy2log``.

    Attributes:
        tensors: ``suffix -> [paddle.Tensor per MoE layer, each [slots_per_rank, *shape]]``.
        ep_rank, ep_size, device, num_logical_experts, max_replicas.
        phy2log_tensor: int64 [L, P]; log2phy: int64 [L, E, max_replicas] (-1 padded); logcnt: int64 [L, E].
        routing: the :class:`~fdeplb.weights.routing.RoutingTables` that own those three tensors.
        needs_reload: True after a failed verification: the slots no longer match the routing tables.
    """

    def __init__(
        self,
        tensors: dict[str, list[Any]],
        phy2log: np.ndarray,
        ep_rank: int,
        ep_size: int,
        *,
        device: str | None = None,
        num_logical_experts: int | None = None,
        max_replicas: int | None = None,
        checksums: dict[tuple[int, int], ExpertChecksum] | None = None,
    ) -> None:
        p2l = np.array(phy2log, dtype=np.int64, copy=True)
        if p2l.ndim != 2:
            raise InputError(f"phy2log must be [num_layers, num_physical_experts], got shape {p2l.shape}")
        self.ep_rank, self.ep_size = int(ep_rank), int(ep_size)
        self._slots = rank_slots(p2l.shape[1], self.ep_rank, self.ep_size)
        per_rank = self._slots.stop - self._slots.start
        if not tensors:
            raise InputError("LiveExperts needs at least one expert tensor suffix")
        for suffix, layers in tensors.items():
            if len(layers) != p2l.shape[0] or any(int(t.shape[0]) != per_rank for t in layers):
                raise InputError(
                    f"live tensors of {suffix!r} must be {p2l.shape[0]} tensors of [{per_rank}, ...] (one per MoE layer)"
                )
        self.tensors = tensors
        # one view per slot, made once: a swap then costs one copy call per slot and suffix, no indexing
        self._views = [
            [{suffix: layers[layer][s] for suffix, layers in tensors.items()} for s in range(per_rank)]
            for layer in range(p2l.shape[0])
        ]
        self.device = _paddle.resolve_device(device)
        self.num_logical_experts = int(p2l.max()) + 1 if num_logical_experts is None else int(num_logical_experts)
        num_phy = p2l.shape[1]
        self.max_replicas = num_phy - self.num_logical_experts + 1 if max_replicas is None else int(max_replicas)
        self._live: np.ndarray | None = None  # bool [ep_size]: the ranks routed to (None: every rank)
        self._phy2log = p2l
        self.routing = RoutingTables(p2l, self.num_logical_experts, self.max_replicas, self.device)
        self.phy2log_tensor, self.log2phy, self.logcnt = self.routing.phy2log, self.routing.log2phy, self.routing.logcnt
        self._checksums: dict[tuple[int, int], ExpertChecksum] = dict(checksums or {})
        self.needs_reload = False
        self._epoch = 0  # moved by every change of the slots, the placement or the routed ranks (see epoch)
        self._serve_cond = threading.Condition()  # the peer sends reading the slots' memory (see serving)
        self._serving: dict[int, Callable[[], None]] = {}
        self._serve_ids = itertools.count()

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        reader: CheckpointReader,
        phy2log: np.ndarray,
        ep_rank: int,
        ep_size: int,
        device: str | None = None,
        *,
        num_logical_experts: int | None = None,
        max_replicas: int | None = None,
    ) -> LiveExperts:
        """Allocate this rank's slot tensors on ``device`` and load them from the checkpoint.

        Each distinct (layer, expert) of the rank is read once and written into every slot that holds it; host memory
        peaks at one expert. Every slot is verified by checksum.

        Raises:
            CheckpointError: a tensor missing or malformed (all names are checked before any read).
            InputError / TopologyError: a malformed ``phy2log`` or rank.
            VerificationError: a slot does not match the checkpoint after loading.
        """
        dev = _paddle.resolve_device(device)
        p2l = np.asarray(phy2log, dtype=np.int64)
        sl = rank_slots(p2l.shape[1], ep_rank, ep_size)
        per_rank = sl.stop - sl.start
        reader.check_expert(0, int(p2l[0, sl.start]))  # shapes and dtypes from an expert this rank holds
        tensors = {
            suffix: [_paddle.empty([per_rank, *shape], dtype, dev) for _ in range(p2l.shape[0])]
            for suffix, (shape, dtype) in reader.spec.items()
        }
        live = cls(tensors, p2l, ep_rank, ep_size, device=dev, num_logical_experts=num_logical_experts,
                   max_replicas=max_replicas)
        live.reload(reader)
        return live

    @classmethod
    def attach(
        cls,
        tensors: dict[str, list[Any]],
        phy2log: np.ndarray,
        ep_rank: int,
        ep_size: int,
        reader: CheckpointReader,
        **kwargs: Any,
    ) -> LiveExperts:
        """Wrap slot tensors the serving engine already loaded, verifying each slot against the checkpoint (which
        also records the checksums later local copies are verified against).

        ``tensors`` may name its suffixes in any order: they are taken in the checkpoint's (the order every
        checksum, swap and peer transfer compares them in); the tensor objects are the engine's.

        Raises:
            InputError: ``tensors`` names other suffixes than the checkpoint's experts, or a slot of another shape
                or dtype than the checkpoint's expert (nothing could verify).
            VerificationError: a slot does not hold its expert's checkpoint bytes.
        """
        spec = reader.spec
        if set(tensors) != set(spec):
            raise InputError(f"live tensors have suffixes {sorted(tensors)}, the checkpoint's experts {sorted(spec)}")
        tensors = {suffix: tensors[suffix] for suffix in spec}
        for suffix, (shape, dtype) in spec.items():
            for t in tensors[suffix]:  # metadata only
                if list(t.shape[1:]) != list(shape) or _paddle.dtype_name(t) != dtype:
                    raise InputError(f"live {suffix!r} slots are {_paddle.dtype_name(t)}{list(t.shape[1:])}, the "
                                     f"checkpoint's {dtype}{list(shape)}")
        live = cls(tensors, phy2log, ep_rank, ep_size, **kwargs)
        ok, total = live.verify(reader)
        if ok != total:
            raise VerificationError(f"rank {live.ep_rank}: {total - ok} of {total} live slots differ from the checkpoint")
        return live

    # ---- views ----------------------------------------------------------------------------------------------------
    @property
    def phy2log(self) -> np.ndarray:
        """int64 [L, P]: the cluster placement this rank serves (a copy)."""
        return self._phy2log.copy()

    @property
    def rank_phy2log(self) -> np.ndarray:
        """int64 [L, slots_per_rank]: the logical expert of each of this rank's slots."""
        return self._phy2log[:, self._slots].copy()

    @property
    def epoch(self) -> int:
        """A counter moved by every change of the live slots, the placement or the routed ranks (a reload, a clear,
        a swap, a chunk applied, :meth:`set_live_ranks`): a chunk loaded at one epoch (:meth:`load_chunk`) is
        applied only at that epoch."""
        return self._epoch

    @property
    def num_layers(self) -> int:
        return int(self._phy2log.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return self._slots.stop - self._slots.start

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one slot (all suffixes)."""
        return sum(_paddle.nbytes(layers[0][0]) for layers in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every live slot tensor of the rank."""
        return self.expert_nbytes * self.slots_per_rank * self.num_layers

    def slot(self, layer: int, slot: int) -> dict[str, Any]:
        """``suffix -> view`` of one rank-local slot (writes through to the live tensors)."""
        return dict(self._views[layer][slot])

    def checksum(self, layer: int, expert: int) -> ExpertChecksum | None:
        """The checkpoint checksum of ``(layer, expert)`` these slots were verified with (None: not known)."""
        return self._checksums.get((int(layer), int(expert)))


    # ---- members ---------------------------------------------------------------------------------------------------
    @property
    def live_ranks(self) -> tuple[int, ...]:
        """The EP ranks ``log2phy`` / ``logcnt`` route to (every rank until :meth:`set_live_ranks`)."""
        return tuple(range(self.ep_size)) if self._live is None else tuple(np.flatnonzero(self._live).tolist())

    def set_live_ranks(self, live_ranks: Any) -> None:
        """Route only to ``live_ranks`` (ep_rank ints or a bool mask of ``ep_size``, see
        :func:`fdeplb.placement.check_live_ranks`): log2phy / logcnt are rewritten in place over their slots.
        Raises InputError for a bad mask and RedundancyError when an expert would have no live replica; the
        tables are unchanged then. Call it at a safe point (the embedded agent does, with the swap)."""
        from fdeplb.placement.live_ranks import check_live_ranks

        mask = check_live_ranks(live_ranks, self.ep_size)
        self._epoch += 1
        self.routing.write(self._phy2log, mask)
        self._live = None if mask.all() else mask

    # ---- loading and verification ---------------------------------------------------------------------------------
    def reload(self, reader: CheckpointReader) -> int:
        """Rewrite every slot in place from the checkpoint for the current placement (initial load, or repair after
        a failed verification); each distinct (layer, expert) is read once. Returns the number of slots written.

        Raises:
            CheckpointError: a tensor missing or malformed (checked for all experts before any write).
            VerificationError: a slot does not match the checkpoint after the write.
        """
        rank = self._phy2log[:, self._slots]
        wanted = sorted({(layer, int(e)) for layer in range(self.num_layers) for e in rank[layer]})
        for layer, expert in wanted:
            reader.check_expert(layer, expert)
        self._epoch += 1
        self.needs_reload = True
        for layer, expert in wanted:
            tensors = reader.read_expert(layer, expert)
            self._checksums[(layer, expert)] = expert_checksum(tensors)
            for s in np.flatnonzero(rank[layer] == expert):
                for suffix, t in tensors.items():
                    _paddle.copy_into(self._views[layer][int(s)][suffix], t)
            _paddle.synchronize(self.device)  # the host tensors are dropped next: no copy may still read them
        bad = self._mismatches(np.ones(rank.shape, dtype=bool), rank, lambda layer, e: self._checksums[(layer, e)])
        if bad:
            raise VerificationError(f"rank {self.ep_rank}: reload left {len(bad)} slot(s) unlike the checkpoint: {bad[:8]}")
        self.needs_reload = False
        return int(rank.size)

    # ---- dynamic weight clear / update (FastDeploy's clear_load_weight / update_model_weight) -----------------------
    @property
    def cleared(self) -> bool:
        """True after :meth:`clear` until :meth:`reload_in` restores the slots."""
        return getattr(self, "_cleared", False)

    def clear(self) -> int:
        """Free the storage of every live slot tensor (paddle ``_clear_data``: the memory returns to the allocator);
        the tensor objects the engine holds stay, without storage, until :meth:`reload_in`. Returns the bytes
        freed (0 when already cleared). Peer sends reading the slots (:meth:`serving`) are cut short first and
        waited for (WeightError, nothing cleared, if one has not let go within :data:`SERVING_WAIT_S`)."""
        if self.cleared:
            return 0
        with self._serve_cond:  # no peer send reads the memory freed here (see serving)
            for abort in list(self._serving.values()):
                abort()
            if not self._serve_cond.wait_for(lambda: not self._serving, SERVING_WAIT_S):
                raise WeightError(f"rank {self.ep_rank}: a peer transfer still reads the live slots after "
                                  f"{SERVING_WAIT_S} s; nothing cleared")
            freed = self.nbytes
            self._views = []
            for layers in self.tensors.values():
                for t in layers:
                    t._clear_data()
            self._checksums.clear()
            self._cleared = True
            self._epoch += 1
            self.needs_reload = True
        return freed

    @contextmanager
    def serving(self, abort: Callable[[], None]) -> Iterator[None]:
        """Keep the slots' memory allocated while bytes served from it are sent to a peer (host slots are sent from
        their own memory, without a copy): :meth:`clear` calls ``abort`` (it must end the send soon: shut its
        socket down) and frees the memory only once every such block has ended (it read freed memory before).

        Raises:
            PeerTransferError: the slots are cleared (nothing to serve).
        """
        with self._serve_cond:
            if self.cleared:
                raise PeerTransferError(f"rank {self.ep_rank}: the live slots are cleared")
            token = next(self._serve_ids)
            self._serving[token] = abort
        try:
            yield
        finally:
            with self._serve_cond:
                del self._serving[token]
                self._serve_cond.notify_all()

    def reload_in(self, reader: CheckpointReader, phy2log: np.ndarray) -> int:
        """Reload every slot from the checkpoint for placement ``phy2log`` (int [L, P]; the cluster's *current*
        placement, not the initial one: vLLM PR #55228), re-allocating storage into the same tensor objects when
        :meth:`clear` freed it, and switch the routing tables to ``phy2log``. Returns the slots written.

        Raises InputError (``phy2log`` of another shape), CheckpointError, VerificationError (as :meth:`reload`).
        """
        new = np.array(phy2log, dtype=np.int64, copy=True)
        if new.shape != self._phy2log.shape:
            raise InputError(f"phy2log has shape {new.shape}, the live placement {self._phy2log.shape}")
        log2phy, logcnt = self.routing.of(new, self._live)
        self._epoch += 1
        if self.cleared:
            for suffix, layers in self.tensors.items():
                shape, dtype = reader.spec[suffix]
                for t in layers:
                    _paddle.empty([self.slots_per_rank, *shape], dtype, self.device)._share_buffer_to(t)
            self._views = [
                [{suffix: layers[layer][s] for suffix, layers in self.tensors.items()} for s in range(self.slots_per_rank)]
                for layer in range(self.num_layers)
            ]
            self._cleared = False
        self._phy2log = new
        self.routing.write_tables(new, log2phy, logcnt)
        return self.reload(reader)

    def verify(self, reader: CheckpointReader) -> tuple[int, int]:
        """Compare every slot of the rank with its logical expert's checkpoint tensors (CRC-32 of the raw bytes).

        Reads each distinct (layer, expert) of the rank once and records its checksum. Returns
        ``(slots_verified, slots_total)``; fewer verified than total means corrupted slots.

        Raises:
            CheckpointError: a tensor missing or malformed.
        """
        rank = self._phy2log[:, self._slots]
        for layer in range(self.num_layers):
            for e in np.unique(rank[layer]).tolist():
                self._checksums[(layer, e)] = expert_checksum(reader.read_expert(layer, e))
        bad = self._mismatches(np.ones(rank.shape, dtype=bool), rank, lambda layer, e: self._checksums[(layer, e)])
        return int(rank.size) - len(bad), int(rank.size)

    def _mismatches(self, mask: np.ndarray, rank: np.ndarray, expected: Any) -> list[tuple[int, int, int]]:
        """``(layer, slot, expert)`` of every masked slot whose checksum differs from ``expected(layer, expert)``."""
        bad = []
        for layer, s in zip(*np.nonzero(mask)):
            layer, s = int(layer), int(s)
            e = int(rank[layer, s])
            if expert_checksum(self.slot(layer, s)) != expected(layer, e):
                bad.append((layer, s, e))
        return bad

    # ---- swap -----------------------------------------------------------------------------------------------------
    def _check_swap(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                    layers: list[int] | None = None) -> np.ndarray:
        if self.needs_reload:
            raise WeightError(f"rank {self.ep_rank}: live slots failed verification; reload() before swapping")
        if (plan.ep_rank, plan.ep_size) != (self.ep_rank, self.ep_size):
            raise InputError(f"plan is for rank {plan.ep_rank}/{plan.ep_size}, these experts are rank {self.ep_rank}/{self.ep_size}")
        new = np.asarray(new_phy2log, dtype=np.int64)
        if new.shape != self._phy2log.shape:
            raise InputError(f"new_phy2log has shape {new.shape}, the live placement {self._phy2log.shape}")
        rows = slice(None) if layers is None else layers
        if not np.array_equal(plan.old[rows], self._phy2log[rows, self._slots]):
            raise InputError(f"rank {self.ep_rank}: the plan starts from another placement than the live one")
        if not np.array_equal(plan.new[rows], new[rows, self._slots]):
            raise InputError(f"rank {self.ep_rank}: new_phy2log does not match the plan's target for this rank")
        check_staged_for(plan, staged)
        if layers is None:
            self._check_staged_shapes(plan, staged.experts)
        return new

    def _check_local_checksums(self, plan: TransferPlan, known: Any, layers: set[int] | None = None) -> None:
        """VerificationError unless every expert ``plan`` copies locally (in ``layers``; None: all) has a checkpoint
        checksum among ``known`` (tensors wrapped without verify() have none to check local copies against: the
        swap then writes nothing)."""
        missing = {(int(layer), int(plan.new[layer, s])) for layer, s in zip(*np.nonzero(plan.action == LOCAL))
                   if layers is None or int(layer) in layers} - known
        if missing:
            raise VerificationError(
                f"rank {self.ep_rank}: no checkpoint checksum for locally copied experts {sorted(missing)[:8]}; "
                "verify(reader) the live slots first"
            )

    def _check_staged_shapes(self, plan: TransferPlan, experts: Any, indices: Any = None) -> None:
        """WeightError unless every staged expert (``experts[k]`` for index ``indices[k]`` into ``plan.disk``; all
        when ``indices`` is None) has each live suffix in the slots' shape and dtype."""
        slots = {suffix: self._views[0][0][suffix] for suffix in self.tensors}
        want = {suffix: (list(v.shape), v.dtype) for suffix, v in slots.items()}
        for k, tensors in enumerate(experts):
            for suffix, (shape, dtype) in want.items():
                t = tensors.get(suffix)
                if t is None or list(t.shape) != shape or t.dtype != dtype:
                    got = "missing" if t is None else f"{_paddle.dtype_name(t)}{list(t.shape)}"
                    i = k if indices is None else indices[k]
                    raise WeightError(
                        f"rank {self.ep_rank}: staged expert {plan.disk[i]} {suffix!r} is {got}, "
                        f"slots are {_paddle.dtype_name(slots[suffix])}{shape}"
                    )

    def swap(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
             live_ranks: Any = None) -> SwapReport:
        """Apply ``plan``: write staged and locally copied experts into the live slots in place, verify every
        changed slot against the checkpoint checksums, then update the routing tables in place (over
        ``live_ranks``' slots when given, see :meth:`set_live_ranks`; else over the ranks routed to so far).

        Every check (plan matches the live placement and ``new_phy2log``, staging matches the plan, shapes and
        dtypes, the new routing tables) runs before the first write. ``staged`` is left as is (call
        ``staged.release()`` after).

        Raises:
            InputError: plan / placement mismatch or an invalid ``new_phy2log``; nothing written.
            WeightError: staging released, of another plan, or of the wrong shape; nothing written.
            VerificationError (before writing): a locally copied expert has no recorded checkpoint checksum.
            VerificationError: a changed slot differs from its checkpoint checksum after the writes. The routing
                tables keep the old placement and :attr:`needs_reload` is set: the rank must :meth:`reload`.
        """
        new = self._check_swap(plan, staged, new_phy2log)
        from fdeplb.placement.live_ranks import check_live_ranks

        live = self._live if live_ranks is None else check_live_ranks(live_ranks, self.ep_size)
        log2phy, logcnt = self.routing.of(new, live)
        expected: dict[tuple[int, int], ExpertChecksum] = dict(self._checksums)
        expected.update(zip(plan.disk, staged.checksums))
        self._check_local_checksums(plan, expected.keys())
        per_slot = self.expert_nbytes

        start = time.perf_counter()
        self._epoch += 1
        self.needs_reload = True
        snapshots: dict[tuple[int, int], dict[str, Any]] = {}
        layer_of_snapshots = -1
        for step in plan.steps:
            if step.layer != layer_of_snapshots:
                snapshots.clear()
                layer_of_snapshots = step.layer
            dst = self._views[step.layer][step.slot]
            if step.kind == "snapshot":
                snapshots[(step.layer, step.slot)] = {s: _paddle.clone(t) for s, t in dst.items()}
                continue
            if step.kind == "disk":
                src = staged.experts[step.source]
            elif step.kind == "local":
                src = self._views[step.layer][step.source]
            else:
                src = snapshots[(step.layer, step.source)]
            for suffix, t in dst.items():
                _paddle.copy_into(t, src[suffix])
        snapshots.clear()
        _paddle.synchronize(self.device)
        copy_seconds = time.perf_counter() - start

        start = time.perf_counter()
        bad = self._mismatches(plan.changed, plan.new, lambda layer, e: expected[(layer, e)])
        verify_seconds = time.perf_counter() - start
        if bad:
            raise VerificationError(
                f"rank {self.ep_rank}: {len(bad)} swapped slot(s) differ from the checkpoint (layer, slot, expert): "
                f"{bad[:8]}; routing tables keep the old placement, reload() the rank"
            )

        start = time.perf_counter()
        self._phy2log = new.copy()
        self.routing.write_tables(new, log2phy, logcnt)
        self._checksums = expected
        self._live = None if live is None or live.all() else live
        self.needs_reload = False
        routing_seconds = time.perf_counter() - start

        counts = plan.counts
        return SwapReport(
            ep_rank=self.ep_rank,
            plan_key=plan.key,
            keep=counts["keep"],
            local=counts["local"],
            disk=counts["disk"],
            disk_slots=plan.disk_slots,
            snapshots=plan.num_snapshots,
            slots_verified=int(np.count_nonzero(plan.changed)),
            bytes_from_staging=plan.disk_slots * per_slot,
            bytes_local=counts["local"] * per_slot,
            bytes_snapshot=plan.num_snapshots * per_slot,
            copy_seconds=copy_seconds,
            verify_seconds=verify_seconds,
            routing_seconds=routing_seconds,
        )

    # ---- chunked swap: one chunk of layers per safe point (fdeplb.weights.chunk_swap) -------------------------------
    def load_chunk(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                   layers: tuple[int, ...]) -> int:
        """Before the chunk's switch step: check ``layers``' chunk against these experts and fill
        ``staged.buffer`` with it; returns the bytes copied. See :func:`fdeplb.weights.chunk_swap.load_chunk`
        (its errors: InputError, WeightError, VerificationError; nothing live written)."""
        return chunk_swap.load_chunk(self, plan, staged, new_phy2log, layers)

    def swap_layers(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                    layers: tuple[int, ...]) -> SwapReport:
        """At the chunk's switch step: apply the chunk :meth:`load_chunk` loaded, check it on the device, switch
        its routing rows. See :func:`fdeplb.weights.chunk_swap.swap_layers` (its errors: WeightError, InputError,
        VerificationError)."""
        return chunk_swap.swap_layers(self, plan, staged, new_phy2log, layers)
