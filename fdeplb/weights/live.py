"""The expert slots of one EP rank as live paddle tensors, swapped in place and verified.

``tensors[suffix][layer]`` is one tensor ``[slots_per_rank, *shape]`` per MoE layer and expert tensor suffix, the
layout of a fused-MoE layer's stacked expert parameters. A swap writes into those tensors (their storage never
changes, so CUDA graphs and every reference the serving engine holds stay valid), then updates the routing tables
``phy2log`` / ``log2phy`` / ``logcnt`` (paddle int64 tensors on the same device, also updated in place).

A swap is applied whole (:meth:`LiveExperts.swap`, from host staging, every written slot checksummed) or in chunks
of layers, one per safe point (:meth:`LiveExperts.load_chunk` before the chunk's switch step, then
:meth:`LiveExperts.swap_layers` at it): the pause is then a device-to-device copy from the chunk's
:class:`~fdeplb.weights.staging.DeviceBuffer`, each written slot compared on the device with what it was copied
from, and the chunk's routing rows; every other layer keeps routing with its own, consistent, rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fdeplb.checks import check_int
from fdeplb.errors import InputError, VerificationError, WeightError
from fdeplb.weights import _paddle
from fdeplb.weights.checkpoint import CheckpointReader
from fdeplb.weights.plan import KEEP, LOCAL, TransferPlan, rank_slots, routing_tables
from fdeplb.weights.reports import SwapReport
from fdeplb.weights.staging import (DeviceBuffer, ExpertChecksum, LoadedChunk, StagedExperts, check_staged_for,
                                    expert_checksum)


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
        log2phy, logcnt = routing_tables(p2l, self.num_logical_experts, self.max_replicas)
        self._phy2log = p2l
        self.phy2log_tensor = self._device_int64(p2l)
        self.log2phy = self._device_int64(log2phy)
        self.logcnt = self._device_int64(logcnt)
        self._checksums: dict[tuple[int, int], ExpertChecksum] = dict(checksums or {})
        self.needs_reload = False
        self._epoch = 0  # moved by every change of the slots, the placement or the routed ranks (see epoch)

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

        Raises:
            VerificationError: a slot does not hold its expert's checkpoint bytes.
        """
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

    def _device_int64(self, arr: np.ndarray) -> Any:
        return _paddle.paddle().to_tensor(np.ascontiguousarray(arr, dtype=np.int64), place=_paddle.place_of(self.device))

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
        self._write_routing(self._phy2log, mask)
        self._live = None if mask.all() else mask

    def _write_routing(self, phy2log: np.ndarray, live: np.ndarray | None) -> None:
        """Rewrite phy2log / log2phy / logcnt in place for ``phy2log`` routed over ``live`` (None: every rank)."""
        self._write_tables(phy2log, *routing_tables(phy2log, self.num_logical_experts, self.max_replicas, live))

    def _write_tables(self, phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> None:
        """Copy whole routing tables (numpy) into the device tables in place, and wait for the copies."""
        for dst, arr in ((self.phy2log_tensor, phy2log), (self.log2phy, log2phy), (self.logcnt, logcnt)):
            _paddle.copy_into(dst, self._device_int64(arr))
        _paddle.synchronize(self.device)

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
        freed (0 when already cleared)."""
        if self.cleared:
            return 0
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

    def reload_in(self, reader: CheckpointReader, phy2log: np.ndarray) -> int:
        """Reload every slot from the checkpoint for placement ``phy2log`` (int [L, P]; the cluster's *current*
        placement, not the initial one: vLLM PR #55228), re-allocating storage into the same tensor objects when
        :meth:`clear` freed it, and switch the routing tables to ``phy2log``. Returns the slots written.

        Raises InputError (``phy2log`` of another shape), CheckpointError, VerificationError (as :meth:`reload`).
        """
        new = np.array(phy2log, dtype=np.int64, copy=True)
        if new.shape != self._phy2log.shape:
            raise InputError(f"phy2log has shape {new.shape}, the live placement {self._phy2log.shape}")
        log2phy, logcnt = routing_tables(new, self.num_logical_experts, self.max_replicas, self._live)
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
        self._write_tables(new, log2phy, logcnt)
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
        log2phy, logcnt = routing_tables(new, self.num_logical_experts, self.max_replicas, live)
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
        self._write_tables(new, log2phy, logcnt)
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

    # ---- chunked swap: one chunk of layers per safe point ---------------------------------------------------------
    def load_chunk(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                   layers: tuple[int, ...]) -> int:
        """Before the chunk's switch step (the serving engine keeps running): check the chunk against the live
        experts as :meth:`swap` checks a whole swap, copy the staged experts of ``layers`` into ``staged.buffer``
        on the live experts' device, and work out what the chunk's pause applies (a
        :class:`~fdeplb.weights.staging.LoadedChunk`: its writes, the batch of disk writes, the routing rows, the
        report's counts). Replaces the buffer's previous chunk. Returns the bytes copied.

        Every buffer entry is checked against its staged expert here (outside the pause; see the comment).

        Raises:
            InputError: ``layers`` is empty or holds a non-integer or a layer outside the model, the plan does
                not start from the live placement of ``layers``, or ``new_phy2log`` is malformed or not the plan's
                target; nothing copied.
            WeightError: live slots that need a reload; staging (or its device buffer) released, or of another
                plan, or of the wrong shape; nothing copied.
            VerificationError: a locally copied expert has no recorded checkpoint checksum (nothing copied), or a
                buffer entry differs from its staged expert: the buffer holds no chunk then (a later load_chunk
                loads it again), nothing live was written.
        """
        chunk = list(_chunk_of(layers, self.num_layers))
        new = self._check_swap(plan, staged, new_phy2log, chunk)
        wanted = set(chunk)
        self._check_local_checksums(plan, self._checksums.keys(), wanted)
        buffer = staged.buffer
        if buffer is not None and not buffer.entries and buffer.capacity:
            raise WeightError(f"rank {self.ep_rank}: the staged plan's device buffer was released")
        indices = [i for i, (layer, _) in enumerate(plan.disk) if layer in wanted]
        # no buffer: the rank's chunks read nothing from disk (staged with none; an empty one holds the chunk's
        # routing rows and writes). A chunk larger than the buffer never comes from the layout it was sized for.
        if buffer is None or len(indices) > buffer.capacity:
            if buffer is not None:
                buffer.release()
            spec = {suffix: (tuple(t[0].shape[1:]), t[0].dtype) for suffix, t in self.tensors.items()}
            buffer = staged.buffer = DeviceBuffer(spec, len(indices), self.device)
        buffer.chunk = None
        # the chunk's staged experts and the buffer are checked here, before the switch step, so the pause only
        # checks that the buffer holds this chunk
        self._check_staged_shapes(plan, [staged.experts[i] for i in indices], indices)
        for suffix, layers_ in self.tensors.items() if indices else ():
            t, slot = buffer.tensors.get(suffix), layers_[0]
            if t is None or list(t.shape[1:]) != list(slot.shape[1:]) or t.dtype != slot.dtype:
                raise WeightError(f"rank {self.ep_rank}: the device buffer's {suffix!r} does not match the slots")
        # the buffer is checked against the staged experts (themselves checked against the checkpoint when read):
        # the pause then only proves each slot equals its buffer entry. Host to host: compared block by block
        # right after the copy; onto a device: the entry's checksum, read back here, outside the pause.
        copied, bad, by_checksum = 0, [], []
        for entry, i in enumerate(indices):
            checked, on_device = True, False
            for suffix in self.tensors:
                t, dst = staged.experts[i][suffix], buffer.entries[entry][suffix]
                if _paddle.on_host(dst) and _paddle.on_host(t):
                    checked = _paddle.copy_checked(dst, t) and checked
                else:
                    _paddle.copy_into(dst, t)
                    on_device = True
                copied += _paddle.nbytes(t)
            if not checked:
                bad.append(plan.disk[i])
            if on_device:
                by_checksum.append((entry, i))
        _paddle.synchronize(self.device)
        for entry, i in by_checksum:
            got = buffer.entries[entry]
            if tuple(_paddle.checksum(got[s]) for s in staged.experts[i]) != staged.checksums[i]:
                bad.append(plan.disk[i])
        if bad:
            raise VerificationError(
                f"rank {self.ep_rank}: the device buffer's copy of staged expert(s) (layer, expert) {bad[:8]} differs "
                f"from the staged bytes; nothing was written, the chunk {chunk} is not loaded")
        loaded = {i: entry for entry, i in enumerate(indices)}
        log2phy, logcnt = routing_tables(new[chunk], self.num_logical_experts, self.max_replicas, self._live)
        # one block of rows per run of consecutive layers: the pause switches each run with one checked copy per
        # table (a batch, checked now: the pause only copies)
        routing = []
        for lo, hi in _runs(chunk):
            a, b = chunk.index(lo), chunk.index(hi) + 1
            blocks = (self._device_int64(new[lo:hi + 1]), self._device_int64(log2phy[a:b]),
                      self._device_int64(logcnt[a:b]))
            routing += [_paddle.RowCopy(table, lo, block, 0, hi + 1 - lo)
                        for table, block in zip((self.phy2log_tensor, self.log2phy, self.logcnt), blocks)]
        writes = _chunk_writes(plan, wanted, loaded)
        # the disk writes (runs of consecutive slots from consecutive entries) as one batch, checked now
        disk_written = [(*w, suffix) for w in writes if w[0] == "disk" for suffix in self.tensors]
        disk_batch = _paddle.CheckedCopies([
            _paddle.RowCopy(self.tensors[suffix][layer], slot, buffer.tensors[suffix], source, count)
            for _, layer, slot, source, count, suffix in disk_written])
        local = [(kind, layer, slot, source) for kind, layer, slot, source, _ in writes if kind != "disk"]
        action = plan.action[chunk]
        counts = {"keep": int(np.count_nonzero(action == KEEP)), "local": sum(w[0] != "snapshot" for w in local),
                  "disk": len(loaded), "disk_slots": sum(w[4] for w in writes if w[0] == "disk"),
                  "snapshots": sum(w[0] == "snapshot" for w in local)}
        _paddle.synchronize(self.device)  # the buffer is complete before the safe point reads it
        buffer.chunk = LoadedChunk(
            layers=tuple(chunk), plan=plan, plan_key=staged.plan_key, new_rows=new[chunk].copy(), live=self,
            live_epoch=self._epoch, slot_nbytes=self.expert_nbytes, loaded=loaded, local=local,
            disk_batch=disk_batch, disk_written=disk_written, routing=_paddle.CheckedCopies(routing), counts=counts,
            checksums=[(plan.disk[i], staged.checksums[i]) for i in loaded])
        return copied

    def _failed_slots(self, failed: list[tuple[str, int, int, int, int, str]], buffer: DeviceBuffer,
                      plan: TransferPlan) -> set[tuple[int, int, int]]:
        """``(layer, slot, expert)`` of the slots behind failed checks; a failed run of disk writes is compared
        again slot by slot with its buffer entries (on the device; the buffer is unchanged) to name the slots."""
        bad: set[tuple[int, int, int]] = set()
        for kind, layer, slot, source, count, suffix in failed:
            slots = [slot]
            if count > 1:
                pairs = [(self._views[layer][slot + j][suffix], buffer.entries[source + j][suffix]) for j in range(count)]
                found = _paddle.all_checked([_paddle.device_equal(d, s) for d, s in pairs], self.device)
                slots = [slot + j for j in found] or list(range(slot, slot + count))
            bad.update((layer, s, int(plan.new[layer, s])) for s in slots)
        return bad

    def _loaded_chunk(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                      layers: tuple[int, ...]) -> LoadedChunk:
        """The chunk ``staged.buffer`` holds for ``layers``, when nothing :meth:`load_chunk` checked it against has
        moved since: the same plan and staging, the same rows of ``new_phy2log``, the same :attr:`epoch`. A few
        comparisons, no hashing: this runs in the pause."""
        chunk = _chunk_of(layers, self.num_layers)
        buffer = staged.buffer
        loaded = None if buffer is None else buffer.chunk
        if loaded is None or loaded.layers != chunk:
            raise WeightError(f"rank {self.ep_rank}: the device buffer holds layers {getattr(buffer, 'layers', ())}, "
                              f"not the chunk {chunk}; load_chunk() it first")
        if self.needs_reload:
            raise WeightError(f"rank {self.ep_rank}: live slots failed verification; reload() before swapping")
        if staged.released:
            raise WeightError(f"rank {plan.ep_rank}: the staged experts were released; stage the plan again")
        if plan is not loaded.plan and plan.key != loaded.plan_key:
            raise WeightError(f"rank {self.ep_rank}: the chunk {chunk} was loaded for another plan "
                              f"({loaded.plan_key} != {plan.key})")
        if loaded.live is not self or loaded.live_epoch != self._epoch:
            raise WeightError(f"rank {self.ep_rank}: the live experts changed since the chunk {chunk} was loaded "
                              "(a reload, a clear, a swap, another chunk or new routed ranks); load_chunk() it again")
        new = np.asarray(new_phy2log, dtype=np.int64)
        if new.shape != self._phy2log.shape or not np.array_equal(new[list(chunk)], loaded.new_rows):
            raise InputError(f"rank {self.ep_rank}: new_phy2log's rows of layers {list(chunk)} are not those the "
                             "chunk was loaded for")
        return loaded

    def swap_layers(self, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                    layers: tuple[int, ...]) -> SwapReport:
        """At the chunk's switch step: apply ``plan``'s writes of ``layers`` from the chunk's device buffer
        (:meth:`load_chunk` first, which checked the chunk against the live experts), check every written slot on
        the device, then switch the routing rows (phy2log / log2phy / logcnt) of exactly those layers. Layers that
        do not change on this rank cost no copy: only their routing rows switch (other ranks' slots moved).

        Each written slot is compared bit-exactly with what it was copied from (its device buffer entry, the
        source slot, or the cycle snapshot) on the device, right after its copy; only the answer is read back
        (:func:`~fdeplb.weights._paddle.copy_checked`, :class:`~fdeplb.weights._paddle.CheckedCopies`): no
        expert bytes go to the host. Local copies run first, in the plan's order; the disk writes (runs of
        consecutive slots from consecutive buffer entries) then run as one batch built and checked when the chunk
        was loaded, on a CPU device spread over :func:`~fdeplb.weights._paddle.copy_threads` threads; then the
        routing rows, one checked copy per table and run of layers. A chunk is applied once.

        Raises:
            WeightError: the device buffer does not hold this chunk, or something it was loaded against moved
                since (the plan, the staging, the live experts' :attr:`epoch`: load it again); nothing written.
            InputError: ``layers`` is empty or holds a non-integer or a layer outside the model (as
                :meth:`load_chunk`), or ``new_phy2log``'s rows of ``layers`` differ from those the chunk was loaded
                with; nothing written.
            VerificationError: a written slot differs from its source on the device. The routing rows of these
                layers keep the old placement (other chunks already applied stay applied) and
                :attr:`needs_reload` is set: the rank must :meth:`reload`.
        """
        loaded = self._loaded_chunk(plan, staged, new_phy2log, layers)
        buffer = staged.buffer
        start = time.perf_counter()
        self._epoch += 1
        self.needs_reload = True
        snapshots: dict[tuple[int, int], dict[str, Any]] = {}
        checks: list[Any] = []  # local copies, in the plan's order (a slot is read before it is overwritten)
        written: list[tuple[str, int, int, int, int, str]] = []  # the write and suffix of each check
        for kind, layer, slot, source in loaded.local:
            dst = self._views[layer][slot]
            if kind == "snapshot":
                snapshots[(layer, slot)] = {s: _paddle.clone(t) for s, t in dst.items()}
                continue
            src = self._views[layer][source] if kind == "local" else snapshots[(layer, source)]
            for suffix, t in dst.items():
                checks.append(_paddle.copy_checked(t, src[suffix]))
                written.append((kind, layer, slot, source, 1, suffix))
        # every local copy of a layer reads its slots before that layer's disk writes overwrite them (the plan's
        # order), and disk writes only read the buffer: once the local copies are queued, the runs are independent
        failed = [loaded.disk_written[i] for i in loaded.disk_batch.run(self.device)]
        _paddle.synchronize(self.device)
        copy_seconds = time.perf_counter() - start

        start = time.perf_counter()
        failed += [written[i] for i in _paddle.all_checked(checks, self.device)]
        snapshots.clear()
        verify_seconds = time.perf_counter() - start
        chunk = list(loaded.layers)
        if failed:
            bad = sorted(self._failed_slots(failed, buffer, plan))
            raise VerificationError(
                f"rank {self.ep_rank}: {len(bad)} swapped slot(s) differ on the device from what they were copied "
                f"from (layer, slot, expert): {bad[:8]}; the routing rows of layers {chunk} keep the old "
                "placement, reload() the rank"
            )

        start = time.perf_counter()
        if loaded.routing.run(self.device):  # a routing row did not land: put back the tables of the placement
            # the slots hold now (these layers' old rows, the other chunks' applied ones); the slots are fine
            self._write_routing(self._phy2log, self._live)
            raise VerificationError(f"rank {self.ep_rank}: the routing rows of layers {chunk} did not land on the "
                                    "device; the tables keep the old placement for them")
        self._phy2log[chunk] = loaded.new_rows
        self._checksums.update(loaded.checksums)
        buffer.chunk = None  # applied: a chunk is applied once
        self.needs_reload = False
        routing_seconds = time.perf_counter() - start

        counts, per_slot = loaded.counts, loaded.slot_nbytes
        return SwapReport(
            ep_rank=self.ep_rank,
            plan_key=loaded.plan_key,
            **counts,
            slots_verified=counts["disk_slots"] + counts["local"],
            bytes_from_staging=counts["disk_slots"] * per_slot,
            bytes_local=counts["local"] * per_slot,
            bytes_snapshot=counts["snapshots"] * per_slot,
            copy_seconds=copy_seconds,
            verify_seconds=verify_seconds,
            routing_seconds=routing_seconds,
        )


def _chunk_writes(plan: TransferPlan, layers: set[int], loaded: dict[int, int]) -> list[tuple[str, int, int, int, int]]:
    """The writes of ``plan`` in ``layers``, in the plan's order, as ``(kind, layer, first slot, first source,
    slots)``: a disk write's source is its device buffer entry (``loaded``: index into ``plan.disk`` -> entry), and
    consecutive disk writes into consecutive slots of a layer from consecutive entries are one run (one copy and
    one check per run and suffix: tensor rows along the slot axis, contiguous on both sides)."""
    writes: list[tuple[str, int, int, int, int]] = []
    for step in plan.steps:
        if step.layer not in layers:
            continue
        source = loaded[step.source] if step.kind == "disk" else step.source
        if writes and step.kind == "disk":
            kind, layer, slot, first, count = writes[-1]
            if (kind, layer, slot + count, first + count) == ("disk", step.layer, step.slot, source):
                writes[-1] = (kind, layer, slot, first, count + 1)
                continue
        writes.append((step.kind, step.layer, step.slot, source, 1))
    return writes


def _chunk_of(layers: Any, num_layers: int) -> tuple[int, ...]:
    """A chunk's layers as load_chunk and swap_layers read them: ints, each once, ascending.

    Raises:
        InputError: not a sequence (a string, bytes or a mapping are none), no layer, or a layer that is not an
            integer in ``[0, num_layers)`` (:func:`fdeplb.checks.check_int`: a float, a bool or a string is
            refused, a negative layer never counts from the end).
    """
    if isinstance(layers, (str, bytes, bytearray, Mapping)):  # iterable, but not of layer indices
        raise InputError(f"a chunk is a sequence of layer indices, got {type(layers).__name__} {layers!r:.40}")
    try:
        values = list(layers)
    except TypeError:
        raise InputError(f"a chunk is a sequence of layer indices, got {layers!r:.40}") from None
    if not values:
        raise InputError("a chunk names at least one layer")
    return tuple(sorted({check_int(v, "a chunk's layer", lo=0, hi=num_layers - 1) for v in values}))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """``(first, last)`` of each run of consecutive integers in the sorted ``values``."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] + 1 == v:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs
