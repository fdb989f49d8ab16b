"""Reading expert tensors from a safetensors checkpoint, and writing small synthetic ones for tests and demos.

A checkpoint is a directory with ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``)
and its shards, or a single ``.safetensors`` file. Names are resolved through the index (a dict lookup, never a
scan of every key) and each shard is opened once, on first use. Tensors are read by offset: a safetensors file is an
8-byte little-endian header length, a JSON header (``name -> {"dtype", "shape", "data_offsets": [begin, end]}``,
offsets relative to the end of the header; https://github.com/huggingface/safetensors#format) and the raw bytes,
so one ``os.preadv`` per tensor reads straight into a preallocated (pinned, on a GPU) tensor, with no mapping and
no intermediate copy; :meth:`CheckpointReader.read_experts` runs those reads on a bounded thread pool (the reads
and the CRC-32C release the GIL).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fdeplb.errors import CheckpointError, InputError
from fdeplb.input_files import open_input, read_input
from fdeplb.weights import _paddle
from fdeplb.weights.template import ExpertTemplate, resolve_template

INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype code -> (paddle dtype name, bytes per element)
_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


class CheckpointReader:
    """Reads the expert tensors of one checkpoint, named by an :class:`ExpertTemplate`.

    Args:
        path: checkpoint directory (with ``model.safetensors.index.json``, or exactly one ``*.safetensors`` file),
            the index file itself, or a single ``.safetensors`` file.
        preset: name in :data:`~fdeplb.weights.template.PRESETS` (default ``"ernie"``); or give ``template``.
        template: an explicit :class:`ExpertTemplate`.

    Instrumented for tests and benchmarks: :attr:`shards_opened`, :attr:`tensors_read`, :attr:`bytes_read`.

    Raises:
        CheckpointError: no such path, no index and several shards, an unreadable index.
        InputError: unknown preset, both preset and template.
    """

    def __init__(self, path: str | Path, preset: str | None = None, *, template: ExpertTemplate | None = None) -> None:
        self.template = resolve_template(preset, template)
        self.path = Path(path)
        self._weight_map: dict[str, str] | None = None  # tensor name -> shard file name (None: single file)
        self._single: Path | None = None
        self._single_keys: frozenset[str] = frozenset()
        if self.path.is_dir():
            index = self.path / INDEX_FILE
            if index.is_file():
                self.root, self.index_path = self.path, index
            else:
                shards = sorted(self.path.glob("*.safetensors"))
                if len(shards) != 1:
                    raise CheckpointError(
                        f"{self.path}: no {INDEX_FILE} and {len(shards)} .safetensors files (need the index or exactly one file)"
                    )
                self.root, self.index_path, self._single = self.path, None, shards[0]
        elif self.path.is_file() and self.path.name.endswith(".json"):
            self.root, self.index_path = self.path.parent, self.path
        elif self.path.is_file() and self.path.suffix == ".safetensors":
            self.root, self.index_path, self._single = self.path.parent, None, self.path
        else:
            raise CheckpointError(f"{self.path}: no such checkpoint (directory, index .json or .safetensors file)")
        if self.index_path is not None:
            data = read_input(self.index_path, "safetensors index", CheckpointError)  # a regular file, size-capped
            try:
                self._weight_map = dict(json.loads(data)["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{self.index_path}: unreadable safetensors index ({exc})") from exc
        self._handles: dict[Path, Any] = {}
        self._spec: dict[str, tuple[tuple[int, ...], str]] | None = None
        self.shards_opened = 0
        self.tensors_read = 0
        self.bytes_read = 0
        # staging buffers given back by recycle(): (shape, dtype, pinned) -> tensors whose pages are already faulted
        # in, reused by the next read_experts (a fresh allocation costs a page fault per 4 KiB on first write, which
        # was half of the staging time with a warm page cache)
        self._free: dict[tuple, list[Any]] = {}
        self._free_lock = threading.Lock()
        self.pooled_bytes = 0

    # ---- name resolution ------------------------------------------------------------------------------------------
    def _where(self) -> str:
        return str(self.index_path if self.index_path is not None else self._single)

    def tensor_file(self, name: str) -> Path:
        """Shard file holding tensor ``name``.

        Raises:
            CheckpointError: the index (or the single file) has no such tensor; the message names both.
        """
        if self._weight_map is None:
            self._open(self._single)
            if name not in self._single_keys:
                raise CheckpointError(f"tensor {name!r} is not in checkpoint file {self._single}")
            return self._single
        try:
            return self.root / self._weight_map[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint index {self.index_path}") from None

    def _open(self, shard: Path) -> _Shard:
        handle = self._handles.get(shard)
        if handle is None:
            handle = _Shard(shard)
            self._handles[shard] = handle
            self.shards_opened += 1
            if self._weight_map is None:
                self._single_keys = frozenset(handle.tensors)
        return handle

    def _locate(self, name: str) -> tuple[_Shard, tuple[int, ...], str, int, int]:
        """(shard, shape, paddle dtype name, absolute byte offset, byte length) of tensor ``name``."""
        shard = self.tensor_file(name)
        handle = self._open(shard)
        entry = handle.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"tensor {name!r} is listed for {shard} but the file does not hold it")
        return (handle, *entry)

    def _header(self, name: str) -> tuple[Path, tuple[int, ...], str]:
        handle, shape, dtype, _, _ = self._locate(name)
        return handle.path, shape, dtype

    # ---- expert metadata ------------------------------------------------------------------------------------------
    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``suffix -> (shape, paddle dtype name)`` of one expert, from tensor headers only.

        Taken from the first expert checked or read (MoE layer 0 / expert 0 when asked before any); every other
        expert must match it.

        Raises:
            CheckpointError: a tensor of that expert is missing, or of a dtype fdeplb does not handle.
        """
        if self._spec is None:
            self._spec = self._expert_headers(0, 0)
        return self._spec

    def _expert_headers(self, layer: int, expert: int) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for suffix, name in self.template.names(layer, expert).items():
            _, shape, dtype = self._header(name)
            out[suffix] = (shape, dtype)
        return out

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (all suffixes), from the tensor headers."""
        size = {name: itemsize for name, itemsize in _DTYPES.values()}
        return sum(math.prod(shape) * size[dtype] for shape, dtype in self.spec.values())

    def check_expert(self, layer: int, expert: int) -> None:
        """Check that every tensor of the expert exists with the shape and dtype of the others; reads headers only.

        Raises:
            CheckpointError: a tensor missing from index or shard, or with another shape/dtype (names tensor + file).
        """
        headers = self._expert_headers(layer, expert)
        if self._spec is None:
            self._spec = headers
        for suffix, name in self.template.names(layer, expert).items():
            if headers[suffix] != self._spec[suffix]:
                (shape, dtype), (want_shape, want_dtype) = headers[suffix], self._spec[suffix]
                raise CheckpointError(
                    f"tensor {name!r} in {self.tensor_file(name)} is {dtype}{list(shape)}, "
                    f"expected {want_dtype}{list(want_shape)} like the other experts"
                )

    def read_expert(self, layer: int, expert: int, *, pinned: bool = False) -> dict[str, Any]:
        """Read one expert's tensors: ``suffix -> paddle.Tensor`` in host memory, in template order.

        The tensors own their memory (read by offset into freshly allocated tensors, so the bytes are really read now
        and the result outlives the reader); ``pinned=True`` allocates page-locked memory instead (GPU builds only).

        Raises:
            CheckpointError: a tensor missing, of another shape/dtype than the template's first expert, or a short
                read (truncated file).
        """
        return self.read_experts([(layer, expert)], pinned=pinned, workers=1)[0]

    def read_experts(
        self,
        experts: Sequence[tuple[int, int]],
        *,
        pinned: bool = False,
        workers: int | None = None,
        on_read: Callable[[dict[str, Any]], Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Read many experts in parallel: one ``suffix -> paddle.Tensor`` dict per ``(layer, expert)``, same order.

        Every expert is checked (headers only) and every destination tensor allocated before the first byte is read,
        so memory use is known up front; then ``workers`` threads (default ``min(8, os.cpu_count() * 2)``) each read
        whole experts with ``os.preadv`` into their tensors and call ``on_read(tensors)`` on them (e.g. a checksum)
        while the bytes are hot in cache.

        Returns:
            The tensors, and when ``on_read`` is given, ``(tensors, on_read(tensors))`` pairs instead.

        Raises:
            CheckpointError: a tensor missing, of another shape/dtype than the others, or a short read.
        """
        jobs = []
        for layer, expert in experts:
            self.check_expert(layer, expert)
            job = []
            for suffix, name in self.template.names(layer, expert).items():
                handle, shape, dtype, offset, size = self._locate(name)
                job.append((suffix, handle, offset, size, self._buffer(tuple(shape), dtype, pinned)))
            jobs.append(job)

        def run(job):
            out = {}
            for suffix, handle, offset, size, tensor in job:
                handle.read_into(tensor, offset, size)
                out[suffix] = tensor
            return out if on_read is None else (out, on_read(out))

        n = workers if workers is not None else min(8, 2 * (os.cpu_count() or 1))
        if n <= 1 or len(jobs) <= 1:
            results = [run(job) for job in jobs]
        else:
            with ThreadPoolExecutor(max_workers=min(n, len(jobs)), thread_name_prefix="fdeplb-read") as pool:
                results = list(pool.map(run, jobs))
        self.tensors_read += sum(len(job) for job in jobs)
        self.bytes_read += sum(size for job in jobs for _, _, _, size, _ in job)
        return results

    def buffer(self, shape: tuple[int, ...], dtype: str, pinned: bool = False) -> Any:
        """A host tensor to receive one expert tensor into (a recycled one of that shape, dtype and pinning, see
        :meth:`recycle`, else a new one): what staging from peers fills."""
        return self._buffer(tuple(shape), dtype, pinned)

    def _buffer(self, shape: tuple[int, ...], dtype: str, pinned: bool) -> Any:
        """A host tensor to read into: a recycled one of that shape, dtype and pinning, else a new one."""
        with self._free_lock:
            free = self._free.get((shape, dtype, pinned))
            if free:
                t = free.pop()
                self.pooled_bytes -= _paddle.nbytes(t)
                return t
        return _paddle.empty_host(list(shape), dtype, pinned)

    def recycle(self, tensors: Iterable[Any], pinned: bool = False) -> None:
        """Give staging tensors back for reuse by later reads (the caller drops every other reference to them).

        The pool holds at most what one staging held (the tensors given back), so host memory stays within the
        staging budget; :meth:`trim` frees it."""
        with self._free_lock:
            for t in tensors:
                self._free.setdefault((tuple(t.shape), _paddle.dtype_name(t), pinned), []).append(t)
                self.pooled_bytes += _paddle.nbytes(t)

    def trim(self) -> None:
        """Free every pooled staging buffer."""
        with self._free_lock:
            self._free.clear()
            self.pooled_bytes = 0

    def byte_ranges(self, experts: Iterable[tuple[int, int]]) -> list[tuple[Path, int, int]]:
        """``(shard file, absolute offset, length)`` of every tensor of the given experts, in read order: what
        :meth:`read_experts` reads, for benchmarks that time a plain read of the same bytes."""
        out = []
        for layer, expert in experts:
            for name in self.template.names(layer, expert).values():
                handle, _, _, offset, size = self._locate(name)
                out.append((handle.path, offset, size))
        return out

    def close(self) -> None:
        """Close every open shard (the reader reopens them on the next read)."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, pattern={self.template.pattern!r})"


class _Shard:
    """One open safetensors file: its descriptor and its parsed header.

    ``tensors``: ``name -> (shape, paddle dtype name, absolute byte offset, byte length)``.

    Raises:
        CheckpointError: unreadable file, malformed header, an unhandled dtype, or a tensor whose byte range does
            not match its shape or lies past the end of the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # a regular file only (a FIFO named like a shard would block the open forever), of any size
        with open_input(path, "checkpoint shard", CheckpointError, max_bytes=None) as f:
            self.fd = os.dup(f.fileno())
        try:
            self.tensors = self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> dict[str, tuple[tuple[int, ...], str, int, int]]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"cannot open checkpoint shard {self.path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"cannot open checkpoint shard {self.path}: header length {n} past the end of the file")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except ValueError as exc:
            raise CheckpointError(f"cannot open checkpoint shard {self.path}: malformed header ({exc})") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"cannot open checkpoint shard {self.path}: malformed header (not an object)")
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"tensor {name!r} in {self.path}: malformed header entry ({exc})") from exc
            if not all(_is_count(v) for v in (*shape, begin, end)) or end < begin:
                raise CheckpointError(f"tensor {name!r} in {self.path}: malformed header entry (shape {list(shape)} "
                                      f"and data_offsets [{begin!r}, {end!r}] must be integers >= 0, begin <= end)")
            if not isinstance(code, str) or code not in _DTYPES:
                raise CheckpointError(f"tensor {name!r} in {self.path} has dtype {code}, which fdeplb does not handle")
            dtype, itemsize = _DTYPES[code]
            if end - begin != math.prod(shape) * itemsize or begin < 0 or base + end > size:
                raise CheckpointError(f"tensor {name!r} in {self.path}: byte range [{begin}, {end}) does not hold "
                                      f"{code}{list(shape)} within the file")
            out[name] = (shape, dtype, base + int(begin), int(end - begin))
        return out

    def read_into(self, tensor: Any, offset: int, size: int) -> None:
        """Read ``size`` bytes at ``offset`` into the host tensor's memory (``os.preadv``; releases the GIL)."""
        view = _paddle.host_buffer(tensor)
        done = 0
        while done < size:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: short read at byte {offset + done} (file truncated?)")
            done += got

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


