"""The chunked swap: one chunk of layers of a committed swap prepared before its safe point and applied at it.

:func:`load_chunk` (background, the engine keeps serving) checks the chunk against the live experts, fills the
staging's :class:`~fdeplb.weights.staging.DeviceBuffer` and works out the pause's writes as a
:class:`~fdeplb.weights.staging.LoadedChunk`; :func:`swap_layers` (the pause) applies them: device-to-device copies,
each written slot compared on the device with what it was copied from, then the chunk's routing rows. The cut of
vLLM's ``rebalance_execute.py`` (prepare a transfer, then apply it), as functions over one rank's
:class:`~fdeplb.weights.live.LiveExperts` (``live``; not imported here: it imports this module), which
exposes them as its ``load_chunk`` / ``swap_layers``.

Uses from LiveExperts: ``_check_swap``, ``_check_local_checksums``, ``_check_staged_shapes``, ``_checksums``,
``_views``, ``_phy2log``, ``_live``, ``_epoch``, ``needs_reload``, ``routing``, ``tensors``, ``device``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fdeplb.checks import check_int
from fdeplb.errors import InputError, VerificationError, WeightError
from fdeplb.weights import _paddle
from fdeplb.weights.plan import KEEP, TransferPlan
from fdeplb.weights.reports import SwapReport
from fdeplb.weights.staging import DeviceBuffer, LoadedChunk, StagedExperts


def load_chunk(live: Any, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
               layers: tuple[int, ...]) -> int:
    """Before the chunk's switch step (the serving engine keeps running): check the chunk against the live
    experts as :meth:`LiveExperts.swap` checks a whole swap, copy the staged experts of ``layers`` into ``staged.buffer``
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
    chunk = list(_chunk_of(layers, live.num_layers))
    new = live._check_swap(plan, staged, new_phy2log, chunk)
    wanted = set(chunk)
    live._check_local_checksums(plan, live._checksums.keys(), wanted)
    buffer = staged.buffer
    if buffer is not None and not buffer.entries and buffer.capacity:
        raise WeightError(f"rank {live.ep_rank}: the staged plan's device buffer was released")
    indices = [i for i, (layer, _) in enumerate(plan.disk) if layer in wanted]
    # no buffer: the rank's chunks read nothing from disk (staged with none; an empty one holds the chunk's
    # routing rows and writes). A chunk larger than the buffer never comes from the layout it was sized for.
    if buffer is None or len(indices) > buffer.capacity:
        if buffer is not None:
            buffer.release()
        spec = {suffix: (tuple(t[0].shape[1:]), t[0].dtype) for suffix, t in live.tensors.items()}
        buffer = staged.buffer = DeviceBuffer(spec, len(indices), live.device)
    buffer.chunk = None
    # the chunk's staged experts and the buffer are checked here, before the switch step, so the pause only
    # checks that the buffer holds this chunk
    live._check_staged_shapes(plan, [staged.experts[i] for i in indices], indices)
    for suffix, layers_ in live.tensors.items() if indices else ():
        t, slot = buffer.tensors.get(suffix), layers_[0]
        if t is None or list(t.shape[1:]) != list(slot.shape[1:]) or t.dtype != slot.dtype:
            raise WeightError(f"rank {live.ep_rank}: the device buffer's {suffix!r} does not match the slots")
    # the buffer is checked against the staged experts (themselves checked against the checkpoint when read):
    # the pause then only proves each slot equals its buffer entry. Host to host: compared block by block
    # right after the copy; onto a device: the entry's checksum, read back here, outside the pause.
    copied, bad, by_checksum = 0, [], []
    for entry, i in enumerate(indices):
        checked, on_device = True, False
        for suffix in live.tensors:
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
    _paddle.synchronize(live.device)
    for entry, i in by_checksum:
        got = buffer.entries[entry]
        if tuple(_paddle.checksum(got[s]) for s in staged.experts[i]) != staged.checksums[i]:
            bad.append(plan.disk[i])
    if bad:
        raise VerificationError(
            f"rank {live.ep_rank}: the device buffer's copy of staged expert(s) (layer, expert) {bad[:8]} differs "
            f"from the staged bytes; nothing was written, the chunk {chunk} is not loaded")
    loaded = {i: entry for entry, i in enumerate(indices)}
    # one block of rows per run of consecutive layers: the pause switches each run with one checked copy per
    # table (a batch, checked now: the pause only copies)
    routing = live.routing.row_copies(new, chunk, live._live)
    writes = _chunk_writes(plan, wanted, loaded)
    # the disk writes (runs of consecutive slots from consecutive entries) as one batch, checked now
    disk_written = [(*w, suffix) for w in writes if w[0] == "disk" for suffix in live.tensors]
    disk_batch = _paddle.CheckedCopies([
        _paddle.RowCopy(live.tensors[suffix][layer], slot, buffer.tensors[suffix], source, count)
        for _, layer, slot, source, count, suffix in disk_written])
    local = [(kind, layer, slot, source) for kind, layer, slot, source, _ in writes if kind != "disk"]
    action = plan.action[chunk]
    counts = {"keep": int(np.count_nonzero(action == KEEP)), "local": sum(w[0] != "snapshot" for w in local),
              "disk": len(loaded), "disk_slots": sum(w[4] for w in writes if w[0] == "disk"),
              "snapshots": sum(w[0] == "snapshot" for w in local)}
    _paddle.synchronize(live.device)  # the buffer is complete before the safe point reads it
    buffer.chunk = LoadedChunk(
        layers=tuple(chunk), plan=plan, plan_key=staged.plan_key, new_rows=new[chunk].copy(), live=live,
        live_epoch=live._epoch, slot_nbytes=live.expert_nbytes, loaded=loaded, local=local,
        disk_batch=disk_batch, disk_written=disk_written, routing=_paddle.CheckedCopies(routing), counts=counts,
        checksums=[(plan.disk[i], staged.checksums[i]) for i in loaded])
    return copied

