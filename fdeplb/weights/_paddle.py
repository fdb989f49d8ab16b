"""The one module of fdeplb that imports ``paddle`` and ``safetensors``; both lazily.

Everything else in :mod:`fdeplb.weights` reaches paddle through these helpers, so importing fdeplb never needs
paddle, and a missing install fails with one clear :class:`~fdeplb.errors.DependencyError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from fdeplb.errors import DependencyError

_EXTRA = "pip install 'fdeplb[paddle]' (CPU), or paddlepaddle-gpu from Paddle's own index on GPU machines"


@lru_cache(maxsize=None)
def paddle() -> Any:
    """The ``paddle`` module. Raises DependencyError naming the extra when it is not installed."""
    try:
        with warnings.catch_warnings():
            # paddle's C++-extension helper warns about ccache on import; fdeplb compiles no extension
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle as _paddle
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise DependencyError(f"fdeplb.weights needs paddle: {_EXTRA} ({exc})") from exc
    return _paddle


@lru_cache(maxsize=None)
def safetensors() -> tuple[Any, Any]:
    """``(safe_open, save_file)`` of safetensors' paddle flavour. Raises DependencyError when missing."""
    paddle()
    try:
        from safetensors import safe_open
        from safetensors.paddle import save_file
    except ImportError as exc:  # pragma: no cover
        raise DependencyError(f"fdeplb.weights needs safetensors: {_EXTRA} ({exc})") from exc
    return safe_open, save_file


def resolve_device(device: str | None) -> str:
    """``device`` as paddle spells it (``"cpu"``, ``"gpu:0"``); ``None`` is paddle's current device."""
    return str(paddle().device.get_device() if device is None else device)


def is_gpu(device: str) -> bool:
    """True for a CUDA device string (``"gpu"``, ``"gpu:3"``)."""
    return device.split(":")[0] == "gpu"


def place_of(device: str) -> Any:
    """paddle Place for a device string."""
    pd = paddle()
    if is_gpu(device):
        return pd.CUDAPlace(int(device.split(":")[1]) if ":" in device else 0)
    return pd.CPUPlace()


def nbytes(t: Any) -> int:
    """Size of a dense tensor's data in bytes."""
    return math.prod(t.shape) * t.element_size()


def dtype_name(t: Any) -> str:
    """``"float32"``, ``"bfloat16"``, ``"int8"`` ... for a tensor's dtype."""
    return str(t.dtype).replace("paddle.", "")


def empty(shape: list[int], dtype: Any, device: str) -> Any:
    """Uninitialised tensor of ``shape`` and ``dtype`` on ``device``."""
    with _device_guard(device):
        return paddle().empty(shape, dtype=dtype)


class _device_guard:
    """Temporarily make ``device`` paddle's current device (paddle allocates on the current device)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.previous = paddle().device.get_device()
        if self.previous != self.device:
            paddle().device.set_device(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.previous != self.device:
            paddle().device.set_device(self.previous)


def copy_into(dst: Any, src: Any) -> None:
    """In-place, asynchronous-where-possible copy; ``dst`` keeps its storage. Call :func:`synchronize` after."""
    dst.copy_(src, False)


def clone(t: Any) -> Any:
    """A copy of ``t`` with its own storage on the same device."""
    return t.clone()


def synchronize(device: str) -> None:
    """Wait for every queued copy on ``device`` (no-op on CPU)."""
    if is_gpu(device):
        paddle().device.synchronize(device)


@lru_cache(maxsize=None)
def _crc32c() -> Any:
    try:
        import google_crc32c
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise DependencyError(f"fdeplb.weights needs google-crc32c: {_EXTRA} ({exc})") from exc
    return google_crc32c.value


def empty_host(shape: list[int], dtype: str, pinned: bool = False) -> Any:
    """Uninitialised dense host tensor (page-locked with ``pinned=True``, GPU builds only), to read into."""
    t = empty(shape, dtype, "cpu")
    return t.pin_memory() if pinned else t


def host_buffer(t: Any) -> memoryview:
    """Writable byte view of a dense host (or pinned) tensor's memory; valid while ``t`` is alive."""
    place = t.place
    if not (place.is_cpu_place() or place.is_cuda_pinned_place()) or not t.is_contiguous():
        raise ValueError("host_buffer needs a contiguous host tensor")
    size = nbytes(t)
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")