# ---- synthetic checkpoints -------------------------------------------------------------------------------------------
def _is_count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _synthetic_shape(suffix: str, hidden: int, intermediate: int, in_out: bool) -> list[int]:
    """Shape of a synthetic expert tensor from its suffix: up/gate map hidden -> intermediate (x2 when fused),
    down maps intermediate -> hidden; ``weight_scale`` has one entry per output channel; ``in_out`` is paddle's
    [in, out] layout (ERNIE), else torch's [out, in] (HF names)."""
    proj = suffix.split(".")[0]
    if "down" in proj:
        d_in, d_out = intermediate, hidden
    else:
        d_in, d_out = hidden, intermediate * (2 if "up_gate" in proj or "gate_up" in proj else 1)
    if suffix.endswith("weight_scale"):
        return [d_out]
    return [d_in, d_out] if in_out else [d_out, d_in]


def _synthetic_tensor(rng: np.random.Generator, shape: list[int], suffix: str, dtype: str) -> Any:
    pd = _paddle.paddle()
    if suffix.endswith("quant_weight"):
        return pd.to_tensor(rng.integers(-127, 128, size=shape, dtype=np.int8))
    if suffix.endswith("weight_scale"):
        return pd.to_tensor(rng.uniform(0.001, 0.01, size=shape).astype(np.float32))
    values = pd.to_tensor(rng.standard_normal(shape, dtype=np.float32))
    return values if dtype == "float32" else values.astype(dtype)


