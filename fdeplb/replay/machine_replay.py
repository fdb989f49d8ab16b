"""The machine replay: an audit stretch driven through the machine tables with no Redis, one ``transitions``
machine per record key (built from the table exactly as a live commit builds it, see
:mod:`fdeplb.machines.model`), every record checked against the ones before it (the list is the package's
docstring, :mod:`fdeplb.replay`); and :func:`chain_of`, the Python side of the audit chain.

:func:`state_at` is the plain fold the exporter needs: where a stretch of the stream leaves every record, with no
checks (an export must work on a stream that would not replay).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
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
    MemberState,
    TransitionSpec,
)
from fdeplb.replay.recording_format import AuditLine, HeaderLine, SnapshotLine, decimal_text, read_export
from fdeplb.replay.report import KeyState, LoadedPlan, ReplayReport, RoundSeen
from fdeplb.store.streams import parse_stream_id

if TYPE_CHECKING:
    from fdeplb.store.records import PlanEntry

__all__ = ["CHAIN_EXCLUDED", "NOT_TRANSITIONS", "StartState", "chain_of", "replay", "replay_file", "state_at"]

#: triggers that are audited but are not transitions
NOT_TRANSITIONS = frozenset({"alarm", "skip", "start_refused", "weights_cancelled", "request_cancelled",
                             "request_expired", "config_changed"})
#: fields of an exported audit line that the chain does not cover (the line type, the stream id, the chain itself)
CHAIN_EXCLUDED = frozenset({"type", "id", "chain"})


def chain_of(previous: str, fields: Mapping[str, Any]) -> str:
    """The audit chain of a record: SHA-1 hex of ``previous`` (the predecessor's chain, "" for the first record),
    a newline, then for every field but ``type``/``id``/``chain``, by name in byte order,
    ``name=<byte length of value>:value`` and a newline. ``commit.lua`` and ``audit.lua`` compute the same with
    ``redis.sha1hex``. Values are the stream's text; an integer (an export's version, round, ts_ms) hashes as its
    decimal text (:func:`~fdeplb.replay.recording_format.decimal_text`); anything else is a :class:`ReplayError`.
    """
    parts = [previous, "\n"]
    for name in sorted((n for n in fields if n not in CHAIN_EXCLUDED), key=lambda n: n.encode()):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ReplayError(f"field {name} is {type(value).__name__}, not text")
        text = decimal_text(value)
        parts.append(f"{name}={len(text.encode())}:{text}\n")
    return hashlib.sha1("".join(parts).encode()).hexdigest()


def _int(line: AuditLine, name: str) -> int:
    """An audit field's decimal text as an int; :class:`ReplayError` naming the line for anything else."""
    value = line.record.get(name, "")
    if not re.fullmatch(r"\s*-?\d+\s*", value):  # what int() reads, no "--1", no "²"
        raise ReplayError(f"{line.where}: {name} is not an integer: {value!r}")  # 1.5, true, [] ...
    return int(value)


def _stream_id(line: AuditLine) -> tuple[int, int] | None:
    rid = line.record.get("id")
    if rid in (None, ""):
        return None
    try:
        return parse_stream_id(rid)
    except InputError:
        raise ReplayError(f"{line.where}: not a stream id: {rid!r}") from None


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


