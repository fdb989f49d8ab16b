"""numpy arrays in Redis hashes as dtype + shape + raw bytes (never pickle).

An array named ``name`` occupies three fields: ``name`` (C-order bytes), ``name:dtype`` (numpy dtype string, e.g.
``<i8``) and ``name:shape`` (comma-separated ints).
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import InputError

_ALLOWED_KINDS = "biuf"  # bool, signed int, unsigned int, float


def encode(name: str, array: np.ndarray) -> dict[str, bytes | str]:
    """Hash fields for ``array`` under ``name``. Only bool/int/float arrays are stored."""
    arr = np.ascontiguousarray(array)
    if arr.dtype.kind not in _ALLOWED_KINDS:
        raise InputError(f"array {name!r}: dtype {arr.dtype} cannot be stored (bool/int/float only)")
    return {
        name: arr.tobytes(),
        f"{name}:dtype": arr.dtype.str,
        f"{name}:shape": ",".join(str(int(n)) for n in arr.shape),
    }


def decode(name: str, fields: dict) -> np.ndarray | None:
    """The array ``name`` from a hash's fields (bytes keys or str keys), or None if absent.

    :class:`InputError` naming the array when the fields do not make one (a missing, unknown or refused dtype, a
    shape that is not comma-separated sizes, bytes that are not a whole number of elements or do not fit the
    shape)."""

    def get(field: str):
        v = fields.get(field)
        if v is None:
            v = fields.get(field.encode())
        return v

    raw = get(name)
    if raw is None:
        return None
    dtype = get(f"{name}:dtype")
    shape = get(f"{name}:shape")
    if dtype is None or shape is None:
        raise InputError(f"array {name!r}: dtype or shape field missing")
    dtype_s = dtype.decode(errors="replace") if isinstance(dtype, bytes) else str(dtype)
    try:
        dtype = np.dtype(dtype_s)
    except (TypeError, ValueError):
        raise InputError(f"array {name!r}: stored dtype {dtype_s[:40]!r} is not a numpy dtype") from None
    if dtype.kind not in _ALLOWED_KINDS:
        raise InputError(f"array {name!r}: stored dtype {dtype} refused")
    shape_s = shape.decode(errors="replace") if isinstance(shape, bytes) else str(shape)
    try:
        dims = tuple(int(n) for n in shape_s.split(",")) if shape_s else ()
    except ValueError:
        dims = (-1,)
    if any(n < 0 for n in dims):
        raise InputError(f"array {name!r}: stored shape {shape_s[:40]!r} is not a list of sizes")
    if len(raw) % dtype.itemsize:
        raise InputError(f"array {name!r}: {len(raw)} bytes are not a whole number of {dtype} elements")
    arr = np.frombuffer(raw, dtype=dtype)
    if arr.size != int(np.prod(dims, dtype=np.int64)):
        raise InputError(f"array {name!r}: {arr.size} elements do not fit shape {dims}")
    return arr.reshape(dims).copy()
