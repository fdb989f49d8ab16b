"""Self-contained recordings: a cluster's audit exported as JSONL together with what replaying it needs.

A recording (schema :data:`SCHEMA`, documented in ``docs/recordings.md``) is one JSON object a line, each with a
``type``:

- ``header`` (first line): schema version, fdeplb version, cluster id, cluster configuration, topology, policy, the
  exported range, and the ``start`` of that range: the audit chain before its first record, the current placement
  and every machine record's (state, version, plan_id) then; ``contents`` lists the snapshots and plans that follow
  and ``missing`` those the records refer to that Redis no longer held (pruned) when the export ran;
- ``audit``: one audit record, in stream order (``id`` and every field of the stream entry; version, round and
  ts_ms as integers);
- ``snapshot``: the load snapshot of a round the records name (``round``, ``expert_load``);
- ``plan``: a plan a ``load`` transition names (every field of :class:`~fdeplb.store.PlanEntry`).

Arrays are ``{"dtype": "int64", "shape": [..], "data": [flat values, C order]}``. :func:`export_recording` writes
one from a live cluster; :mod:`fdeplb.replay` reads and replays it with no Redis.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from fdeplb.errors import InputError, ReplayError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, Effect

#: version of the recording format written by this fdeplb (bumped on any incompatible change)
SCHEMA = 1
#: audit fields written as integers in JSON (the stream stores text; :func:`audit_dict`)
INT_FIELDS = ("version", "round", "ts_ms")


def array_json(a: np.ndarray) -> dict[str, Any]:
    """``a`` (int64) as ``{"dtype", "shape", "data"}`` with ``data`` flat in C order."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    return {"dtype": "int64", "shape": list(a.shape), "data": a.ravel().tolist()}


def array_from_json(value: Any, what: str) -> np.ndarray:
    """Inverse of :func:`array_json`; :class:`ReplayError` naming ``what`` for anything else."""
    if not isinstance(value, dict) or value.get("dtype") != "int64" or not isinstance(value.get("shape"), list) \
            or not isinstance(value.get("data"), list):
        raise ReplayError(f"{what}: not an int64 array object {{dtype, shape, data}}")
    shape = value["shape"]
    dims_ok = all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape)
    # math.prod on Python ints: a product above int64 cannot wrap round to the data's length
    if not dims_ok or math.prod(shape) != len(value["data"]):
        raise ReplayError(f"{what}: shape {shape} does not hold {len(value['data'])} values")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in value["data"]):
        raise ReplayError(f"{what}: values are not all integers")
    try:
        return np.asarray(value["data"], dtype=np.int64).reshape(shape)
    except OverflowError:
        raise ReplayError(f"{what}: a value does not fit int64") from None


def audit_dict(entry) -> dict[str, Any]:
    """An audit entry (:class:`~fdeplb.store.AuditRecord`) as a JSON-ready dict: ``id`` first, then its fields in
    stream order; version, round and ts_ms as ints."""
    out: dict[str, Any] = {"id": entry.id}
    for name, value in entry.fields.items():
        out[name] = int(value) if name in INT_FIELDS and value.lstrip("-").isdigit() else value
    return out


def _initial_records(ep_size: int) -> dict[str, dict[str, Any]]:
    out = {CLUSTER.name: {"state": CLUSTER.initial.value, "version": 0, "plan_id": ""}}
    for r in range(ep_size):
        for table in (RANK, WEIGHTS):
            out[f"{table.name}:{r}"] = {"state": table.initial.value, "version": 0, "plan_id": ""}
    return out