class _Replay:
    """The state of one replay: every key's machine, the fence, the chain, the current placement's plan."""

    def __init__(self, report: ReplayReport, until: str | None) -> None:
        self.report = report
        self.until = until
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

    # ---- header ----------------------------------------------------------------------------------------------
    def header(self, line: AuditLine) -> None:
        """The header (its types checked by the reader, :class:`~fdeplb.replay.recording_format.HeaderLine`):
        the cluster's configuration and every record's state where the recording starts."""
        header: HeaderLine = line.value
        if self.report.header is not None or self.report.records:
            raise ReplayError(f"line {line.line}: a header must be the first line, and only one")
        from fdeplb.store.records import ClusterConfig

        try:
            config = ClusterConfig.from_json(header.config)
        except InputError as exc:
            raise ReplayError(f"line {line.line}: not a recording header: {exc}") from None
        self.ep_size = config.ep_size
        self.cordoned = config.cordoned
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
            self._note(line, table, held)
            self._chain(line)
            report.skipped += 1
            report.audit.append(rec)
            return
        if rec["from"] != model.state:
            raise ReplayError(f"{line.where}: {key} is {model.state} v{model.version} in the replay, but the "
                              f"record says from {rec['from']}")
        version = _int(line, "version")
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
        if self.until is not None and self._reached(line, table, version):
            self.stopped = True
            report.until = self.until

    def _reached(self, line: AuditLine, table: MachineTable, version: int) -> bool:
        if "-" in self.until:
            return line.record.get("id", "") == self.until
        return table is CLUSTER and str(version) == self.until

    def _note(self, line: AuditLine, table: MachineTable, held: _Replayed) -> None:
        """An alarm, skip or start refusal: on the cluster as replayed; skips and refusals only in FREE (the
        coordinator's FREE entry work writes them); a refusal names ranks of the cluster and stays in force until
        a start."""
        rec, trigger = line.record, line.record["trigger"]
        if table is not CLUSTER:
            raise ReplayError(f"{line.where}: {trigger} on {rec['key']}; it is raised on the cluster record")
        state, version = held.model.state, held.model.version
        if rec["from"] != state or rec["to"] != state or _int(line, "version") != version:
            raise ReplayError(f"{line.where}: {trigger} for cluster {rec['from']} v{rec['version']}, but the cluster "
                              f"is {state} v{version} in the replay")
        if trigger in ("skip", "start_refused") and state != CLUSTER.initial:
            raise ReplayError(f"{line.where}: {trigger} while the cluster is {state}; starts are decided in "
                              f"{CLUSTER.initial.value} only")
        if trigger == "start_refused":
            from fdeplb.orchestration import reasons

            stale = _read_detail(line, reasons.stale_ranks, lambda v: reasons.refusal(v).text)
            if stale is None:
                raise ReplayError(f"{line.where}: start_refused without its stale ranks: "
                                  f"{rec.get('reason', '')[:80]!r}")
            strays = [r for r in stale if self.ep_size is not None and r >= self.ep_size]
            if strays:
                raise ReplayError(f"{line.where}: start_refused names ranks {strays}; the cluster has ranks "
                                  f"0..{self.ep_size - 1}")
            self.refused = (line.where, stale)
        if trigger == "config_changed":  # the settings as changed from here on (``fdeplb config set``)
            from fdeplb.orchestration import reasons

            try:
                changes = (reasons.detail_of(rec) or {}).get("changes", {})
            except ValueError as exc:
                raise ReplayError(f"{line.where}: config_changed detail is not JSON: {exc}") from None
            if "cordoned" in changes:
                self.cordoned = bool(changes["cordoned"][1])
            self.report.config_changes.append((_int(line, "round"), changes))

    def _check_reason(self, line: AuditLine, table: MachineTable, spec: TransitionSpec, plan_id: str) -> None:
        """What a transition's record says besides its states, checked against the replayed records: the start
        after a refusal shows every refused rank fresh again; a cordoned cluster commits on an external request
        only; a weight update reloads the cluster's current placement."""
        from fdeplb.orchestration import reasons

        reason, where = line.record.get("reason", ""), line.where
        if table is CLUSTER and spec.trigger == "start" and self.refused is not None:
            refused_at, stale = self.refused
            beats = _read_detail(line, reasons.heartbeats, lambda v: reasons.fresh(v).text) or {}
            for r in sorted(stale):
                if self._state_of(f"{MEMBERSHIP.key_label}:{r}", MEMBERSHIP)[0] == MemberState.EXCLUDED.value:
                    continue  # the start ignores excluded ranks (issue 22)
                age, ttl = beats.get(r, (None, 0))
                if age is None or 0 < ttl < age:
                    shown = "no heartbeat of it" if age is None else f"its heartbeat {age} ms old (ttl {ttl} ms)"
                    raise ReplayError(f"{where}: cluster start over stale rank {r} (start refused at "
                                      f"{refused_at}): the start shows {shown}")
            self.refused = None
        elif table is CLUSTER and spec.trigger == "start":
            self.refused = None
        if table is CLUSTER and spec.trigger == "commit" and self.cordoned and \
                _read_detail(line, reasons.requested_by,
                                                     lambda v: reasons.external_commit(v).text) is None:
            raise ReplayError(f"{where}: cluster commit of a cordoned cluster without an external request "
                              f"(reason {reason[:80]!r})")
        if table is WEIGHTS and spec.trigger == "updated" and self.placement_known \
                and plan_id != self.report.placement_plan:
            raise ReplayError(f"{where}: {line.record['key']} updated into placement {plan_id or 'initial'}, but "
                              f"the cluster's current placement is {self.report.placement_plan or 'initial'} (an "
                              f"update reloads the current placement)")

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
            report.cluster_round = _int(line, "round")
            report.rounds.append(RoundSeen(report.cluster_round, report.placement_plan))
        current = report.rounds[-1] if report.rounds else None
        if current is not None:  # its outcome: round_outcome of its last cluster transition (RoundSeen.outcome)
            current.last, current.where = line.record, line.where
        if spec.trigger == "load":
            report.plans.append(LoadedPlan(line.where, plan_id, _int(line, "round"), report.placement_plan))
            if current is not None:
                current.plan_id = plan_id
        if spec.effect is Effect.SET_PLACEMENT:
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

    def plan(self, line: AuditLine) -> None:
        plan: PlanEntry = line.value
        if plan.plan_id in self.report.stored_plans:
            raise ReplayError(f"line {line.line}: plan without plan_id, or a second plan {plan.plan_id}")
        self.report.stored_plans[plan.plan_id] = plan

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


