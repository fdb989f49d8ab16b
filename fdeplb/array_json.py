"""The one JSON form of an int64 array: ``{"dtype": "int64", "shape": [..], "data": [flat values, C order]}``.

A recording (:mod:`fdeplb.recording` writes it, :mod:`fdeplb.replay` reads it) holds every load snapshot and
placement in this form, and :meth:`fdeplb.store.PlanEntry.to_json` / ``from_json`` use it for a plan's arrays, so
the writer, the reader and the plan record share one definition. Reading is strict (pydantic): a bool, a float or
a numeric string is not an integer, and a shape must hold exactly its data.

No I/O; numpy and pydantic only.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from fdeplb.errors import FdeplbError, ReplayError

__all__ = ["array_from_json", "array_json"]


def array_json(a: np.ndarray) -> dict[str, Any]:
    """``a`` (int64) as ``{"dtype", "shape", "data"}`` with ``data`` flat in C order."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    return {"dtype": "int64", "shape": list(a.shape), "data": a.ravel().tolist()}


class _ArrayObject(BaseModel):
    """The object :func:`array_json` writes (other keys are ignored)."""

    model_config = ConfigDict(strict=True)

    dtype: Literal["int64"]
    shape: list[Annotated[StrictInt, Field(ge=0, lt=2**63)]]
    data: list[StrictInt]


def array_from_json(value: Any, what: str, error: type[FdeplbError] = ReplayError) -> np.ndarray:
    """Inverse of :func:`array_json`: an int64 array of the object's shape. Raises ``error`` (default
    :class:`~fdeplb.errors.ReplayError`) naming ``what`` for anything else: not such an object, a dimension that is
    not an integer in [0, 2**63), a shape that does not hold the data, a value that is not an integer or does not
    fit int64."""
    try:
        obj = _ArrayObject.model_validate(value)
    except ValidationError as exc:
        places = [err["loc"] for err in exc.errors()]
        if any(len(loc) <= 1 for loc in places):  # not an object, or dtype / shape / data are not what they are
            raise error(f"{what}: not an int64 array object {{dtype, shape, data}}") from None
        if any(loc[0] == "shape" for loc in places):
            raise error(f"{what}: shape {value['shape']} does not hold {len(value['data'])} values") from None
        raise error(f"{what}: values are not all integers") from None
    # math.prod on Python ints: a product above int64 cannot wrap round to the data's length
    if math.prod(obj.shape) != len(obj.data):
        raise error(f"{what}: shape {obj.shape} does not hold {len(obj.data)} values")
    try:
        return np.asarray(obj.data, dtype=np.int64).reshape(obj.shape)
    except OverflowError:
        raise error(f"{what}: a value does not fit int64") from None
