"""The machine replay: an audit stretch driven through the machine tables with no Redis, one ``transitions``
machine per record key (built from the table exactly as a live commit builds it, see
:mod:`fdeplb.machines.model`), every record checked against the ones before it (the list is the package's
docstring, :mod:`fdeplb.replay`); and :func:`chain_of`, the Python side of the audit chain.

The membership generation and the routing of committed plans are :mod:`fdeplb.replay.membership_checks`'; the
weight requests and the cancel transitions' ``withdrawn`` guard :mod:`fdeplb.replay.weight_requests`'; the
exporter's start state (no checks) :mod:`fdeplb.replay.start_state`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from fdeplb.errors import IllegalTransitionError, InputError, ReplayError
from fdeplb.machines.model import RecordModel, build_machine
from fdeplb.machines.tables import (
    CLUSTER,
    MEMBERSHIP,
    RANK,
    TABLE_OF_LABEL,
    TABLES,
    WEIGHTS,
    Effect,
    Guard,
    GuardKind,
    MachineTable,
    TransitionSpec,
)
from fdeplb.replay.header_checks import check_settings
from fdeplb.replay.membership_checks import Generations
from fdeplb.replay.reason_checks import RecordSays
from fdeplb.replay.recording_format import (AuditLine, HeaderLine, SnapshotLine, decimal_text, field_int,
                                            read_export)
from fdeplb.replay.report import KeyState, LoadedPlan, ReplayReport, RoundSeen
from fdeplb.replay.start_state import NOT_TRANSITIONS
from fdeplb.replay.weight_requests import WeightRequests
from fdeplb.store import ClusterConfig
from fdeplb.store.scripts import audit_chain
from fdeplb.store.streams import parse_stream_id

if TYPE_CHECKING:
    from fdeplb.store import PlanEntry

__all__ = ["CHAIN_EXCLUDED", "chain_of", "replay", "replay_file"]
#: fields of an exported audit line that the chain does not cover (the line type, the stream id, the chain itself)
CHAIN_EXCLUDED = frozenset({"type", "id", "chain"})


def chain_of(previous: str, fields: Mapping[str, Any]) -> str:
    """The audit chain of a record: SHA-1 hex of ``previous`` (the predecessor's chain, "" for the first record),
    a newline, then for every field but ``type``/``id``/``chain``, by name in byte order,
    ``name=<byte length of value>:value`` and a newline (:func:`fdeplb.store.scripts.audit_chain`, the one Python
    definition; ``commit.lua`` and ``audit.lua`` compute the same with ``redis.sha1hex``). Values are the stream's
    text; an integer (an export's version, round, ts_ms) hashes as its decimal text
    (:func:`~fdeplb.replay.recording_format.decimal_text`); anything else is a :class:`ReplayError`.
    """
    texts = {}
    for name in sorted((n for n in fields if n not in CHAIN_EXCLUDED), key=str.encode):  # first bad one named
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ReplayError(f"field {name} is {type(value).__name__}, not text")
        texts[name] = decimal_text(value)
    return audit_chain(previous, texts)


def _stream_id(line: AuditLine) -> tuple[int, int] | None:
    rid = line.record.get("id")
    if rid in (None, ""):
        return None
    try:
        sid = parse_stream_id(rid)
    except InputError:
        raise ReplayError(f"{line.where}: not a stream id: {rid!r}") from None
    if sid == (0, 0):
        raise ReplayError(f"{line.where}: stream id 0-0, which Redis never assigns (ids start after it)")
    return sid


def _fence(line: AuditLine) -> tuple[int, str]:
    fence = line.record.get("fence", "")
    n, sep, holder = fence.partition(":")
    if not sep or not n.isdigit() or not holder:
        raise ReplayError(f"{line.where}: cluster record with fence {fence!r}; a coordinator commits with its "
                          f"lease <n>:<holder>")
    return int(n), holder


# ---- replay --------------------------------------------------------------------------------------------------------
class _Replayed:
    """One key's ``transitions`` machine, fired without a store: the commit hook only notes the spec."""

    def __init__(self, table: MachineTable, key: str, state: str, version: int, plan_id: str = "") -> None:
        self.table = table
        self.spec: TransitionSpec | None = None
        self.plan_id = plan_id
        self.model = RecordModel(table, key, table.state(state), version, self._commit)
        build_machine(table, self.model)

    def _commit(self, model: RecordModel, spec: TransitionSpec, _kwargs: dict[str, Any]) -> None:
        self.spec = spec
        model.version += 1

    def fire(self, trigger: str) -> str:
        return self.model.fire(trigger)


class _Replay(RecordSays):
    """The state of one replay: every key's machine, the fence, the chain, the current placement's plan."""

    def __init__(self, report: ReplayReport, until: str | None) -> None:
        self.report = report
        self.until = until
        self.until_at = None if until is None else _until(until)
        self.machines: dict[str, _Replayed] = {}
        self.ep_size: int | None = None
        self.last_id: tuple[int, int] | None = None
        self.fence: tuple[int, str] | None = None
        self.chain: str | None = None  # None: no record carried a chain yet (and no header gave the start)
        self.stopped = False
        self.stored_at: list[tuple[str, str]] = []  # (where, plan_id) of plan_stored guards, checked at the end
        self.cordoned = False
        self.placement_known = True  # False while the header's start placement was pruned and no commit since
        self.refused: tuple[str, dict[int, int]] | None = None  # (where, stale ranks) of the refusal in force
        self.schema = 1  # the header's schema (1 for a header-less export: reasons in text only)
        self.num_logical_experts: int | None = None
        self.generations = Generations()
        self.plan_generations: dict[str, tuple[int, int]] = {}  # plan_id -> (generation, line) of its plan line
        self.weight_requests = WeightRequests(self._request_of)

    # ---- header ----------------------------------------------------------------------------------------------
    def header(self, line: AuditLine) -> None:
        """The header (its types checked by the reader, :class:`~fdeplb.replay.recording_format.HeaderLine`):
        the cluster's configuration and every record's state where the recording starts."""
        header: HeaderLine = line.value
        if self.report.header is not None or self.report.records:
            raise ReplayError(f"line {line.line}: a header must be the first line, and only one")
        try:
            config = ClusterConfig.from_json(header.config)
        except InputError as exc:
            raise ReplayError(f"line {line.line}: not a recording header: {exc}") from None
        self.ep_size = config.ep_size
        self.cordoned = config.cordoned
        self.schema = header.schema_version
        self.num_logical_experts = config.num_logical_experts
        self.generations = Generations(header.start.generation)
        for key, held in header.start.records.items():
            table = self._table_of(line, key)
            try:
                self.machines[key] = _Replayed(table, key, held.state, held.version, held.plan_id)
            except InputError as exc:
                raise ReplayError(f"line {line.line}: start record {key}: {exc}") from None
        self.chain = header.start.chain
        self.report.chain = self.chain
        placement = header.start.placement
        self.report.placement_plan = placement.plan_id if placement is not None else ""
        self.placement_known = placement is not None
        self.report.header = line.record

    def _restart(self, line: AuditLine, table: MachineTable, key: str, state: str, version: int) -> None:
        """Hold ``key`` in ``state`` at ``version`` from ``line`` on (a member record an audited repair excluded:
        :meth:`RecordSays._note`), as a record of the report's final states too."""
        self.machines[key] = _Replayed(table, key, state, version)
        final = self.report.final.get(key) or KeyState(table.name, key, state, 0, 0)
        self.report.final[key] = replace(final, state=state, code=table.to_code(table.state(state)), version=version,
                                         last_trigger=line.record["trigger"], last_id=line.record.get("id", ""))

    def _table_of(self, line: AuditLine, key: str, machine: str | None = None) -> MachineTable:
        name, sep, idx = key.partition(":")
        table = TABLES.get(machine) if machine is not None else TABLE_OF_LABEL.get(name)
        if table is None:
            raise ReplayError(f"{line.where}: unknown machine {machine or name!r}; expected one of "
                              f"{', '.join(TABLES)}")
        if table is CLUSTER:
            ok = key == CLUSTER.name
        else:
            ok = name == table.key_label and sep == ":" and idx.isdigit() and (
                self.ep_size is None or int(idx) < self.ep_size)
        if not ok:
            held = self.machines.get(key)
            if held is not None and held.table is not table:
                raise ReplayError(f"{line.where}: key {key} is a {held.table.name} record, not {table.name}")
            ranks = "" if self.ep_size is None else f" (ranks 0..{self.ep_size - 1})"
            raise ReplayError(f"{line.where}: {key!r} is not a {table.name} record of this cluster{ranks}")
        return table

    def held(self, line: AuditLine, table: MachineTable, key: str) -> _Replayed:
        held = self.machines.get(key)
        if held is None:
            held = self.machines[key] = _Replayed(table, key, table.initial, 0)
        elif held.table is not table:
            raise ReplayError(f"{line.where}: key {key} is a {held.table.name} record, not {table.name}")
        return held

    # ---- audit records ---------------------------------------------------------------------------------------
    def audit(self, line: AuditLine) -> None:
        report, rec = self.report, line.record
        report.records += 1
        sid = _stream_id(line)
        if sid is not None:
            if self.last_id is not None and sid <= self.last_id:
                raise ReplayError(f"{line.where}: out of stream order (after {self.last_id[0]}-{self.last_id[1]})")
            self.last_id = sid
        key = rec["key"]
        table = self._table_of(line, key, rec["machine"])
        held = self.held(line, table, key)
        model = held.model
        if rec["trigger"] in NOT_TRANSITIONS:
            self._note(line, table, held.model.state, held.model.version)
            self._chain(line)
            report.skipped += 1
            report.audit.append(rec)
            return
        if rec["from"] != model.state:
            raise ReplayError(f"{line.where}: {key} is {model.state} v{model.version} in the replay, but the "
                              f"record says from {rec['from']}")
        version = field_int(line, "version")
        if version != model.version + 1:
            raise ReplayError(f"{line.where}: {key} version gap: v{model.version} -> v{version} "
                              f"(expected v{model.version + 1})")
        try:
            spec = table.spec(model.state, rec["trigger"])  # the table's own words when the pair is illegal
            state = held.fire(rec["trigger"])
        except IllegalTransitionError as exc:
            raise ReplayError(f"{line.where}: {exc}") from None
        if state != rec["to"]:
            raise ReplayError(f"{line.where}: {table.name} {rec['trigger']} goes {rec['from']} -> {state} per the "
                              f"table, but the record says -> {rec['to']}")
        self.generations.check(line, table, spec)
        self._check_fence(line, table)
        plan_id = rec.get("plan_id", "")
        for guard in spec.guards:
            self._check_guard(line, guard, plan_id)
        self._check_reason(line, table, spec, plan_id)
        self._chain(line)
        held.plan_id = plan_id
        report.transitions += 1
        report.audit.append(rec)
        final = report.final.get(key) or KeyState(table.name, key, state, 0, 0)
        report.final[key] = replace(final, state=state, code=table.to_code(state), version=model.version,
                                    transitions=final.transitions + 1, last_trigger=rec["trigger"],
                                    last_id=rec.get("id", ""), plan_id=plan_id)
        if table is CLUSTER:
            self._cluster_effects(line, spec, plan_id)
        elif table is WEIGHTS:
            self.weight_requests.transition(line)
        if self.until is not None and self._reached(line, table, version):
            self.stopped = True
            report.until = self.until

    def _reached(self, line: AuditLine, table: MachineTable, version: int) -> bool:
        until = self.until_at
        if isinstance(until, tuple):  # a stream id
            return _stream_id(line) == until
        return table is CLUSTER and version == until

    def _check_fence(self, line: AuditLine, table: MachineTable) -> None:
        rec = line.record
        if table is MEMBERSHIP and not rec.get("fence", ""):  # an operator's command: unfenced
            return
        if table is CLUSTER and not rec.get("fence", "") and any(
                s.by_operator and s.trigger == rec.get("trigger") for s in table.transitions):
            return  # an operator's round abort: unfenced
        if table is not CLUSTER and table is not MEMBERSHIP:  # the coordinator's member commits are fenced
            if rec.get("fence", ""):
                raise ReplayError(f"{line.where}: {table.name} records are not fenced, but this one carries fence "
                                  f"{rec['fence']!r}")
            return
        n, holder = _fence(line)
        if rec.get("actor", "") != holder:
            raise ReplayError(f"{line.where}: fence {rec['fence']} belongs to {holder}, but the actor is "
                              f"{rec.get('actor', '')!r}")
        if self.fence is not None:
            last_n, last_holder = self.fence
            if n < last_n:
                raise ReplayError(f"{line.where}: fence {n} goes backwards (after fence {last_n})")
            if n == last_n and holder != last_holder:
                raise ReplayError(f"{line.where}: fence {n} held by {holder}, but {last_holder} committed with it")
        self.fence = (n, holder)

    def _state_of(self, key: str, table: MachineTable) -> tuple[str, str]:
        held = self.machines.get(key)
        return (held.model.state, held.plan_id) if held is not None else (table.initial.value, "")

    def _check_guard(self, line: AuditLine, guard: Guard, plan_id: str) -> None:
        """Evaluate ``guard`` on the records as replayed (what ``commit.lua`` evaluated on Redis)."""
        bad = ""
        kind = guard.kind
        if kind.per_rank:
            if self.ep_size is None:  # a header-less export: the rank count is unknown
                return
            table = RANK if kind is GuardKind.RANKS_IN else WEIGHTS
            counted = 0
            for r in range(self.ep_size):
                if self._state_of(f"{MEMBERSHIP.key_label}:{r}", MEMBERSHIP)[0] != MEMBERSHIP.initial.value:
                    continue  # commit.lua counts ACTIVE members only
                counted += 1
                state, held_plan = self._state_of(f"{table.name}:{r}", table)
                if state != guard.state:
                    bad = f"{table.name}:{r} is {state}, not {guard.state}"
                elif guard.same_plan and held_plan != plan_id:
                    bad = f"{table.name}:{r} holds plan {held_plan or '-'}, not {plan_id}"
                if bad:
                    break
            if not bad and counted == 0:
                bad = "no rank is an ACTIVE member"
        elif kind is GuardKind.CLUSTER_IN:
            state, held_plan = self._state_of(CLUSTER.name, CLUSTER)
            if state not in guard.states:
                bad = f"cluster is {state}"
            elif guard.same_plan and held_plan != plan_id:
                bad = f"cluster plan is {held_plan or '-'}, not {plan_id}"
        elif kind is GuardKind.PLAN_NOT_CURRENT:
            if plan_id and plan_id == self.report.placement_plan:
                bad = f"plan {plan_id} was committed already"
        elif kind is GuardKind.PLAN_STORED:
            self.stored_at.append((line.where, plan_id))
        elif kind is GuardKind.WITHDRAWN:
            bad = self.weight_requests.guard(line, guard)
        if bad:
            raise ReplayError(f"{line.where}: guard {guard.label()} did not hold when {line.record['key']} "
                              f"{line.record['trigger']} committed: {bad}")

    def _chain(self, line: AuditLine) -> None:
        rec = line.record
        if "chain" not in rec:
            if self.report.header is not None or self.chain is not None:
                raise ReplayError(f"{line.where}: record without chain")
            return  # a header-less export of a stream written before the chain existed
        expected = chain_of(self.chain or "", rec)
        if rec["chain"] != expected:
            raise ReplayError(f"{line.where}: chain {rec['chain']!r} is not the hash of this record and its "
                              f"predecessor's chain ({expected}): a record before it was dropped, reordered or "
                              f"forged, or this one was edited")
        self.chain = expected
        self.report.chain = expected
        self.report.chain_id, self.report.chain_where = str(rec.get("id", "")), line.where
        self.report.chained += 1

    def _cluster_effects(self, line: AuditLine, spec: TransitionSpec, plan_id: str) -> None:
        report = self.report
        if spec.trigger == "start":
            report.cluster_round = field_int(line, "round")
            active = None if self.ep_size is None else tuple(  # the members the round counts (commit.lua's rule)
                r for r in range(self.ep_size)
                if self._state_of(f"{MEMBERSHIP.key_label}:{r}", MEMBERSHIP)[0] == MEMBERSHIP.initial.value)
            report.rounds.append(RoundSeen(report.cluster_round, report.placement_plan, active))
            self.generations.started(report.cluster_round)
        current = report.rounds[-1] if report.rounds else None
        if current is not None:  # its outcome: round_outcome of its last cluster transition (RoundSeen.outcome)
            current.last, current.where = line.record, line.where
        if spec.trigger == "load":
            report.plans.append(LoadedPlan(line.where, plan_id, field_int(line, "round"), report.placement_plan,
                                           line.record))
            self.generations.loaded(line, field_int(line, "round"))
            if current is not None:
                current.plan_id = plan_id
        if spec.effect is Effect.SET_PLACEMENT:
            members = {r: self._state_of(f"{MEMBERSHIP.key_label}:{r}", MEMBERSHIP)[0]
                       for r in range(self.ep_size or 0)}
            self.generations.committed(line, plan_id, members)
            report.placement_plan = plan_id
            self.placement_known = True
            if current is not None:
                current.committed = True

    # ---- snapshots and plans ---------------------------------------------------------------------------------
    def snapshot(self, line: AuditLine) -> None:
        snapshot: SnapshotLine = line.value
        if snapshot.round in self.report.snapshots:
            raise ReplayError(f"line {line.line}: a second snapshot of round {snapshot.round}")
        self.report.snapshots[snapshot.round] = snapshot.expert_load
        if snapshot.source_load is not None:
            self.report.source_loads[snapshot.round] = snapshot.source_load

    def plan(self, line: AuditLine) -> None:
        plan: PlanEntry = line.value
        if plan.plan_id in self.report.stored_plans:
            raise ReplayError(f"line {line.line}: plan without plan_id, or a second plan {plan.plan_id}")
        self.report.stored_plans[plan.plan_id] = plan
        if "generation" in line.record:  # exported since plans carry it
            self.plan_generations[plan.plan_id] = (plan.generation, line.line)

    def finish(self) -> None:
        """Checks that need the whole file: the header's contents are all there, every loaded plan is stored."""
        header, report = self.report.header, self.report
        if header is None:
            return
        contents, missing = header.get("contents") or {}, header.get("missing") or {}
        for r in contents.get("snapshots", []):
            if r not in report.snapshots:
                raise ReplayError(f"line 1: the header lists the snapshot of round {r}, but the recording has none")
        for p in contents.get("plans", []):
            if p not in report.stored_plans:
                raise ReplayError(f"line 1: the header lists plan {p}, but the recording has no such plan line")
        if contents.get("records") not in (None, report.records) and report.until is None:
            raise ReplayError(f"line 1: the header counts {contents['records']} audit records, the recording has "
                              f"{report.records}")
        span = header.get("range") or {}
        ids = [rec.get("id", "") for rec in report.audit]
        for name, seen in (("first_id", ids[0] if ids else None), ("last_id", ids[-1] if ids else None)):
            if name in span and span[name] != seen and not (name == "last_id" and report.until is not None):
                # the header is not in the chain: its range ties it to the records it was exported with
                raise ReplayError(f"line 1: the header's range.{name} is {span[name]}, but the recording's "
                                  f"{'first' if name == 'first_id' else 'last'} audit record is {seen} (a header "
                                  f"of another export?)")
        for where, plan_id in self.stored_at:
            if plan_id not in report.stored_plans and plan_id not in missing.get("plans", []):
                raise ReplayError(f"{where}: guard plan_stored did not hold: plan {plan_id or '-'} is neither in "
                                  f"the recording nor listed as pruned")
        self.generations.finish(report.stored_plans, self.plan_generations, self.num_logical_experts, self.ep_size)
        check_settings(report)  # the header's settings against the records, now verified (line 1 if not)


def _until(until: str) -> int | tuple[int, int]:
    """``--until``: the cluster record's version (ASCII digits) or an audit stream id
    (:func:`~fdeplb.store.streams.parse_stream_id`); :class:`InputError` for anything else."""
    if until.isascii() and until.isdigit():
        return int(until)
    try:
        return parse_stream_id(until)
    except InputError:
        raise InputError(f"--until takes the cluster's version or an audit id <ms>-<seq>, got {until!r}") from None


def replay(lines: Iterable[AuditLine], until: str | None = None) -> ReplayReport:
    """Replay parsed recording lines; returns the report or raises :class:`ReplayError` at the first line that
    does not follow from the ones before it. ``until`` (a stream id ``<ms>-<seq>``, or the cluster record's
    version) stops the replay of audit records after that record; :class:`InputError` if no record matches."""
    report = ReplayReport()
    state = _Replay(report, until)
    for line in lines:
        kind = line.type
        if kind == "header":
            state.header(line)
        elif kind == "snapshot":
            state.snapshot(line)
        elif kind == "plan":
            state.plan(line)
        elif not state.stopped:
            state.audit(line)
        elif line.record.get("trigger") == "config_changed":
            state.config_note(line)
    if until is not None and not state.stopped:
        raise InputError(f"--until {until}: no such record in the recording")
    state.finish()
    return report


def replay_file(path: str | Path, until: str | None = None) -> ReplayReport:
    """:func:`replay` of a recording file."""
    return replay(read_export(path), until)
