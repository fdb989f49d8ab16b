"""Replay an exported audit (JSONL, one audit record a line) through the machine tables.

DESIGN.md section 4: the audit stream is complete, and replaying it through the tables must reproduce every state
and every plan. :func:`replay` drives one ``transitions`` machine per record key (built from the table exactly as a
live commit builds it, see :mod:`fdeplb.machines.model`) and checks, for every record in order:

- its stream id is after the previous record's (the export is in stream order);
- ``from`` is the state the replay holds for that key (the table's initial state for a key not seen yet);
- ``trigger`` is legal from that state and reaches ``to`` (per the table);
- ``version`` is the key's previous version + 1 (1 for a new key): no gap, no repeat.

Records whose trigger is ``alarm`` are not transitions (a raised alarm leaves the record as it is) and are skipped.
:func:`check_plans` then recomputes every ``load`` transition's plan from the snapshot stored in Redis and checks
that it reproduces the stored plan_id and ``new_phy2log`` (placement is deterministic).

The first inconsistency raises :class:`ReplayError` naming the line, the stream id and the key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from fdeplb.errors import CorruptRecordError, IllegalTransitionError, InputError
from fdeplb.machines.model import RecordModel, build_machine
from fdeplb.machines.tables import CLUSTER, TABLES, Effect, MachineTable, TransitionSpec

#: fields every exported audit record must have
REQUIRED = ("machine", "key", "from", "to", "trigger", "version")
#: triggers that are audited but are not transitions
NOT_TRANSITIONS = frozenset({"alarm"})


class ReplayError(InputError):
    """An exported audit that does not replay through the tables (or whose plans do not reproduce)."""

    code = "replay_mismatch"


@dataclass(frozen=True)
class AuditLine:
    """One parsed line of an export: its 1-based ``line`` number and the record as a dict."""

    line: int
    record: dict[str, Any]

    @property
    def where(self) -> str:
        rid = self.record.get("id")
        return f"line {self.line}" + (f" (audit id {rid})" if rid else "")


@dataclass
class KeyState:
    """What the replay holds for one record key: its machine, state, FastDeploy code and version."""

    machine: str
    key: str
    state: str
    code: int
    version: int
    transitions: int = 0
    last_trigger: str = ""
    last_id: str = ""


@dataclass(frozen=True)
class LoadedPlan:
    """A ``load`` transition seen by the replay: its plan, round, and the plan committed before it."""

    where: str
    plan_id: str
    round: int
    previous_plan_id: str


@dataclass
class ReplayReport:
    """Outcome of a replay: counts, the final state of every key, and the ``load`` plans to check."""

    records: int = 0
    transitions: int = 0
    skipped: int = 0
    final: dict[str, KeyState] = field(default_factory=dict)
    plans: list[LoadedPlan] = field(default_factory=list)
    plans_checked: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "transitions": self.transitions, "skipped": self.skipped,
                "final": {k: asdict(v) for k, v in self.final.items()},
                "plans": [p.plan_id for p in self.plans], "plans_checked": list(self.plans_checked)}


# ---- reading -------------------------------------------------------------------------------------------------------
#: longest audit line accepted (a record is a few hundred bytes; this stops a runaway read of a non-JSONL file)
MAX_LINE_BYTES = 64 * 1024


def parse_lines(lines: Iterable[str]) -> Iterator[AuditLine]:
    """Parse JSONL audit lines (blank lines skipped); :class:`ReplayError` names the first bad line."""
    for n, text in enumerate(lines, start=1):
        if len(text) > MAX_LINE_BYTES:
            raise ReplayError(f"line {n}: longer than {MAX_LINE_BYTES} characters; not an audit export")
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReplayError(f"line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ReplayError(f"line {n}: expected a JSON object, got {type(record).__name__}")
        missing = [f for f in REQUIRED if f not in record]
        if missing:
            raise ReplayError(f"line {n}: audit record without {', '.join(missing)}")
        yield AuditLine(n, record)


def read_export(path: str | Path) -> Iterator[AuditLine]:
    """The parsed lines of an exported audit file; :class:`InputError` if it cannot be read."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the generator below
    except OSError as exc:
        raise InputError(f"cannot read audit export {path}: {exc.strerror}") from None
    with handle:
        # readline(limit) never holds more than one bounded chunk, even for a file without newlines (/dev/zero)
        yield from parse_lines(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), ""))