def crc32c(buf: Any) -> int:
    """CRC-32C of a byte buffer (bytes, bytearray, a memoryview, e.g. :func:`host_buffer`): the value
    :func:`checksum` gives the tensor whose memory it is."""
    return int(_crc32c()(np.frombuffer(buf, dtype=np.uint8))) if memoryview(buf).nbytes else 0


def checksum(t: Any) -> int:
    """CRC-32C (Castagnoli) of the raw bytes of ``t``: google-crc32c, hardware-accelerated (SSE4.2 / ARMv8 CRC,
    several GB/s per core). Device or strided tensors are copied to a contiguous host tensor first."""
    place = t.place
    if not (place.is_cpu_place() or place.is_cuda_pinned_place()) or not t.is_contiguous():
        t = t.cpu().contiguous()
    if nbytes(t) == 0:
        return 0
    # google-crc32c takes buffers that need no release (bytes, numpy arrays), not memoryviews: wrap without copying
    return int(_crc32c()(np.frombuffer(host_buffer(t), dtype=np.uint8)))


def host_view(t: Any) -> memoryview:
    """The raw bytes of ``t`` in host memory: a view of a dense host tensor's own memory (no copy: valid while
    ``t`` lives and changes with it), else of a host copy (device or strided tensors)."""
    place = t.place
    if not (place.is_cpu_place() or place.is_cuda_pinned_place()) or not t.is_contiguous():
        t = t.cpu().contiguous()
        return memoryview(bytes(host_buffer(t)))
    return host_buffer(t)


#: block of a checked host copy: copied, then compared while both halves are still in L2
_CHECK_BLOCK = 256 * 1024
#: most threads a batch of checked host copies uses (:class:`CheckedCopies`)
_MAX_COPY_THREADS = 4
#: the most one thread of a batch of checked host copies takes at a time (its own stretch, or another's tail)
_PIECE = 4 * _CHECK_BLOCK


