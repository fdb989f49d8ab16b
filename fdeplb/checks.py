"""Strict scalar checks shared by every package: one rule for "an integer in a range", so a bool, a float, a
numeric string or an out-of-range value is refused the same way wherever it enters (placement arguments, stored
records, recordings, checkpoint headers, API query parameters).

No I/O; no dependency beyond the standard library and numpy's integer scalars.
"""

from __future__ import annotations

import operator
from typing import Any

from fdeplb.errors import FdeplbError, InputError

__all__ = ["check_int"]


def check_int(value: Any, name: str, *, lo: int | None = None, hi: int | None = None,
              error: type[FdeplbError] = InputError) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (either bound may be None: open).

    Accepts Python and numpy integers (anything with ``__index__`` but a bool); refuses bools, floats (``1.0``
    too), strings and other types. Raises ``error`` (default :class:`~fdeplb.errors.InputError`) with a message
    naming ``name`` and the value."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise error(f"{name} must be an integer, got bool {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer, got {type(value).__name__} {str(value)[:80]!r}") from None
    if lo is not None and hi is not None and not lo <= out <= hi:
        raise error(f"{name} must be in [{lo}, {hi}], got {out}")
    if lo is not None and out < lo:
        raise error(f"{name} must be >= {lo}, got {out}")
    if hi is not None and out > hi:
        raise error(f"{name} must be <= {hi}, got {out}")
    return out
