"""Where a stretch of the audit stream leaves a cluster's records: :func:`state_at`, the plain fold the exporter
(:func:`fdeplb.recording.export_recording`) writes as a recording header's ``start``. No checks: an export must work
on a stream that would not replay (that is :mod:`fdeplb.replay.machine_replay`'s job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, WEIGHTS, Effect

__all__ = ["NOT_TRANSITIONS", "StartState", "state_at"]

#: triggers that are audited but are not transitions
#: notes on a rank's record (any machine), not the cluster's: a new agent took the rank over from a dead process
#: (``takeover_dead_pid``), a corrupt record was rewritten as its last audited transition left it
#: (``record_repaired``), a rank loaded the placement of its cluster created again over it (``placement_loaded``);
#: the note's from / to / version are what the record holds after it
NOTES_ON_RANKS = frozenset({"takeover_dead_pid", "record_repaired", "placement_loaded"})
NOT_TRANSITIONS = frozenset({"alarm", "skip", "start_refused", "weights_cancelled", "request_cancelled",
                             "request_expired", "config_changed", *NOTES_ON_RANKS})


@dataclass(frozen=True)
class StartState:
    """Where a stretch of the audit leaves a cluster: ``records`` (record key -> ``{state, version, plan_id}``, a
    header's ``start.records``), ``chain`` (the chain of its last record, "" for none), ``placement_plan`` (the
    plan of its last cluster commit, "" for the initial placement) and ``generation`` (the cluster's membership
    generation: that of its last transition that carries one, 0 for none)."""

    records: dict[str, dict[str, Any]]
    chain: str
    placement_plan: str
    generation: int = 0


def state_at(entries: Iterable[Any], ep_size: int, start: StartState | None = None) -> StartState:
    """Every record of a cluster of ``ep_size`` ranks after ``entries``: audit records from the stream's start (or
    from ``start``, e.g. a recording header's start state), in order, each read by field name as text
    (:class:`~fdeplb.store.AuditRecord` or an exported line's dict: a missing field reads ""). A plain
    fold, no checks: a transition's key takes its ``to``, version and plan_id, and its ``generation`` (when it is
    a decimal) is the cluster's; a note (:data:`NOT_TRANSITIONS`) leaves the records as they are, but for a
    ``record_repaired`` one (the record as the note says); a key that is not a record of the cluster is passed
    over; a cluster transition whose effect sets the placement (the commit) makes its plan the placement."""
    records = {CLUSTER.name: {"state": CLUSTER.initial.value, "version": 0, "plan_id": ""}}
    for r in range(ep_size):
        for table in (RANK, WEIGHTS, MEMBERSHIP):
            records[f"{table.key_label}:{r}"] = {"state": table.initial.value, "version": 0, "plan_id": ""}
    chain, placement_plan, generation = "", "", 0
    if start is not None:
        records.update({k: dict(v) for k, v in start.records.items()})
        chain, placement_plan, generation = start.chain, start.placement_plan, start.generation
    for e in entries:
        chain = e["chain"]
        if (e["trigger"] in NOT_TRANSITIONS and e["trigger"] != "record_repaired") or e["key"] not in records:
            continue  # a repair leaves the record as its note says (what the audit left, or excluded)
        records[e["key"]] = {"state": e["to"], "version": int(e["version"]), "plan_id": e["plan_id"]}
        made = str(_field(e, "generation"))
        if made.isascii() and made.isdigit():
            generation = int(made)
        if e["machine"] == CLUSTER.name and CLUSTER.spec(e["from"], e["trigger"]).effect is Effect.SET_PLACEMENT:
            placement_plan = e["plan_id"]
    return StartState(records, chain, placement_plan, generation)


def _field(entry: Any, name: str) -> Any:
    """``entry[name]``, "" when it has none (an AuditRecord reads "" for a missing field; a dict raises)."""
    try:
        return entry[name]
    except KeyError:
        return ""