def _failed_slots(live: Any, failed: list[tuple[str, int, int, int, int, str]], buffer: DeviceBuffer,
                  plan: TransferPlan) -> set[tuple[int, int, int]]:
    """``(layer, slot, expert)`` of the slots behind failed checks; a failed run of disk writes is compared
    again slot by slot with its buffer entries (on the device; the buffer is unchanged) to name the slots."""
    bad: set[tuple[int, int, int]] = set()
    for kind, layer, slot, source, count, suffix in failed:
        slots = [slot]
        if count > 1:
            pairs = [(live._views[layer][slot + j][suffix], buffer.entries[source + j][suffix]) for j in range(count)]
            found = _paddle.all_checked([_paddle.device_equal(d, s) for d, s in pairs], live.device)
            slots = [slot + j for j in found] or list(range(slot, slot + count))
        bad.update((layer, s, int(plan.new[layer, s])) for s in slots)
    return bad

def _loaded_chunk(live: Any, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                  layers: tuple[int, ...]) -> LoadedChunk:
    """The chunk ``staged.buffer`` holds for ``layers``, when nothing :func:`load_chunk` checked it against has
    moved since: the same plan and staging, the same rows of ``new_phy2log``, the same :attr:`LiveExperts.epoch`. A few
    comparisons, no hashing: this runs in the pause."""
    chunk = _chunk_of(layers, live.num_layers)
    buffer = staged.buffer
    loaded = None if buffer is None else buffer.chunk
    if loaded is None or loaded.layers != chunk:
        raise WeightError(f"rank {live.ep_rank}: the device buffer holds layers {getattr(buffer, 'layers', ())}, "
                          f"not the chunk {chunk}; load_chunk() it first")
    if live.needs_reload:
        raise WeightError(f"rank {live.ep_rank}: live slots failed verification; reload() before swapping")
    if staged.released:
        raise WeightError(f"rank {plan.ep_rank}: the staged experts were released; stage the plan again")
    if plan is not loaded.plan and plan.key != loaded.plan_key:
        raise WeightError(f"rank {live.ep_rank}: the chunk {chunk} was loaded for another plan "
                          f"({loaded.plan_key} != {plan.key})")
    if loaded.live is not live or loaded.live_epoch != live._epoch:
        raise WeightError(f"rank {live.ep_rank}: the live experts changed since the chunk {chunk} was loaded "
                          "(a reload, a clear, a swap, another chunk or new routed ranks); load_chunk() it again")
    new = np.asarray(new_phy2log, dtype=np.int64)
    if new.shape != live._phy2log.shape or not np.array_equal(new[list(chunk)], loaded.new_rows):
        raise InputError(f"rank {live.ep_rank}: new_phy2log's rows of layers {list(chunk)} are not those the "
                         "chunk was loaded for")
    return loaded