def write_synthetic_checkpoint(
    path: str | Path,
    num_layers: int,
    num_experts: int,
    *,
    hidden: int = 16,
    intermediate: int = 8,
    preset: str | None = None,
    template: ExpertTemplate | None = None,
    dtype: str = "float32",
    seed: int = 0,
    experts_per_shard: int | None = None,
    single_file: bool = False,
    skip: frozenset[tuple[int, int, str]] = frozenset(),
    experts: Iterable[tuple[int, int]] | None = None,
) -> Path:
    """Write a small MoE checkpoint of real safetensors files (safetensors.paddle) for tests, demos and benchmarks.

    Every expert tensor of the template (default preset ``"ernie"``) is written for MoE layers ``0..num_layers-1``
    (named with the template's layer offset) and experts ``0..num_experts-1``, plus one non-expert tensor so the
    index is not all experts. Values are deterministic per ``(seed, layer, expert, suffix)`` and independent of the
    sharding: float tensors ~ N(0, 1) in ``dtype`` (``float32``, ``float16``, ``bfloat16``), ``*quant_weight``
    int8, ``*weight_scale`` float32 [out].

    Args:
        path: directory to create (or reuse).
        experts_per_shard: experts per shard file, in (layer, expert) order; default ``num_experts`` (a shard per
            layer). Ignored with ``single_file=True``, which writes one ``model.safetensors`` and no index.
        skip: ``(layer, expert, suffix)`` tensors to leave out (to test missing-tensor errors).
        experts: write only these ``(layer, expert)`` pairs (benchmarks that need a few ranks' experts of a large
            model); default all ``num_layers x num_experts``.

    Returns:
        The directory path.

    Raises:
        InputError: non-positive sizes.
    """
    if min(num_layers, num_experts, hidden, intermediate) < 1:
        raise InputError("num_layers, num_experts, hidden and intermediate must be >= 1")
    tpl = resolve_template(preset, template)
    in_out = tpl.pattern.startswith("ernie.")
    _, save_file = _paddle.safetensors()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    per_shard = num_experts if experts_per_shard is None else max(1, int(experts_per_shard))
    if experts is None:
        chosen = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
    else:
        chosen = sorted({(int(layer), int(e)) for layer, e in experts})
        if any(not (0 <= layer < num_layers and 0 <= e < num_experts) for layer, e in chosen):
            raise InputError(f"experts must lie in [0, {num_layers}) x [0, {num_experts})")
    groups = [chosen] if single_file else [chosen[i : i + per_shard] for i in range(0, len(chosen), per_shard)]
    pd = _paddle.paddle()
    weight_map: dict[str, str] = {}
    total = 0
    for g, group in enumerate(groups):
        fname = "model.safetensors" if single_file else f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, Any] = {}
        if g == 0:
            tensors["synthetic.embed_tokens.weight"] = pd.to_tensor(
                np.random.default_rng([seed, 1 << 20]).standard_normal((32, hidden), dtype=np.float32)
            )
        for layer, expert in group:
            for k, (suffix, name) in enumerate(tpl.names(layer, expert).items()):
                if (layer, expert, suffix) in skip:
                    continue
                rng = np.random.default_rng([seed, layer, expert, k])
                tensors[name] = _synthetic_tensor(rng, _synthetic_shape(suffix, hidden, intermediate, in_out), suffix, dtype)
        save_file(tensors, str(out / fname), metadata={"format": "pd"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += _paddle.nbytes(t)
    if not single_file:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return out
