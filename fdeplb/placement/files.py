"""Placement files: fdeplb JSON, SGLang ``--init-expert-location`` JSON, TensorRT-LLM load-balancer YAML and
FastDeploy's ``rearrange-experts.json`` workload dump.

========== =================================================================================================
format     content
========== =================================================================================================
fdeplb     ``{"format": "fdeplb.placement", "version": 1, "policy", "num_logical_experts",
           "num_physical_experts", "num_groups", "num_nodes", "num_gpus", "layer_ids", "load_digest",
           "phy2log", "log2phy", "logcnt"}`` (log2phy/logcnt are checked against phy2log on read)
sglang     ``{"physical_to_logical_map": [[P ids] x model layers]}``, the only key SGLang accepts there
trtllm     YAML ``{num_slots, initial_global_assignments: {layer_idx: [P ids]}, layer_updates_per_iter}``
fastdeploy ``{"tokens_per_expert_stats_list" [L, E], "ep_rank_to_expert_id_list" [L, P],
           "expert_id_to_ep_rank_array" [L, E, R + 1] (-1 padded), "expert_in_rank_num_list" [L, E], ...}``
========== =================================================================================================

SGLang and FastDeploy index rows by model layer (dense layers included); TensorRT-LLM keys rows by model layer.
``layer_ids`` (e.g. :attr:`ExpertLoad.layer_ids`) maps the placement's rows to model layers; when writing SGLang or
FastDeploy files with ``num_model_layers``, layers without a row get the trivial placement.

A file's name says its kind, for reading and writing alike (:mod:`fdeplb.placement.documents`): a trtllm placement
is YAML, named ``*.yaml``/``*.yml``; the others are JSON, never named so; ``.gz`` after either means gzip.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fdeplb.errors import InputError, PlacementFileError
from fdeplb.placement.documents import check_document_name, number_table, read_document, write_document
from fdeplb.placement.core import Placement, derive_maps, replica_rank

FORMATS = ("fdeplb", "sglang", "trtllm", "fastdeploy")
FDEPLB_FORMAT = "fdeplb.placement"
#: the version of the fdeplb placement format written, and the only one read
FDEPLB_VERSION = 1


@dataclass(frozen=True, eq=False)
class PlacementFile:
    """A placement read from a file: the placement, the model layer of every row, and where it came from."""

    placement: Placement
    layer_ids: np.ndarray
    format: str
    path: str
    load_digest: str | None = None

    def for_layers(self, layer_ids) -> Placement:
        """The rows of the model layers ``layer_ids`` (e.g. an :class:`ExpertLoad`'s), in that order.

        Returns the placement itself when the file has exactly one row per requested layer in order, or when its
        rows already correspond one to one. Raises :class:`PlacementFileError` when a layer has no row.
        """
        ids = np.asarray(layer_ids, dtype=np.int64)
        if np.array_equal(ids, self.layer_ids):
            return self.placement
        pos = {int(lid): i for i, lid in enumerate(self.layer_ids)}
        missing = [int(i) for i in ids if int(i) not in pos]
        if missing:
            raise PlacementFileError(f"{self.path}: no row for model layer(s) {missing[:5]}")
        pl = self.placement
        rows = [pos[int(i)] for i in ids]
        width = int(pl.logcnt[rows].max()) if rows else 0
        return Placement.from_phy2log(
            pl.phy2log[rows], pl.num_logical_experts, policy=pl.policy,
            num_groups=pl.num_groups, num_nodes=pl.num_nodes, num_gpus=pl.num_gpus,
            replica_rank=replica_rank(pl.log2phy[rows][:, :, :width], pl.num_physical_experts),  # keeps the order
        )


# ---- writing ------------------------------------------------------------------------------------------------------
def _full_rows(placement: Placement, layer_ids, num_model_layers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows to write [n, P], model layer of each written row, written row of each placement row)."""
    ids = np.arange(placement.num_layers) if layer_ids is None else np.asarray(layer_ids, dtype=np.int64)
    if ids.shape != (placement.num_layers,) or (ids < 0).any() or np.unique(ids).size != ids.size:
        raise InputError(f"layer_ids must be {placement.num_layers} distinct non-negative layer indices")
    if num_model_layers is None:
        return placement.phy2log, ids, np.arange(placement.num_layers)
    if num_model_layers <= ids.max():
        raise InputError(f"num_model_layers ({num_model_layers}) must exceed the largest layer id ({ids.max()})")
    rows = np.tile(np.arange(placement.num_physical_experts) % placement.num_logical_experts, (num_model_layers, 1))
    rows[ids] = placement.phy2log
    return rows, np.arange(num_model_layers), ids


def render_placement(
    placement: Placement,
    format: str = "fdeplb",
    *,
    layer_ids=None,
    num_model_layers: int | None = None,
    load_digest: str | None = None,
    expert_load=None,
    meta_file_name: str = "",
) -> str:
    """The text of ``placement`` as a placement file in one of :data:`FORMATS` (what :func:`write_placement`
    writes; JSON, or YAML for "trtllm"), ending in a newline.

    Args:
        layer_ids: model layer index of every row (default 0..L-1).
        num_model_layers: "sglang"/"fastdeploy": write this many rows, the trivial placement for the layers not in
            ``layer_ids`` (dense layers).
        load_digest: "fdeplb": digest of the load the plan came from (:func:`fdeplb.placement.load_digest`).
        expert_load: "fastdeploy": [L, E] loads for ``tokens_per_expert_stats_list`` (zeros when omitted).
        meta_file_name: "fastdeploy": the ``meta_file_name`` field (the file's own path when written).

    Raises:
        InputError: unknown format or inconsistent layer_ids / num_model_layers / expert_load.
    """
    if format not in FORMATS:
        raise InputError(f"unknown placement file format {format!r}; choose one of {list(FORMATS)}")
    if format == "fdeplb":
        _, ids, _ = _full_rows(placement, layer_ids, None)
        doc = {
            "format": FDEPLB_FORMAT,
            "version": FDEPLB_VERSION,
            "policy": placement.policy,
            "num_logical_experts": placement.num_logical_experts,
            "num_physical_experts": placement.num_physical_experts,
            "num_groups": placement.num_groups,
            "num_nodes": placement.num_nodes,
            "num_gpus": placement.num_gpus,
            "layer_ids": ids.tolist(),
            "load_digest": load_digest,
            "phy2log": placement.phy2log.tolist(),
            "log2phy": placement.log2phy.tolist(),
            "logcnt": placement.logcnt.tolist(),
        }
        return json.dumps(doc, separators=(",", ":")) + "\n"
    elif format == "sglang":
        rows, _, _ = _full_rows(placement, layer_ids, num_model_layers)
        return json.dumps({"physical_to_logical_map": rows.tolist()}, separators=(",", ":")) + "\n"
    elif format == "trtllm":
        import yaml

        rows, ids, _ = _full_rows(placement, layer_ids, None)
        doc = {
            "num_slots": placement.num_physical_experts,
            "initial_global_assignments": {int(i): row.tolist() for i, row in zip(ids, rows)},
            "layer_updates_per_iter": 0,
        }
        return yaml.safe_dump(doc, default_flow_style=None, width=2**31 - 1, sort_keys=False)
    else:  # fastdeploy
        rows, _, where = _full_rows(placement, layer_ids, num_model_layers)
        E, P = placement.num_logical_experts, placement.num_physical_experts
        log2phy, logcnt = derive_maps(rows, E)
        width = P - E + 1  # FastDeploy sizes the last axis num_redundant_experts + 1
        padded = np.full((rows.shape[0], E, width), -1, dtype=np.int64)
        padded[:, :, : log2phy.shape[2]] = log2phy
        tokens = np.zeros((rows.shape[0], E), dtype=np.int64)
        if expert_load is not None:
            load = np.asarray(expert_load)
            if load.shape != (placement.num_layers, E):
                raise InputError(f"expert_load has shape {load.shape}, expected {(placement.num_layers, E)}")
            tokens = np.zeros((rows.shape[0], E), dtype=load.dtype)
            tokens[where] = load
        doc = {
            "update_timestamp": time.time(),
            "tokens_per_expert_stats_list": tokens.tolist(),
            "ep_rank_to_expert_id_list": rows.tolist(),
            "expert_id_to_ep_rank_array": padded.tolist(),
            "expert_in_rank_num_list": logcnt.tolist(),
            "cost_milliseconds": 0,
            "meta_file_name": meta_file_name,
        }
        return json.dumps(doc) + "\n"


def write_placement(
    placement: Placement,
    path: str | Path,
    *,
    format: str = "fdeplb",
    layer_ids=None,
    num_model_layers: int | None = None,
    load_digest: str | None = None,
    expert_load=None,
) -> Path:
    """Write ``placement`` to ``path`` in one of :data:`FORMATS` (the text of :func:`render_placement`, by
    :func:`save_placement_text`: gzip when the name ends in ``.gz``); returns the path. ``layer_ids``,
    ``num_model_layers``, ``load_digest`` and ``expert_load`` as for :func:`render_placement`; ``meta_file_name`` is
    the file's own path.

    Raises:
        InputError: unknown format, a name that says another kind than the format's (:func:`check_placement_path`),
            or inconsistent layer_ids / num_model_layers / expert_load; nothing written.
        PlacementFileError: the file cannot be written.
    """
    p = Path(path)
    check_placement_path(p, format)
    return save_placement_text(p, render_placement(
        placement, format, layer_ids=layer_ids, num_model_layers=num_model_layers, load_digest=load_digest,
        expert_load=expert_load, meta_file_name=str(p)), format)


def _what(format: str) -> str:
    return f"{'an' if format == 'fdeplb' else 'a'} {format} placement"


def _kind(format: str) -> str:
    if format not in FORMATS:
        raise InputError(f"unknown placement file format {format!r}; choose one of {list(FORMATS)}")
    return "yaml" if format == "trtllm" else "json"


def check_placement_path(path, format: str, flag: str | None = None) -> None:
    """Before any work: :class:`InputError` unless the name of ``path`` says the kind of text ``format`` is: a
    "trtllm" placement is YAML, named ``*.yaml``/``*.yml``; the others are JSON and not named so (the readers tell
    YAML by the name, :func:`fdeplb.placement.documents.document_kind`; ``.gz`` may follow either). The message
    starts with ``flag`` and the path when given (e.g. ``--out``)."""
    check_document_name(path, _kind(format), _what(format), None if flag is None else f"{flag} {path}")


def save_placement_text(path, text: str, format: str, flag: str | None = None) -> Path:
    """Write ``text`` (:func:`render_placement`'s, in ``format``) to ``path`` with
    :func:`fdeplb.placement.documents.write_document` (gzip when named ``*.gz``); returns the path.

    Raises:
        InputError: the name says another kind than ``format`` (:func:`check_placement_path`); nothing written.
        PlacementFileError: the file cannot be written.
    """
    return write_document(path, text, kind=_kind(format), what=_what(format),
                          label=None if flag is None else f"{flag} {path}", error=PlacementFileError)


# ---- reading ------------------------------------------------------------------------------------------------------
def _fail(p: Path, msg: str) -> PlacementFileError:
    return PlacementFileError(f"{p}: {msg}")


def _int_rows(p: Path, rows, key: str) -> np.ndarray:
    arr = number_table(p, rows, key, PlacementFileError)
    if arr.dtype.kind not in "iu" or arr.ndim != 2:
        raise _fail(p, f"'{key}' must be a 2-D list of integer expert ids (got {arr.dtype}, shape {arr.shape})")
    return arr.astype(np.int64)


def read_placement(
    path: str | Path,
    *,
    num_logical_experts: int | None = None,
    num_gpus: int | None = None,
    num_groups: int | None = None,
    num_nodes: int | None = None,
    num_physical_experts: int | None = None,
) -> PlacementFile:
    """Read a placement file in any of :data:`FORMATS` (detected from the content; ``.yaml``/``.yml`` = trtllm).

    Topology arguments fill in what the format does not store (SGLang and TensorRT-LLM files have no topology;
    ``num_logical_experts`` defaults to the largest id + 1) and are checked against what it does.
    ``num_physical_experts`` (slots per layer), when given, and an fdeplb header's are checked against the rows'
    length before what the rows hold (a cut plan is named as such, not by the first expert it lost).

    Raises:
        PlacementFileError: missing/unreadable file, bad JSON/YAML, unknown layout or fdeplb version, ragged or non-integer rows
            (booleans too), rows of another length than ``num_physical_experts``, an expert without a slot, maps
            inconsistent with phy2log, or a topology that does not fit.
    """
    p = Path(path)
    doc = read_document(p, PlacementFileError, "placement file")
    if not isinstance(doc, dict):
        raise _fail(p, f"expected a mapping at the top level, got {type(doc).__name__}")
    digest = None
    stored = {}
    if doc.get("format") == FDEPLB_FORMAT:
        fmt = "fdeplb"
        if doc.get("version") != FDEPLB_VERSION or isinstance(doc.get("version"), bool):
            raise _fail(p, f"{FDEPLB_FORMAT} version {str(doc.get('version'))[:20]!r}; this fdeplb reads version "
                           f"{FDEPLB_VERSION}")
        phy2log = _int_rows(p, doc.get("phy2log"), "phy2log")
        ids = np.asarray(doc.get("layer_ids", list(range(phy2log.shape[0]))))
        digest = doc.get("load_digest")
        for key in ("num_logical_experts", "num_physical_experts", "num_gpus", "num_groups", "num_nodes"):
            if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool):
                raise _fail(p, f"'{key}' must be an integer")
            stored[key] = doc[key]
    elif "physical_to_logical_map" in doc:
        fmt = "sglang"
        phy2log = _int_rows(p, doc["physical_to_logical_map"], "physical_to_logical_map")
        ids = np.arange(phy2log.shape[0])
    elif "ep_rank_to_expert_id_list" in doc:
        fmt = "fastdeploy"
        phy2log = _int_rows(p, doc["ep_rank_to_expert_id_list"], "ep_rank_to_expert_id_list")
        ids = np.arange(phy2log.shape[0])
        cnt = doc.get("expert_in_rank_num_list")
        if isinstance(cnt, list) and cnt and isinstance(cnt[0], list):
            stored["num_logical_experts"] = len(cnt[0])
    elif "initial_global_assignments" in doc:
        fmt = "trtllm"
        assignments = doc["initial_global_assignments"]
        if not isinstance(assignments, dict) or not assignments:
            raise _fail(p, "'initial_global_assignments' must map layer index -> list of expert ids")
        try:
            ids = np.array(sorted(int(k) for k in assignments))
        except (TypeError, ValueError):
            raise _fail(p, "layer keys of 'initial_global_assignments' must be integers") from None
        phy2log = _int_rows(p, [assignments[k] for k in sorted(assignments, key=int)], "initial_global_assignments")
        if doc.get("num_slots") not in (None, phy2log.shape[1]):
            raise _fail(p, f"num_slots ({doc['num_slots']}) != length of the assignments ({phy2log.shape[1]})")
    else:
        raise _fail(p, f"unknown placement layout (keys: {sorted(doc)[:10]})")
    given = {"num_logical_experts": num_logical_experts, "num_physical_experts": num_physical_experts,
             "num_gpus": num_gpus, "num_groups": num_groups, "num_nodes": num_nodes}
    for key, value in given.items():
        if value is not None and key in stored and stored[key] != value:
            raise _fail(p, f"{key} is {stored[key]} in the file, {value} was expected")
    topo = {**stored, **{k: v for k, v in given.items() if v is not None}}
    if topo.get("num_physical_experts", phy2log.shape[1]) != phy2log.shape[1]:  # the shape before the content
        raise _fail(p, f"rows of {phy2log.shape[1]} slots (shape {phy2log.shape}), {topo['num_physical_experts']} "
                       f"slots per layer (num_physical_experts) expected")
    E = topo.get("num_logical_experts", int(phy2log.max()) + 1 if phy2log.size else 1)
    try:
        placement = Placement.from_phy2log(
            phy2log, E, policy=str(doc.get("policy", "file")), num_groups=topo.get("num_groups", 1),
            num_nodes=topo.get("num_nodes", 1), num_gpus=topo.get("num_gpus", 1),
        )
    except InputError as exc:
        raise _fail(p, str(exc)) from None
    if fmt == "fdeplb":
        if doc.get("logcnt") != placement.logcnt.tolist():
            raise _fail(p, "log2phy/logcnt do not match phy2log")
        if doc.get("log2phy") != placement.log2phy.tolist():  # a policy's own replica order ("deepseek") is kept
            try:
                given = np.array(doc.get("log2phy"), dtype=np.int64)
                P = placement.num_physical_experts
                if given.shape != placement.log2phy.shape or not ((given >= -1) & (given < P)).all():
                    raise InputError("log2phy shape or slot ids")
                placement = Placement.from_phy2log(
                    placement.phy2log, E, policy=placement.policy, num_groups=placement.num_groups,
                    num_nodes=placement.num_nodes, num_gpus=placement.num_gpus,
                    replica_rank=replica_rank(given, placement.num_physical_experts),
                )
            except (InputError, ValueError, TypeError):
                raise _fail(p, "log2phy/logcnt do not match phy2log") from None
            if doc.get("log2phy") != placement.log2phy.tolist():
                raise _fail(p, "log2phy/logcnt do not match phy2log")
    if ids.shape != (placement.num_layers,):
        raise _fail(p, f"layer_ids has {ids.size} entries for {placement.num_layers} rows")
    ids = ids.astype(np.int64)
    ids.setflags(write=False)
    return PlacementFile(placement, ids, fmt, str(p), digest)