def export_recording(store, path: str | Path, round_: int | None = None) -> dict[str, int]:
    """Write ``store``'s cluster (a :class:`~fdeplb.store.Store`) as a recording to ``path``, atomically (a
    temporary file renamed into place). With ``round_``, the contiguous stretch of the audit from the first to the
    last record of that round (records of other machines in between included, so its chain verifies).

    Returns counts {records, snapshots, plans, missing}. Raises :class:`InputError` if the file cannot be written
    or the round has no records, and the store's errors.
    """
    from fdeplb import __version__

    config = store.read_config()
    entries = list(store.iter_audit())
    if round_ is not None:
        picked = [i for i, e in enumerate(entries) if e["round"] == str(round_)]
        if not picked:
            raise InputError(f"cluster {store.cluster!r} has no audit records of round {round_}")
        first, last = picked[0], picked[-1] + 1
    else:
        first, last = 0, len(entries)
    start = _initial_records(config.ep_size)
    head, placement_plan = "", ""
    for e in entries[:first]:  # the state of every record where the exported range starts
        head = e["chain"]
        if e["trigger"] == "alarm" or e["key"] not in start:
            continue
        start[e["key"]] = {"state": e["to"], "version": int(e["version"]), "plan_id": e["plan_id"]}
        if e["machine"] == CLUSTER.name and CLUSTER.spec(e["from"], e["trigger"]).effect is Effect.SET_PLACEMENT:
            placement_plan = e["plan_id"]
    picked = entries[first:last]

    rounds = sorted({int(e["round"]) for e in picked if e["round"].isdigit() and int(e["round"]) > 0})
    plan_ids = list(dict.fromkeys(e["plan_id"] for e in picked
                                  if e["machine"] == CLUSTER.name and e["trigger"] == "load" and e["plan_id"]))
    if placement_plan and placement_plan not in plan_ids:
        plan_ids.insert(0, placement_plan)
    snapshots = {r: s for r in rounds if (s := store.read_snapshot(r)) is not None}
    plans = {p: plan for p in plan_ids if (plan := store.read_plan(p)) is not None}
    start_placement = _start_placement(store, entries[first:], placement_plan, plans)

    header = {
        "type": "header", "schema": SCHEMA, "fdeplb_version": __version__, "cluster": store.cluster,
        "exported_ms": store.now_ms(), "config": config.to_json(), "topology": config.topology(),
        "policy": config.policy,
        "range": {"round": round_, "first_id": picked[0].id if picked else None,
                  "last_id": picked[-1].id if picked else None},
        "start": {"chain": head, "records": start, "placement": start_placement},
        "contents": {"records": len(picked), "snapshots": list(snapshots), "plans": list(plans)},
        "missing": {"snapshots": [r for r in rounds if r not in snapshots],
                    "plans": [p for p in plan_ids if p not in plans]},
    }
    lines: list[dict[str, Any]] = [header]
    lines += [{"type": "audit", **audit_dict(e)} for e in picked]
    lines += [{"type": "snapshot", "round": r, "expert_load": array_json(s)} for r, s in snapshots.items()]
    lines += [_plan_json(p) for p in plans.values()]
    _write_lines(Path(path), lines)
    return {"records": len(picked), "snapshots": len(snapshots), "plans": len(plans),
            "missing": len(header["missing"]["snapshots"]) + len(header["missing"]["plans"])}


def _start_placement(store, rest: list, placement_plan: str, plans: dict) -> dict[str, Any] | None:
    """The current placement where the range starts: the first later commit's old placement, else (no commit
    since) the placement now, else (that plan was pruned) the committed plan's new placement, else unknown."""
    for e in rest:
        if e["machine"] == CLUSTER.name and e["trigger"] == "commit":
            plan = plans.get(e["plan_id"]) or store.read_plan(e["plan_id"])
            if plan is None:
                break
            return {"plan_id": plan.old_plan_id, "phy2log": array_json(plan.old_phy2log)}
    else:
        now = store.current_placement()
        return {"plan_id": now.plan_id, "phy2log": array_json(now.phy2log)}
    if placement_plan in plans:
        return {"plan_id": placement_plan, "phy2log": array_json(plans[placement_plan].new_phy2log)}
    return None


def _plan_json(plan) -> dict[str, Any]:
    return {"type": "plan", "plan_id": plan.plan_id, "round": plan.round, "policy": plan.policy,
            "old_plan_id": plan.old_plan_id, "topology": plan.topology,
            "balancedness_before": plan.balancedness_before, "balancedness_after": plan.balancedness_after,
            "moved_experts": plan.moved_experts, "expert_load": array_json(plan.expert_load),
            "old_phy2log": array_json(plan.old_phy2log), "new_phy2log": array_json(plan.new_phy2log)}


def _write_lines(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for obj in lines:
                fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc.strerror}") from None
