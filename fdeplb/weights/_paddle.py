"""The one module of fdeplb that imports ``paddle`` and ``safetensors``; both lazily.

Everything else in :mod:`fdeplb.weights` reaches paddle through these helpers, so importing fdeplb never needs
paddle, and a missing install fails with one clear :class:`~fdeplb.errors.DependencyError`.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from functools import lru_cache
from typing import Any

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
