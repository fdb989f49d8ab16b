"""Reading expert tensors from a safetensors checkpoint, and writing small synthetic ones for tests and demos.

A checkpoint is a directory with ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``)
and its shards, or a single ``.safetensors`` file. Names are resolved through the index (a dict lookup, never a
scan of every key) and each shard is opened once, on first use; safetensors maps the file and reads only the bytes
of the tensors asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fdeplb.errors import CheckpointError, InputError
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
            try:
                self._weight_map = dict(json.loads(self.index_path.read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{self.index_path}: unreadable safetensors index ({exc})") from exc
        self._handles: dict[Path, Any] = {}
        self._spec: dict[str, tuple[tuple[int, ...], str]] | None = None
        self.shards_opened = 0
        self.tensors_read = 0
        self.bytes_read = 0

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

    def _open(self, shard: Path) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            safe_open, _ = _paddle.safetensors()
            try:
                handle = safe_open(str(shard), framework="paddle", device="cpu")
            except Exception as exc:  # safetensors raises its own error types (and OSError)
                raise CheckpointError(f"cannot open checkpoint shard {shard}: {exc}") from exc
            self._handles[shard] = handle
            self.shards_opened += 1
            if self._weight_map is None:
                self._single_keys = frozenset(handle.keys())
        return handle

    def _header(self, name: str) -> tuple[Path, tuple[int, ...], str]:
        shard = self.tensor_file(name)
        handle = self._open(shard)
        try:
            sl = handle.get_slice(name)
        except Exception as exc:
            raise CheckpointError(f"tensor {name!r} is listed for {shard} but the file does not hold it ({exc})") from exc
        code = str(sl.get_dtype())
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} in {shard} has dtype {code}, which fdeplb does not handle")
        return shard, tuple(int(d) for d in sl.get_shape()), _DTYPES[code][0]

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

        The tensors own their memory (copied out of safetensors' file mapping, so the bytes are really read now and
        the result outlives the reader); ``pinned=True`` copies into page-locked memory instead (GPU builds only).

        Raises:
            CheckpointError: a tensor missing or of another shape/dtype than the template's first expert.
        """
        self.check_expert(layer, expert)
        out = {}
        for suffix, name in self.template.names(layer, expert).items():
            handle = self._open(self.tensor_file(name))
            mapped = handle.get_tensor(name)
            # safetensors hands out views of its file mapping through DLPack; paddle aborts the process when two
            # live views share an address, so keep none of them alive: copy, then drop the view at once.
            out[suffix] = mapped.pin_memory() if pinned else mapped.clone()
            del mapped
            self.tensors_read += 1
            self.bytes_read += _paddle.nbytes(out[suffix])
        return out

    def close(self) -> None:
        """Drop every open shard (the reader reopens them on the next read)."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, pattern={self.template.pattern!r})"


# ---- synthetic checkpoints -------------------------------------------------------------------------------------------
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