def _int(line: AuditLine, name: str) -> int:
    value = line.record.get(name, "")
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and not value.strip().lstrip("-").isdigit()):
        raise ReplayError(f"{line.where}: {name} is not an integer: {value!r}")  # 1.5, true, [] ...
    return int(value)


def _stream_id(line: AuditLine) -> tuple[int, int] | None:
    rid = line.record.get("id")
    if rid in (None, ""):
        return None
    ms, _, seq = str(rid).partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ReplayError(f"{line.where}: not a stream id: {rid!r}") from None


# ---- replay --------------------------------------------------------------------------------------------------------
class _Replayed:
    """One key's ``transitions`` machine, fired without a store: the commit hook only notes the spec."""

    def __init__(self, table: MachineTable, key: str) -> None:
        self.table = table
        self.spec: TransitionSpec | None = None
        self.model = RecordModel(table, key, table.initial, 0, self._commit)
        build_machine(table, self.model)

    def _commit(self, model: RecordModel, spec: TransitionSpec, _kwargs: dict[str, Any]) -> None:
        self.spec = spec
        model.version += 1

    def fire(self, trigger: str) -> str:
        return self.model.fire(trigger)


def replay(lines: Iterable[AuditLine]) -> ReplayReport:
    """Replay parsed audit lines through the tables; returns the report or raises :class:`ReplayError` at the
    first record that does not follow from the ones before it."""
    report = ReplayReport()
    machines: dict[str, _Replayed] = {}
    last_id: tuple[int, int] | None = None
    committed_plan = ""  # the cluster's current placement as the replay knows it ("" = initial placement)
    for line in lines:
        report.records += 1
        rec = line.record
        sid = _stream_id(line)
        if sid is not None:
            if last_id is not None and sid <= last_id:
                raise ReplayError(f"{line.where}: out of stream order (after {last_id[0]}-{last_id[1]})")
            last_id = sid
        if rec["trigger"] in NOT_TRANSITIONS:
            report.skipped += 1
            continue
        table = TABLES.get(rec["machine"])
        if table is None:
            raise ReplayError(f"{line.where}: unknown machine {rec['machine']!r}; expected one of "
                              f"{', '.join(TABLES)}")
        key = str(rec["key"])
        held = machines.get(key)
        if held is None:
            held = machines[key] = _Replayed(table, key)
        elif held.table is not table:
            raise ReplayError(f"{line.where}: key {key} is a {held.table.name} record, not {table.name}")
        model = held.model
        if rec["from"] != model.state:
            raise ReplayError(f"{line.where}: {key} is {model.state} v{model.version} in the replay, but the "
                              f"record says from {rec['from']}")
        version = _int(line, "version")
        if version != model.version + 1:
            raise ReplayError(f"{line.where}: {key} version gap: v{model.version} -> v{version} "
                              f"(expected v{model.version + 1})")
        try:
            table.spec(model.state, str(rec["trigger"]))  # the table's own words when the pair is illegal
            state = held.fire(str(rec["trigger"]))
        except IllegalTransitionError as exc:
            raise ReplayError(f"{line.where}: {exc}") from None
        if state != rec["to"]:
            raise ReplayError(f"{line.where}: {table.name} {rec['trigger']} goes {rec['from']} -> {state} per the "
                              f"table, but the record says -> {rec['to']}")
        report.transitions += 1
        final = report.final.get(key) or KeyState(table.name, key, state, 0, 0)
        report.final[key] = replace(final, state=state, code=table.to_code(state), version=model.version,
                                    transitions=final.transitions + 1, last_trigger=str(rec["trigger"]),
                                    last_id=str(rec.get("id", "")))
        if table is CLUSTER:
            if held.spec is not None and held.spec.trigger == "load":
                report.plans.append(LoadedPlan(line.where, str(rec.get("plan_id", "")),
                                               _int(line, "round"), committed_plan))
            if held.spec is not None and held.spec.effect is Effect.SET_PLACEMENT:
                committed_plan = str(rec.get("plan_id", ""))
    return report