@lru_cache(maxsize=None)
def _memcmp() -> Any:
    """libc's ``memcmp`` (ctypes; the call releases the GIL)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    fn = libc.memcmp
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


def on_host(t: Any) -> bool:
    """True for a contiguous host (or pinned) tensor, whose bytes the host can address."""
    place = t.place
    return (place.is_cpu_place() or place.is_cuda_pinned_place()) and t.is_contiguous()


def _as_words(t: Any) -> Any:
    """``t`` flattened as integers of its element size (a device-side view of its raw bytes) that ``equal_all``
    compares bit-exactly; 1- and 2-byte elements are widened to int32."""
    pd = paddle()
    flat = t.flatten()
    size = t.element_size()
    if size == 8:
        return flat.view(pd.int64)
    if size == 4:
        return flat.view(pd.int32)
    return flat.view(pd.int16 if size == 2 else pd.int8).astype(pd.int32)


#: the raw host copy of :func:`_host_copy_checked` (``memmove(dst, src, n)``; a test replaces it with a faulty one)
_copy_bytes = ctypes.memmove


def _host_copy_checked(dst: int, src: int, size: int) -> bool:
    """Copy ``size`` bytes from address ``src`` to ``dst`` in blocks, each compared (``memcmp``) right after its
    copy while it is still in cache; True when every block compares equal. Both libc calls release the GIL."""
    memcmp, copy, ok = _memcmp(), _copy_bytes, True
    for offset in range(0, size, _CHECK_BLOCK):
        n = min(_CHECK_BLOCK, size - offset)
        copy(dst + offset, src + offset, n)
        ok = memcmp(dst + offset, src + offset, n) == 0 and ok
    return ok


def copy_checked(dst: Any, src: Any) -> Any:
    """Copy ``src`` into ``dst`` in place and check, on the tensors' own device, that ``dst`` now holds exactly
    ``src``'s bytes; nothing is read back to the host but the answer. Both must have the same shape and dtype.

    Host tensors (a CPU device): copied in blocks of 256 KiB, each compared (``memcmp``) right after its copy while
    it is still in cache; returns a Python bool. Device tensors: ``copy_`` and a bit-exact ``equal_all`` of their
    raw words queued behind it on the device; returns a 0-d device bool tensor (:func:`all_checked` reads them).
    A later write of ``src`` (a copy chain of the same swap) does not disturb the answer: it is taken in order.

    Raises:
        ValueError: host tensors of different byte sizes.
    """
    if on_host(dst) and on_host(src):
        size = nbytes(dst)
        if size != nbytes(src):
            raise ValueError(f"copy_checked: {nbytes(src)} bytes into {size}")
        return _host_copy_checked(dst.data_ptr(), src.data_ptr(), size)
    copy_into(dst, src)
    return device_equal(dst, src)


class RowCopy(NamedTuple):
    """Rows ``[src_row, src_row + rows)`` of ``src`` copied onto rows ``[dst_row, dst_row + rows)`` of ``dst``:
    two tensors of the same row shape and dtype (rows = the leading axis: a stacked expert tensor's slots, or a
    device buffer's entries)."""

    dst: Any
    dst_row: int
    src: Any
    src_row: int
    rows: int


@lru_cache(maxsize=None)
def _copy_pool(pid: int, workers: int) -> ThreadPoolExecutor:
    """Threads of the checked host copies of process ``pid`` (a forked child builds its own: threads do not
    survive ``fork``)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fdeplb-copy")


def copy_threads() -> int:
    """Threads a batch of checked host copies uses: the cores this process may run on, at most 4 (on a CPU rank
    the CPU is the device, and the engine's own threads wait at the safe point while the batch runs)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_COPY_THREADS, cores))


def _rows_span(t: Any, row: int, rows: int) -> tuple[int, int]:
    """``(address, bytes)`` of rows ``[row, row + rows)`` of ``t`` (on its device; the address is meaningful for a
    contiguous tensor only). Raises ValueError for rows outside ``t``."""
    count = int(t.shape[0]) if len(t.shape) else 0
    if rows < 0 or not 0 <= row <= row + rows <= count:
        raise ValueError(f"rows [{row}, {row + rows}) outside a tensor of {count} rows")
    per_row = nbytes(t) // count if count else 0
    return t.data_ptr() + row * per_row, rows * per_row


def _check_batch(copies: list[RowCopy]) -> list[tuple[int, int, int]]:
    """``(dst address, src address, bytes)`` of each copy after checking the batch: rows inside both tensors, the
    same row shape and dtype on both sides, and no copy writing bytes that another copy (or itself) reads or
    writes (one sweep over the spans sorted by address). Raises ValueError otherwise."""
    segments, spans = [], []
    for i, c in enumerate(copies):
        d, n = _rows_span(c.dst, c.dst_row, c.rows)
        s, m = _rows_span(c.src, c.src_row, c.rows)
        if list(c.dst.shape[1:]) != list(c.src.shape[1:]) or c.dst.dtype != c.src.dtype or n != m:
            raise ValueError(f"row copies: copy {i} is from rows of {dtype_name(c.src)}"
                             f"{list(c.src.shape[1:])} into rows of {dtype_name(c.dst)}{list(c.dst.shape[1:])}")
        segments.append((d, s, n))
        if n and c.dst.is_contiguous() and c.src.is_contiguous():
            spans += [(d, d + n, True, i), (s, s + n, False, i)]
    reach_any = reach_written = -1  # furthest end of any span / of a written one, among those starting before
    for start, end, written, i in sorted(spans):
        if start < (reach_any if written else reach_written):
            raise ValueError(f"row copies: copy {i} overlaps the bytes another copy of the batch (or "
                             "itself) writes; a batch's copies must be independent")
        reach_any = max(reach_any, end)
        if written:
            reach_written = max(reach_written, end)
    return segments


def _split(segments: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int, int]]]:
    """``(index, dst, src, bytes)`` pieces of ``segments`` (``(dst, src, bytes)``) in at most ``parts`` lists of
    about equal bytes, each a contiguous stretch of the segments in order, cut on block boundaries into pieces of
    at most :data:`_PIECE` bytes (no list for a batch of no bytes)."""
    total = sum(n for _, _, n in segments)
    share = -(-total // parts)
    share = max(_CHECK_BLOCK, -(-share // _CHECK_BLOCK) * _CHECK_BLOCK)
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(parts)]
    pos = 0
    for i, (d, s, n) in enumerate(segments):
        offset = 0
        while offset < n:
            part = min(pos // share, parts - 1)
            m = min(_PIECE, n - offset if part == parts - 1 else min(n - offset, (part + 1) * share - pos))
            out[part].append((i, d + offset, s + offset, m))
            offset, pos = offset + m, pos + m
    return [p for p in out if p]


def _run_pieces(own: deque, others: list[deque], done: set) -> set[int]:
    """Copy and check the pieces of this thread's stretch ``own`` from its front, then take from the back of the
    ``others`` until every stretch is empty (a thread that started late or runs slower is left fewer; each
    ``deque`` pop hands a piece to one thread). Each piece is added to ``done`` once copied and checked. Returns
    the indices whose check failed."""
    bad: set[int] = set()
    queues = [own.popleft, *(q.pop for q in others)]
    for take in queues:
        while True:
            try:
                piece = take()
            except IndexError:  # this stretch is done
                break
            if not _host_copy_checked(*piece[1:]):
                bad.add(piece[0])
            done.add(piece)
    return bad


def _deferring_interrupts(step: Any, interrupted: BaseException | None = None) -> BaseException | None:
    """Call ``step()`` again until it returns without an interrupt; returns the first interrupt (``interrupted``,
    else the first one caught), to be raised once the work is done. An interrupt is a BaseException that is not an
    Exception (KeyboardInterrupt from SIGINT, or what an engine's signal handler raises: KeyboardInterrupt,
    SystemExit); an Exception is an error and propagates at once."""
    while True:
        try:
            step()
            return interrupted
        except Exception:
            raise
        except BaseException as exc:  # noqa: BLE001 - returned, and raised by the caller once the batch is whole
            interrupted = interrupted or exc


def _copy_pieces(parts: list[list[tuple[int, int, int, int]]]) -> set[int]:
    """Copy and check the pieces of ``parts`` (:func:`_split`) on the calling thread and one pool thread per
    further stretch; returns the indices whose check failed.

    An interrupt in the calling thread (anywhere: between two blocks of a piece, or just after it took a piece
    off a stretch, before holding it) does not leave the batch half-written: the thread takes pieces again,
    waits for the pool's threads, copies again every piece no thread finished, and only then raises the
    interrupt. An error (an Exception) is raised once no other thread still writes."""
    queues = [deque(p) for p in parts]
    if not queues:  # a batch of no bytes
        return set()
    done: set = set()
    futures = []
    if len(queues) > 1:
        pool = _copy_pool(os.getpid(), copy_threads())
        futures = [pool.submit(_run_pieces, q, queues[:k] + queues[k + 1:], done) for k, q in enumerate(queues) if k]
    bad: set[int] = set()

    def take_first_stretch() -> None:
        bad.update(_run_pieces(queues[0], queues[1:], done))

    def copy_the_unfinished() -> None:  # no other thread runs now: a piece cut short is copied again whole
        bad.update(_run_pieces(deque(p for part in parts for p in part if p not in done), [], done))

    try:
        interrupted = _deferring_interrupts(take_first_stretch)
    except Exception:
        late = _deferring_interrupts(lambda: wait(futures))  # never raise while another thread still writes
        if late is not None:
            raise late
        raise
    interrupted = _deferring_interrupts(lambda: wait(futures), interrupted)
    interrupted = _deferring_interrupts(copy_the_unfinished, interrupted)
    if interrupted is not None:
        raise interrupted
    for f in futures:
        bad |= f.result()
    return bad


class CheckedCopies:
    """A batch of independent row copies, checked once when built (rows inside both tensors, the same row shape and
    dtype, no copy overlapping what another one, or itself, writes), applied with :meth:`run`, each copy checked
    bit-exactly on the tensors' device. Built ahead (a chunk's disk writes, when the chunk is loaded), so the pause
    only copies; :meth:`run` checks again only when a tensor's storage moved since.

    The copies may run in any order and at once. Host tensors (a CPU device): the batch is spread over
    :func:`copy_threads` threads in contiguous stretches of 1 MiB pieces; a thread done with its stretch takes
    pieces from the back of the others' (work stealing: a thread that starts late or runs slower on a shared core
    does not hold the batch up). Each piece is copied and compared (``memcmp``) in 256 KiB blocks while still in
    cache. Device tensors: ``copy_`` + a bit-exact ``equal_all`` of the raw words per copy, queued
    on the device, one flag vector read back (:func:`all_checked`): no tensor bytes reach the host.

    Raises:
        ValueError (building, or :meth:`run` after storage moved): rows outside a tensor, rows of another shape or
            dtype, or copies that overlap; nothing copied.
    """

    def __init__(self, copies: list[RowCopy]) -> None:
        self.copies = list(copies)
        self._check()

    def _check(self) -> None:
        self._segments = _check_batch(self.copies)
        tensors = {id(t): t for c in self.copies for t in (c.dst, c.src)}
        self._storage = [(t, t.data_ptr()) for t in tensors.values()]
        self._host = all(on_host(t) for t in tensors.values())
        threads = min(copy_threads(), max(1, sum(n for _, _, n in self._segments) // (4 * _CHECK_BLOCK)))
        self._parts = _split(self._segments, threads) if self._host else []

    def run(self, device: str) -> list[int]:
        """Apply every copy; returns the indices of those whose check failed (empty: every byte landed). Returns (or
        raises, an interrupt included) only once every copy is done: no thread writes afterwards."""
        copies = self.copies
        if not copies:
            return []
        if any(t.data_ptr() != ptr for t, ptr in self._storage):  # re-allocated since (a weight clear + reload)
            self._check()
        if self._host:
            return sorted(_copy_pieces(self._parts))
        live = [i for i, c in enumerate(copies) if c.rows]
        results = [copy_checked(c.dst[c.dst_row:c.dst_row + c.rows], c.src[c.src_row:c.src_row + c.rows])
                   for c in (copies[i] for i in live)]
        synchronize(device)
        return [live[k] for k in all_checked(results, device)]


def copy_rows_checked(copies: list[RowCopy], device: str) -> list[int]:
    """:class:`CheckedCopies` of ``copies``, run at once: the indices of the copies whose check failed. Raises
    ValueError for a batch :class:`CheckedCopies` refuses (nothing copied)."""
    return CheckedCopies(copies).run(device)


def device_equal(a: Any, b: Any) -> Any:
    """A 0-d bool tensor on ``a``'s device: True when ``a`` and ``b`` hold the same bytes (bit-exact: NaNs and
    signed zeros compare by their bits). Queued on the device; not read back."""
    return paddle().equal_all(_as_words(a), _as_words(b))


def all_checked(results: list[Any], device: str) -> list[int]:
    """Indices of the failed checks among ``results`` (:func:`copy_checked` answers), read back at once: one
    scalar from a device (after :func:`synchronize`), the bad indices only when there are any."""
    if not results:
        return []
    if all(isinstance(r, bool) for r in results):
        return [i for i, r in enumerate(results) if not r]
    pd = paddle()
    flags = [r if not isinstance(r, bool) else pd.to_tensor(r, place=place_of(device)) for r in results]
    stacked = pd.stack(flags)
    if bool(stacked.all().item()):
        return []
    return [int(i) for i in np.flatnonzero(~stacked.numpy())]
