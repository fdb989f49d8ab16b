"""Rebuilding a replayed recording into a Redis: :func:`rebuild` writes the cluster as the replay left it
(configuration, records with their membership generation, placement, audit with its ids and chain, snapshots,
plans) through
:meth:`~fdeplb.store.Store.import_recording`.
"""

from __future__ import annotations

from typing import Any

from fdeplb.errors import InputError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP
from fdeplb.replay.recompute import Recorded
from fdeplb.replay.report import ReplayReport

__all__ = ["rebuild"]


def rebuild(report: ReplayReport, store: Any) -> int:
    """Write the replayed cluster into ``store`` (a :class:`~fdeplb.store.Store` whose cluster does not exist):
    configuration, every machine record at its replayed state and version, the current placement, the audit
    records (same ids and chain), snapshots and plans. Returns the number of audit records written.

    Raises :class:`InputError` for a recording without header or without its start placement, and
    :class:`~fdeplb.errors.StateError` if the cluster exists (nothing is written then).
    """
    source = Recorded(report)
    start = source.start_placement()
    if start is None:
        raise InputError("the recording does not hold its start placement (its plan was pruned): cannot rebuild")
    plan_id = report.placement_plan
    if plan_id == start[0]:
        phy2log = start[1]
    elif plan_id in report.stored_plans:
        phy2log = report.stored_plans[plan_id].new_phy2log
    else:
        raise InputError(f"the current placement's plan {plan_id} is not in the recording: cannot rebuild")
    records: dict[str, dict[str, str]] = {}
    for key, held in _final_records(report).items():
        records[key] = {"state": held[0], "version": str(held[1]), "plan_id": held[2]}
    records[CLUSTER.name]["round"] = str(report.cluster_round)
    for key, generation in _generations(report).items():  # the membership generation, as commit.lua left it
        records[key]["generation"] = generation
    commits = sum(1 for rec in report.audit if rec["machine"] == CLUSTER.name and rec["trigger"] == "commit")
    audit = [(rec["id"], {k: v for k, v in rec.items() if k not in ("type", "id")}) for rec in report.audit]
    store.import_recording(source.config, plan_id=plan_id, phy2log=phy2log, placement_version=commits,
                           records=records, audit=audit, audit_head=report.chain,
                           snapshots=report.snapshots, plans=list(report.stored_plans.values()),
                           source_loads=report.source_loads)
    return len(audit)


def _final_records(report: ReplayReport) -> dict[str, tuple[str, int, str]]:
    out: dict[str, tuple[str, int, str]] = {}
    header = report.header or {}
    for key, held in (header.get("start") or {}).get("records", {}).items():
        out[key] = (held["state"], int(held["version"]), held.get("plan_id", ""))
    for key, ks in report.final.items():
        out[key] = (ks.state, ks.version, ks.plan_id)
    return out


def _generations(report: ReplayReport) -> dict[str, str]:
    """The ``generation`` each record keeps: the cluster's (its last transition's, else the header's start) and,
    per member record, the one its last transition made; nothing for a recording that carries none."""
    out: dict[str, str] = {}
    start = ((report.header or {}).get("start") or {}).get("generation")
    if start is not None:
        out[CLUSTER.name] = str(start)
    for rec in report.audit:
        generation = rec.get("generation", "")
        if generation == "":
            continue
        out[CLUSTER.name] = generation
        if rec["machine"] == MEMBERSHIP.name:
            out[rec["key"]] = generation
    return out