def replay_file(path: str | Path) -> ReplayReport:
    """:func:`replay` of an exported audit file."""
    return replay(read_export(path))


# ---- plans ---------------------------------------------------------------------------------------------------------
def check_plans(store: Any, report: ReplayReport) -> list[str]:
    """Recompute every ``load`` plan of ``report`` from what ``store`` (a :class:`~fdeplb.store.Store`) holds and
    compare; returns the plan_ids checked.

    For each plan: the stored plan exists, its round and previous plan match the audit, its load snapshot is the
    round's frozen snapshot, :func:`~fdeplb.placement.plan_digest` of (snapshot, old placement, policy, topology)
    is the plan_id, and the coordinator's planner on that snapshot gives the stored ``new_phy2log``.
    Raises :class:`ReplayError` at the first plan that does not reproduce.
    """
    from fdeplb.orchestration.coordinator import default_planner
    from fdeplb.placement import plan_digest

    config = store.read_config()
    planner = default_planner
    new_of: dict[str, np.ndarray] = {}
    for plan in report.plans:
        where = f"{plan.where}: plan {plan.plan_id or '(empty)'} of round {plan.round}"
        try:
            stored = store.read_plan(plan.plan_id)
        except CorruptRecordError as exc:
            raise ReplayError(f"{where}: {exc}") from None
        if stored is None:
            raise ReplayError(f"{where}: not stored")
        load, old, new = stored.expert_load, stored.old_phy2log, stored.new_phy2log
        if not 0 < stored.round <= plan.round:  # a round that retries an aborted round's plan reuses it
            raise ReplayError(f"{where}: stored for round {stored.round}")
        # plans are content-addressed: a round that meets the same (snapshot, old placement) as an earlier one
        # reuses that plan, whose stored round and old_plan_id are the earlier one's; compare contents instead
        if plan.previous_plan_id in new_of and not np.array_equal(old, new_of[plan.previous_plan_id]):
            raise ReplayError(f"{where}: old_phy2log is not plan {plan.previous_plan_id}'s new_phy2log")
        snapshot = store.read_snapshot(plan.round)
        if snapshot is not None and not np.array_equal(snapshot, load):
            raise ReplayError(f"{where}: expert_load differs from round {plan.round}'s snapshot")
        policy = stored.policy or config.policy
        digest = plan_digest(load, old, policy, stored.topology)
        if digest != plan.plan_id:
            raise ReplayError(f"{where}: (snapshot, old placement, policy, topology) hash to {digest}")
        if stored.topology != config.topology():
            raise ReplayError(f"{where}: planned for topology {stored.topology}, the cluster has "
                              f"{config.topology()}")
        if plan.plan_id in new_of:  # the same plan again (an aborted round retried): recomputed already
            report.plans_checked.append(plan.plan_id)
            continue
        again = np.asarray(planner(load, old, replace(config, policy=policy)), dtype=np.int64)
        if not np.array_equal(again, new):
            diff = int(np.count_nonzero(again != new))
            raise ReplayError(f"{where}: recomputing the {policy!r} plan gives a different new_phy2log "
                              f"({diff} of {new.size} slots differ)")
        new_of[plan.plan_id] = new
        report.plans_checked.append(plan.plan_id)
    return list(report.plans_checked)
