"""The device side of the load window: a step's counts that arrive as a device tensor stay on that device, and the
window's device steps are summed, folded to logical experts and checked there when the window is published.

What an engine hands :meth:`~fdeplb.orchestration.load_window.LoadRecorder.record` per forward step is the routed
tokens per physical slot (or per logical expert) its router already produced, on the GPU. Reading it to the host
every step (``.numpy()``: a device-to-host copy and a stream sync) costs more than the step's own bookkeeping
should; vLLM (``expert_load_pass`` / ``expert_load_window``) and SGLang (its expert-distribution recorder) keep the
counts on the device and read them only when they publish. So does fdeplb: a recorded device step is a copy of
the step's tensor on its device (:class:`DeviceStep`, one device op, nothing read back), and :func:`window_sum`
folds and sums the window's device steps on that device, with one device-to-host copy per publication.

A step's device is part of its kind (:func:`count_device`): steps on two devices (a warm-up step's counts on the
CPU, the rest on the GPU) are copied on their own device and summed there, one read per device and publication;
no step is ever copied to another device, nor summed with another device's steps (vLLM adds a step into a tensor
on one device, which torch refuses for another; a window spans many steps, so fdeplb keeps both instead).

Paddle is reached only through :func:`fdeplb.weights.import_paddle` (the one module that imports it, lazily); a
torch tensor is taken through DLPack (zero-copy). torch is not a dependency.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, NamedTuple

import numpy as np

from fdeplb.weights import dtype_name
from fdeplb.weights import import_paddle as paddle

#: paddle's integer dtypes a count may have (bool is not a count; paddle has no unsigned type wider than 8 bits)
INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8"})
#: the low half of an int64 count: sums of halves are exact in int64 far past any window (see :func:`window_sum`)
_LOW = (1 << 32) - 1
#: a high half at or past this means the sum is past the int64 range
_HIGH_LIMIT = 1 << 31


class DeviceStep(NamedTuple):
    """One recorded step kept on its device."""

    #: the step's counts: a copy of the tensor the engine passed (its own integer dtype), [L, E] or [L, P]
    counts: Any
    #: int64 [L, P]: the placement the step routed with, for per-slot counts; None for logical counts
    phy2log: np.ndarray | None
    #: the device the counts are on (:func:`count_device`): the window sums each device's steps apart
    device: Any


class WindowSum(NamedTuple):
    """:func:`window_sum`'s answer: the window's total, or the steps to drop and why."""

    #: int64 [L, E], every count in [0, int64 max]; None when the window is refused
    total: np.ndarray | None
    #: indices (into the steps passed) of the steps the window refuses: negative counts, or past the int64 range
    bad: list[int]
    #: the InputError message of the first refusal (None when ``total`` is given)
    error: str | None


def device_tensor(counts: Any) -> Any | None:
    """``counts`` as a paddle tensor when it is one, or a torch tensor (through DLPack: the same memory, no copy);
    None for anything else (a numpy array, a list: the host path). Reads nothing from the device."""
    module = type(counts).__module__.partition(".")[0]
    if module == "paddle":
        return counts
    if module == "torch" and hasattr(counts, "__dlpack__"):
        return paddle().utils.dlpack.from_dlpack(counts)
    return None


def count_device(t: Any) -> int:
    """The device a tensor of counts is on, as the hash of its paddle ``Place``: paddle's own equality of places
    compares exactly this value (``phi::Place::operator==``), and two numbers compare at no cost where two
    ``Place`` objects cost a microsecond; host metadata only (~0.5 us)."""
    return hash(t.place)


def count_dtype(t: Any) -> str:
    """The dtype name of a device tensor of counts (``"int32"``...); host metadata only."""
    return dtype_name(t)


class StepCopies:
    """The device copies a window's steps of one kind (shape, dtype, device) are kept in (the engine may reuse its
    own tensor next step), on that device (:func:`count_device`'s ``device``): a copy nothing else holds any more
    (its step left the window and no publication reads it) is written again, so a recorded step is one device copy
    into memory already there. The copies are reserved together, at the first step: the window's step limit plus one (an
    allocation per step, among a thousand live ones, and its first touch cost the host several times the copy), or
    blocks of :data:`BLOCK_STEPS` as a time-limited window needs them. Thread-safe.

    Args:
        device: the device of the steps copied here (each device has copies of its own).
        reserve: copies to reserve at once (the window's step limit; None: grow by blocks).
        most: copies at most; past that a step is copied into a new tensor of its own (not kept here).
    """

    def __init__(self, device: Any, reserve: int | None = None, most: int = 4096) -> None:
        self.device = device
        self.reserve = reserve
        self.most = max(most, (reserve or 0) + 1)
        self._ring: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def copy(self, t: Any) -> Any:
        """A copy of ``t`` on its device (queued, not waited for)."""
        with self._lock:
            ring = self._ring
            if not ring or sys.getrefcount(ring[0]) != 2:  # free: held by the ring alone (and getrefcount's argument)
                grow = (self.reserve or 0) + 1 if not ring else BLOCK_STEPS
                grow = min(max(grow, BLOCK_STEPS), self.most - len(ring))
                if grow <= 0:
                    return t.clone()
                ring.extendleft(_reserve(t, grow))
            copy = ring[0]
            ring.rotate(-1)
            copy.copy_(t, False)
            return copy


def _reserve(t: Any, n: int) -> list[Any]:
    """``n`` tensors of ``t``'s shape and dtype on its place: views of one allocation, zeroed (touched) now."""
    block = paddle().zeros_like(t).unsqueeze(0).tile([n] + [1] * len(t.shape))
    return list(block.unbind(0))


def _fold(x: Any, phy2log: np.ndarray | None, num_logical: int, index: dict[tuple, Any]) -> Any:
    """int64 [L, X] on its device -> int64 [L, E]: per-slot counts summed into their logical experts (``phy2log``
    uploaded once per publication and device into ``index``); logical counts as they are."""
    if phy2log is None:
        return x
    pd = paddle()
    key = (id(phy2log), x.place)
    idx = index.get(key)
    if idx is None:
        idx = index[key] = pd.to_tensor(np.ascontiguousarray(phy2log, dtype=np.int64), place=x.place)
    zeros = pd.to_tensor(np.zeros((phy2log.shape[0], num_logical), np.int64), place=x.place)
    return pd.put_along_axis(zeros, idx, x, axis=1, reduce="add")


def _halves(x: Any) -> tuple[Any, Any]:
    """(high, low) 32-bit halves of non-negative int64 ``x`` on its device: x = high * 2**32 + low."""
    pd = paddle()
    return (pd.bitwise_right_shift(x, pd.to_tensor(32, dtype="int64", place=x.place)),
            pd.bitwise_and(x, pd.to_tensor(_LOW, dtype="int64", place=x.place)))


def _combine(base: np.ndarray, high: np.ndarray, low: np.ndarray) -> np.ndarray | None:
    """``base + high * 2**32 + low`` in int64 (all int64 [L, E], >= 0, below 2**62), or None
    when any count is past the int64 range. Exact: the halves are carried, never wrapped."""
    low = low + (base & _LOW)
    high = high + (base >> 32) + (low >> 32)
    if high.size and int(high.max()) >= _HIGH_LIMIT:
        return None
    return (high << 32) | (low & _LOW)


#: device steps summed together once and kept (a block's sums are reused by every later publication it is whole in)
BLOCK_STEPS = 64


class _Partial(NamedTuple):
    """Some device steps' sums on their device: each step's smallest count (int64 [n], in ``order``: indices into
    those steps) and the 32-bit halves of their folded sum (int64 [L, E] each: sum = high * 2**32 + low)."""

    mins: Any
    order: list[int]
    high: Any
    low: Any


def _partial(steps: list[DeviceStep], num_logical: int, index: dict[tuple, Any]) -> _Partial:
    """:class:`_Partial` of at most :data:`BLOCK_STEPS` steps on one device, summed per (dtype, routing): counts
    of at most 32 bits in int64 (at most 64 steps x P slots of < 2**31: no wrap), int64 counts by their halves."""
    pd = paddle()
    groups: dict[tuple[str, int], list[int]] = {}  # steps summed together: same dtype, same routing
    for i, step in enumerate(steps):
        groups.setdefault((count_dtype(step.counts), id(step.phy2log)), []).append(i)
    mins, high, low, order = [], [], [], []
    for (dtype, _), idx in groups.items():
        x = pd.stack([steps[i].counts for i in idx])  # [n, L, X], the counts' own dtype
        if dtype not in ("int32", "int64"):  # paddle's min / sum kernels take int32 and int64 only
            x = x.astype("int32")
        mins.append(x.min(axis=[1, 2]).astype("int64"))
        order += idx
        phy2log = steps[idx[0]].phy2log
        if dtype == "int64":
            h, lo = _halves(x)
            high.append(_fold(h.sum(axis=0), phy2log, num_logical, index))
            low.append(_fold(lo.sum(axis=0), phy2log, num_logical, index))
        else:
            h, lo = _halves(_fold(pd.sum(x, axis=0, dtype="int64"), phy2log, num_logical, index))
            high.append(h)
            low.append(lo)
    return _Partial(pd.concat(mins), order, pd.add_n(high), pd.add_n(low))


def window_sum(steps: list[DeviceStep], seqs: list[int], base: np.ndarray, blocks: dict[tuple, Any]) -> WindowSum:
    """The window's total: ``base`` (int64 [L, E], the host steps' sum, >= 0) plus every device step in
    ``steps`` (oldest first; ``seqs``: their numbers, counted up as they were recorded), folded to logical experts
    through each step's own phy2log and summed on its device; one device-to-host copy per device (each step's
    minimum and the [L, E] sums), the devices' sums added on the host.

    Steps are summed in blocks of :data:`BLOCK_STEPS` consecutive numbers on one device: a whole block's sums are
    kept in ``blocks`` (the caller's, one per window, keyed (block, device); a number is never given twice, so a
    whole block is the same steps while it stays whole) and reused by the next publications, so a publication sums
    only the steps recorded since the last one and the two partial blocks at the window's ends. The sums are exact:
    the 32-bit halves of the folded counts are summed apart and carried on the host (no wrap for fewer than ~2**17
    blocks). Checked here, not when recorded (that would read the device every step): a step with a negative
    count is refused (``expert counts must be >= 0, found N``), and so is every step that would take the window
    past the int64 range, in the order they were recorded, as ``record()`` refuses a host step (``... per slot sum
    past the int64 range for a logical expert`` for a step that does alone, else ``... would take the load
    window's sum past the int64 range``); only on such a window is the device read again (a flag per step).

    Returns:
        :class:`WindowSum`: the total, or the refused steps (indices into ``steps``) and the first refusal's message.
    """
    pd = paddle()
    num_layers, num_logical = base.shape
    index: dict[tuple, Any] = {}
    by_block: dict[tuple, list[int]] = {}
    for i, seq in enumerate(seqs):
        by_block.setdefault((seq // BLOCK_STEPS, steps[i].device), []).append(i)
    kept: dict[tuple, Any] = {}
    by_device: dict[Any, list[tuple[list[int], _Partial]]] = {}
    for block, idx in by_block.items():
        members = [steps[i] for i in idx]
        if len(idx) < BLOCK_STEPS:  # the window's ends (or a block with refused steps): summed each time
            by_device.setdefault(block[1], []).append((idx, _partial(members, num_logical, index)))
            continue
        cached = blocks.get(block)  # a whole block: its numbers, hence its steps, are the same as when cached
        if cached is None:
            cached = _partial(members, num_logical, index)
        kept[block] = cached
        by_device.setdefault(block[1], []).append((idx, cached))
    blocks.clear()
    blocks.update(kept)  # whole blocks still in the window: the rest expired
    n, size = len(steps), num_layers * num_logical
    step_min = np.empty(n, np.int64)
    high = np.zeros(size, np.int64)
    low = np.zeros(size, np.int64)
    for partials in by_device.values():
        parts = [pd.concat([p.mins for _, p in partials]), pd.add_n([p.high for _, p in partials]).flatten(),
                 pd.add_n([p.low for _, p in partials]).flatten()]
        host = _read(pd.concat(parts))  # the device's one device-to-host copy
        mins = host[:-2 * size]
        step_min[[idx[j] for idx, p in partials for j in p.order]] = mins
        high += host[len(mins):len(mins) + size]
        low += host[len(mins) + size:]
    if (step_min < 0).any():
        negative = np.flatnonzero(step_min < 0).tolist()
        error = f"expert counts must be >= 0, found {int(step_min.min())}"
        dropped = set(negative)
        rest = [i for i in range(n) if i not in dropped]
        later = (window_sum([steps[i] for i in rest], [seqs[i] for i in rest], base, blocks) if rest
                 else WindowSum(base.copy(), [], None))
        return WindowSum(None, sorted(negative + [rest[i] for i in later.bad]), error)
    total = _combine(base, high.reshape(num_layers, num_logical), low.reshape(num_layers, num_logical))
    if total is not None:
        return WindowSum(total, [], None)
    return _refuse_overflow(steps, base, index)


def _read(t: Any) -> np.ndarray:
    """``t`` (int64 on its device) on the host: the device-to-host copy of a publication (one per device)."""
    return t.numpy()


def _refuse_overflow(steps: list[DeviceStep], base: np.ndarray, index: dict[tuple, Any]) -> WindowSum:
    """A window past the int64 range: replay the steps on the device in order, each added only if the running
    sum stays in range (what ``record()`` does with a host step), and name the steps left out. Steps on several
    devices are replayed on the host (copied there: this refusal is the rare path)."""
    pd = paddle()
    one = len({step.device for step in steps}) == 1
    place = steps[0].counts.place if one else pd.CPUPlace()
    num_logical = base.shape[1]
    run_high = pd.to_tensor(base >> 32, place=place)
    run_low = pd.to_tensor(base & _LOW, place=place)
    kept, alone = [], []
    for step in steps:
        h, lo = _halves((step.counts if one else step.counts.cpu()).astype("int64"))
        h, lo = _fold(h, step.phy2log, num_logical, index), _fold(lo, step.phy2log, num_logical, index)
        h, lo = _halves_carried(h, lo)
        alone.append(h.max() >= _HIGH_LIMIT)
        cand_h, cand_lo = _halves_carried(run_high + h, run_low + lo)
        ok = cand_h.max() < _HIGH_LIMIT
        kept.append(ok)
        run_high, run_low = pd.where(ok, cand_h, run_high), pd.where(ok, cand_lo, run_low)
    flags = pd.stack([pd.stack(kept), pd.stack(alone)]).numpy()  # the one extra read of a refused window
    bad = np.flatnonzero(~flags[0]).tolist()
    if flags[1][bad[0]]:
        error = "expert counts per slot sum past the int64 range for a logical expert"
    else:
        error = "expert counts would take the load window's sum past the int64 range"
    return WindowSum(None, bad, error)


def _halves_carried(high: Any, low: Any) -> tuple[Any, Any]:
    """(high, low) with low's carry moved into high: low back in [0, 2**32)."""
    carry, low = _halves(low)
    return high + carry, low
