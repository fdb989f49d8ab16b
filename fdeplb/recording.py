"""Self-contained recordings: a cluster's audit exported as JSONL together with what replaying it needs.

A recording (schema :data:`SCHEMA`, documented in ``docs/recordings.md``) is one JSON object a line, each with a
``type``:

- ``header`` (first line): schema version, fdeplb version, cluster id, cluster configuration (as it was at the end
  of the exported range: the ``config_changed`` notes after it undone; the replay checks it against the range's
  notes and records, :mod:`fdeplb.replay.header_checks`), topology, policy, the exported range, and the ``start``
  of that range: the audit chain before its first record, the current placement
  and every machine record's (state, version, plan_id) then; ``contents`` lists the snapshots and plans that follow
  and ``missing`` those the records refer to that Redis no longer held (pruned) when the export ran;
- ``audit``: one audit record, in stream order (``id`` and every field of the stream entry; version, round and
  ts_ms as integers);
- ``snapshot``: the load snapshot of a round the records name (``round``, ``expert_load``; ``source_load``, the
  snapshot per source rank, where the cluster kept it);
- ``plan``: a plan a ``load`` transition names (every field of :class:`~fdeplb.store.PlanEntry`).

Arrays are ``{"dtype": "int64", "shape": [..], "data": [flat values, C order]}`` (:mod:`fdeplb.array_json`).
:func:`export_recording` writes one from a live cluster; :mod:`fdeplb.replay` reads and replays it with no Redis.
The format's definitions (:data:`SCHEMA`, :data:`INT_FIELDS`, the line models) are those of its reader,
:mod:`fdeplb.replay.recording_format`; the start of an exported range is :func:`fdeplb.replay.start_state.state_at`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from fdeplb.array_json import array_json
from fdeplb.errors import InputError
from fdeplb.machines.tables import CLUSTER
from fdeplb.replay.header_checks import config_before
from fdeplb.replay.start_state import state_at
from fdeplb.replay.recording_format import INT_FIELDS, SCHEMA

__all__ = ["INT_FIELDS", "SCHEMA", "audit_dict", "export_recording"]


def audit_dict(entry) -> dict[str, Any]:
    """An audit entry (:class:`~fdeplb.store.AuditRecord`) as a JSON-ready dict: ``id`` first, then its fields in
    stream order; version, round and ts_ms as ints."""
    out: dict[str, Any] = {"id": entry.id}
    for name, value in entry.fields.items():
        out[name] = int(value) if name in INT_FIELDS and value.lstrip("-").isdigit() else value
    return out


def export_recording(store, path: str | Path, round_: int | None = None) -> dict[str, int]:
    """Write ``store``'s cluster (a :class:`~fdeplb.store.Store`) as a recording to ``path``, atomically (a
    temporary file renamed into place). With ``round_``, the contiguous stretch of the audit from the first to the
    last record of that round (records of other machines in between included, so its chain verifies).

    Returns counts {records, snapshots, plans, missing}. Raises :class:`InputError` if the file cannot be written
    or the round has no records, and the store's errors.
    """
    from fdeplb import __version__

    config, entries = _config_and_audit(store)
    if round_ is not None:
        picked = [i for i, e in enumerate(entries) if e["round"] == str(round_)]
        if not picked:
            raise InputError(f"cluster {store.cluster!r} has no audit records of round {round_}")
        first, last = picked[0], picked[-1] + 1
    else:
        first, last = 0, len(entries)
    begin = state_at(entries[:first], config.ep_size)  # every record where the exported range starts
    placement_plan = begin.placement_plan
    picked = entries[first:last]
    config = config_before(config, entries[last:])  # at the range's end: the header is checked against its notes

    rounds = sorted({int(e["round"]) for e in picked if e["round"].isdigit() and int(e["round"]) > 0})
    plan_ids = list(dict.fromkeys(e["plan_id"] for e in picked
                                  if e["machine"] == CLUSTER.name and e["trigger"] == "load" and e["plan_id"]))
    if placement_plan and placement_plan not in plan_ids:
        plan_ids.insert(0, placement_plan)
    snapshots = {r: s for r in rounds if (s := store.read_snapshot(r)) is not None}
    splits = {r: s for r in snapshots if (s := store.read_source_load(r)) is not None}
    plans = {p: plan for p in plan_ids if (plan := store.read_plan(p)) is not None}
    start_placement = _start_placement(store, entries[first:], placement_plan, plans)

    header = {
        "type": "header", "schema": SCHEMA, "fdeplb_version": __version__, "cluster": store.cluster,
        "exported_ms": store.now_ms(), "config": config.to_json(), "topology": config.topology(),
        "policy": config.policy,
        "range": {"round": round_, "first_id": picked[0].id if picked else None,
                  "last_id": picked[-1].id if picked else None},
        "start": {"chain": begin.chain, "records": begin.records, "placement": start_placement,
                  "generation": begin.generation},
        "contents": {"records": len(picked), "snapshots": list(snapshots), "plans": list(plans)},
        "missing": {"snapshots": [r for r in rounds if r not in snapshots],
                    "plans": [p for p in plan_ids if p not in plans]},
    }
    lines: list[dict[str, Any]] = [header]
    lines += [{"type": "audit", **audit_dict(e)} for e in picked]
    lines += [{"type": "snapshot", "round": r, "expert_load": array_json(s),
               **({"source_load": array_json(splits[r])} if r in splits else {})} for r, s in snapshots.items()]
    lines += [{"type": "plan", **p.to_json()} for p in plans.values()]
    _write_lines(Path(path), lines)
    return {"records": len(picked), "snapshots": len(snapshots), "plans": len(plans),
            "missing": len(header["missing"]["snapshots"]) + len(header["missing"]["plans"])}


def _config_and_audit(store, tries: int = 3) -> tuple[Any, list]:
    """The cluster's configuration and its whole audit, read so that they agree: the configuration read before
    and after the audit has the same version (a ``config set`` in between is retried, ``tries`` times at most;
    then :class:`InputError`)."""
    for _ in range(tries):
        config = store.read_config(fresh=True)
        entries = list(store.iter_audit())
        if store.read_config(fresh=True).version == config.version:
            return config, entries
    raise InputError(f"cluster {store.cluster!r}: its configuration changed during each of {tries} exports; "
                     f"export again")


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
