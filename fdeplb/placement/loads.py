"""Expert-load dump readers.

Formats (detected from the JSON keys):

- SGLang ``expert_distribution_recorder`` dump (``--init-expert-location`` input):
  ``{"logical_count": [[...E...] x num_model_layers]}``, optionally stacked per rank ``[R, layers, E]`` (summed).
  All-zero rows are dense layers (DeepSeek-V3: the first 3) and are dropped; :attr:`ExpertLoad.layer_ids` keeps the
  model-layer index of every kept row. That is SGLang's convention wherever the row lies, since models interleave
  dense and MoE layers too (Qwen2-MoE's ``decoder_sparse_step``, Llama 4's ``interleave_moe_layer_step``); a zero
  row *between* MoE rows is named by :attr:`ExpertLoad.interleaved_dense` so that callers say so (``fdeplb
  rebalance`` prints a note): it may as well be a MoE layer that routed no token.
- OEPLB / plain counts: ``{"counts": [[...E...] x layers]}`` (all rows kept).

Values are tokens routed to each logical expert (token x top-k assignments) over the recording window.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fdeplb.errors import InputError, LoadFileError
from fdeplb.placement._validate import check_expert_load
from fdeplb.placement.documents import number_table, read_document

#: JSON keys recognised as expert loads, in lookup order, and whether all-zero rows are dropped.
LOAD_KEYS: dict[str, bool] = {"logical_count": True, "counts": False}


def load_digest(expert_load: np.ndarray) -> str:
    """sha256 hex digest of a load array (dtype, shape and bytes), to name the load a plan was computed from."""
    arr = np.ascontiguousarray(expert_load)
    h = hashlib.sha256()
    h.update(f"{arr.dtype.str}|{arr.shape}|".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class ExpertLoad:
    """An expert-load dump read from a file.

    Attributes:
        expert_load: [num_layers, num_logical_experts] int64 (the file held only integers) or float64, read-only;
            only MoE layers (all-zero dense rows of SGLang dumps dropped).
        layer_ids: int64 [num_layers], the row of the file (model layer index) of every kept row.
        path: the file it was read from.
        format: "sglang" (``logical_count``) or "counts".
        num_model_layers: rows in the file (model layers, dense ones included).
    """

    expert_load: np.ndarray
    layer_ids: np.ndarray
    path: str
    format: str
    num_model_layers: int = 0

    @property
    def num_layers(self) -> int:
        return int(self.expert_load.shape[0])

    @property
    def num_logical_experts(self) -> int:
        return int(self.expert_load.shape[1])

    @property
    def digest(self) -> str:
        return load_digest(self.expert_load)

    @property
    def dense_layer_ids(self) -> list[int]:
        """Model layers of the file whose rows were dropped (all zero: dense layers)."""
        kept = set(self.layer_ids.tolist())
        return [i for i in range(self.num_model_layers) if i not in kept]

    @property
    def interleaved_dense(self) -> list[int]:
        """The dropped rows that lie between the first and the last MoE row (not leading or trailing dense
        layers): interleaved dense layers, or MoE layers that routed no token."""
        lo, hi = int(self.layer_ids[0]), int(self.layer_ids[-1])
        return [i for i in self.dense_layer_ids if lo < i < hi]


def read_expert_load(path: str | Path) -> ExpertLoad:
    """Read an expert-load dump (SGLang ``logical_count`` or ``counts`` JSON) into an :class:`ExpertLoad`.

    Raises:
        LoadFileError: the file is missing or unreadable, not JSON, has neither or both of ``logical_count`` and
            ``counts``,
            ragged rows, non-numbers, NaN/inf, negative values, or no layer left; the message names the file.
    """
    p = Path(path)
    doc = read_document(p, LoadFileError, "expert-load file")
    if not isinstance(doc, dict):
        raise LoadFileError(f"{p}: expected a JSON object with 'logical_count' or 'counts', got {type(doc).__name__}")
    found = [k for k in LOAD_KEYS if k in doc]
    if not found:
        raise LoadFileError(f"{p}: no 'logical_count' or 'counts' key (keys: {sorted(doc)[:10]})")
    if len(found) > 1:  # which one the dump means is not ours to guess
        raise LoadFileError(f"{p}: both 'logical_count' and 'counts' keys; a load dump holds one of them")
    key = found[0]
    arr = number_table(p, doc[key], key, LoadFileError)
    if arr.dtype == object or arr.dtype.kind not in "iuf":
        raise LoadFileError(f"{p}: '{key}' must hold numbers in equally long rows (got {arr.dtype} {arr.shape})")
    if arr.ndim == 3:  # SGLang per-rank stack [ranks, layers, E]
        arr = arr.sum(axis=0)
    try:
        arr = check_expert_load(arr, name=key)
    except InputError as exc:
        raise LoadFileError(f"{p}: {exc}") from None
    num_model_layers = int(arr.shape[0])
    layer_ids = np.arange(num_model_layers, dtype=np.int64)
    if LOAD_KEYS[key]:
        keep = arr.any(axis=1)
        arr, layer_ids = arr[keep], layer_ids[keep]
        if arr.shape[0] == 0:
            raise LoadFileError(f"{p}: every row of '{key}' is zero: no MoE layer with load")
    arr = np.ascontiguousarray(arr, dtype=np.int64 if arr.dtype.kind in "iu" else np.float64)
    arr.setflags(write=False)
    layer_ids.setflags(write=False)
    return ExpertLoad(arr, layer_ids, str(p), "sglang" if key == "logical_count" else "counts", num_model_layers)