def swap_layers(live: Any, plan: TransferPlan, staged: StagedExperts, new_phy2log: np.ndarray,
                layers: tuple[int, ...]) -> SwapReport:
    """At the chunk's switch step: apply ``plan``'s writes of ``layers`` from the chunk's device buffer
    (:func:`load_chunk` first, which checked the chunk against the live experts), check every written slot on
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
            since (the plan, the staging, the live experts' :attr:`LiveExperts.epoch`: load it again); nothing written.
        InputError: ``layers`` is empty or holds a non-integer or a layer outside the model (as
            :func:`load_chunk`), or ``new_phy2log``'s rows of ``layers`` differ from those the chunk was loaded
            with; nothing written.
        VerificationError: a written slot differs from its source on the device. The routing rows of these
            layers keep the old placement (other chunks already applied stay applied) and
            :attr:`LiveExperts.needs_reload` is set: the rank must :meth:`LiveExperts.reload`.
    """
    loaded = _loaded_chunk(live, plan, staged, new_phy2log, layers)
    buffer = staged.buffer
    start = time.perf_counter()
    live._epoch += 1
    live.needs_reload = True
    snapshots: dict[tuple[int, int], dict[str, Any]] = {}
    checks: list[Any] = []  # local copies, in the plan's order (a slot is read before it is overwritten)
    written: list[tuple[str, int, int, int, int, str]] = []  # the write and suffix of each check
    for kind, layer, slot, source in loaded.local:
        dst = live._views[layer][slot]
        if kind == "snapshot":
            snapshots[(layer, slot)] = {s: _paddle.clone(t) for s, t in dst.items()}
            continue
        src = live._views[layer][source] if kind == "local" else snapshots[(layer, source)]
        for suffix, t in dst.items():
            checks.append(_paddle.copy_checked(t, src[suffix]))
            written.append((kind, layer, slot, source, 1, suffix))
    # every local copy of a layer reads its slots before that layer's disk writes overwrite them (the plan's
    # order), and disk writes only read the buffer: once the local copies are queued, the runs are independent
    failed = [loaded.disk_written[i] for i in loaded.disk_batch.run(live.device)]
    _paddle.synchronize(live.device)
    copy_seconds = time.perf_counter() - start

    start = time.perf_counter()
    failed += [written[i] for i in _paddle.all_checked(checks, live.device)]
    snapshots.clear()
    verify_seconds = time.perf_counter() - start
    chunk = list(loaded.layers)
    if failed:
        bad = sorted(_failed_slots(live, failed, buffer, plan))
        raise VerificationError(
            f"rank {live.ep_rank}: {len(bad)} swapped slot(s) differ on the device from what they were copied "
            f"from (layer, slot, expert): {bad[:8]}; the routing rows of layers {chunk} keep the old "
            "placement, reload() the rank"
        )

    start = time.perf_counter()
    if loaded.routing.run(live.device):  # a routing row did not land: put back the tables of the placement
        # the slots hold now (these layers' old rows, the other chunks' applied ones); the slots are fine
        live.routing.write(live._phy2log, live._live)
        raise VerificationError(f"rank {live.ep_rank}: the routing rows of layers {chunk} did not land on the "
                                "device; the tables keep the old placement for them")
    live._phy2log[chunk] = loaded.new_rows
    live._checksums.update(loaded.checksums)
    buffer.chunk = None  # applied: a chunk is applied once
    live.needs_reload = False
    routing_seconds = time.perf_counter() - start

    counts, per_slot = loaded.counts, loaded.slot_nbytes
    return SwapReport(
        ep_rank=live.ep_rank,
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