def _read_detail(line: AuditLine, read, derive=None):
    """``read(record)`` (a :mod:`fdeplb.orchestration.reasons` reader of the record's structured ``detail``, or of
    its text in a schema 1 recording). With ``derive`` (value -> the reason text it gives) and a ``detail`` field,
    the record's ``reason`` must be that text: the text is derived from the facts, never a second source. A
    ``detail`` that is not a JSON object of the right shape, or a text that does not match it, is a
    :class:`ReplayError` naming the line."""
    try:
        value = read(line.record)
    except (ValueError, TypeError, KeyError) as exc:
        raise ReplayError(f"{line.where}: detail is not what a {line.record.get('trigger', '')} record carries: "
                          f"{exc}") from None
    if derive is not None and value is not None and line.record.get("detail"):
        expected = derive(value)
        if line.record.get("reason", "") != expected:
            raise ReplayError(f"{line.where}: reason {str(line.record.get('reason', ''))[:80]!r} is not what its "
                              f"detail says ({expected[:80]!r})")
    return value


def replay(lines: Iterable[AuditLine], until: str | None = None) -> ReplayReport:
    """Replay parsed recording lines; returns the report or raises :class:`ReplayError` at the first line that
    does not follow from the ones before it. ``until`` (a stream id ``<ms>-<seq>``, or the cluster record's
    version) stops the replay of audit records after that record; :class:`InputError` if no record matches."""
    if until is not None and not (until.isdigit() or (until.count("-") == 1 and until.replace("-", "").isdigit())):
        raise InputError(f"--until takes the cluster's version or an audit id <ms>-<seq>, got {until!r}")
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
    if until is not None and not state.stopped:
        raise InputError(f"--until {until}: no such record in the recording")
    state.finish()
    return report


def replay_file(path: str | Path, until: str | None = None) -> ReplayReport:
    """:func:`replay` of a recording file."""
    return replay(read_export(path), until)


# ---- where a stretch of the stream leaves the records (the exporter's start) ---------------------------------------
@dataclass(frozen=True)
class StartState:
    """Where a stretch of the audit leaves a cluster: ``records`` (record key -> ``{state, version, plan_id}``, a
    header's ``start.records``), ``chain`` (the chain of its last record, "" for none) and ``placement_plan`` (the
    plan of its last cluster commit, "" for the initial placement)."""

    records: dict[str, dict[str, Any]]
    chain: str
    placement_plan: str


def state_at(entries: Iterable[Any], ep_size: int) -> StartState:
    """Every record of a cluster of ``ep_size`` ranks after ``entries``: audit records from the stream's start, in
    order, each read by field name as text (:class:`~fdeplb.store.AuditRecord`: a missing field reads ""). A plain
    fold, no checks (the export of a stream that would not replay must still work): a transition's key takes its
    ``to``, version and plan_id; a note (:data:`NOT_TRANSITIONS`) leaves the records as they are; a key that is not
    a record of the cluster is passed over; a cluster transition whose effect sets the placement (the commit) makes
    its plan the placement."""
    records = {CLUSTER.name: {"state": CLUSTER.initial.value, "version": 0, "plan_id": ""}}
    for r in range(ep_size):
        for table in (RANK, WEIGHTS, MEMBERSHIP):
            records[f"{table.key_label}:{r}"] = {"state": table.initial.value, "version": 0, "plan_id": ""}
    chain, placement_plan = "", ""
    for e in entries:
        chain = e["chain"]
        if e["trigger"] in NOT_TRANSITIONS or e["key"] not in records:
            continue
        records[e["key"]] = {"state": e["to"], "version": int(e["version"]), "plan_id": e["plan_id"]}
        if e["machine"] == CLUSTER.name and CLUSTER.spec(e["from"], e["trigger"]).effect is Effect.SET_PLACEMENT:
            placement_plan = e["plan_id"]
    return StartState(records, chain, placement_plan)
