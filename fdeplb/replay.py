"""Replay a recording (a self-contained audit export, see :mod:`fdeplb.recording`) through the machine tables, with
no Redis.

DESIGN.md section 4: the audit stream is complete, and replaying it through the tables must reproduce every state
and every plan. :func:`replay` drives one ``transitions`` machine per record key (built from the table exactly as a
live commit builds it, see :mod:`fdeplb.machines.model`) and checks, for every audit record in order:

- its stream id is after the previous record's (the export is in stream order);
- its machine is a table and its key a record of the cluster (``cluster``, ``rank:<r>`` / ``weights:<r>`` with
  0 <= r < ep_size);
- ``from`` is the state the replay holds for that key, ``trigger`` is legal from it and reaches ``to`` (per the
  table), and ``version`` is the key's previous version + 1 (no gap, no repeat);
- fences: a cluster record carries its coordinator's lease ``<n>:<holder>`` with ``actor`` the holder, and ``n``
  never goes backwards (one ``n`` is one lease); rank and weight records carry none;
- the transition's guards that span records held when it committed, on the records as the replay holds them
  (LOAD_SUCC / SWAPPING / DONE only with every rank LOADED / SWAPPED for that plan, a start only with every rank
  IDLE and every weight status NORMAL, no clear while a round is past FREE, a fail / abort only before the plan is
  committed, a ``load`` only with its plan in the recording);
- what a record says besides its states (the texts of :mod:`fdeplb.orchestration.reasons`): the start that follows
  a start refused for stale ranks shows each of them fresh again (heartbeat age within its TTL); a cordoned
  cluster's commit names its external request; a weight ``updated`` names the cluster's current placement (an
  update reloads the current placement, never the initial one);
- an alarm, skip or start refusal (not transitions) names the cluster record in its replayed state and version;
  a skip or refusal only in FREE, a refusal only ranks of the cluster;
- ``chain`` = :func:`chain_of` (the predecessor's chain, the record's fields): computed by the commit script, so a
  dropped, reordered, edited or forged record anywhere breaks it (the semantic checks above run first, so a record
  that also breaks them is reported with their reason).

Records whose trigger is ``alarm``, ``skip`` or ``start_refused`` are cluster outcomes, not transitions: the
record stays as it is.

:func:`check_plans` then recomputes every ``load`` transition's plan from its snapshot (from the recording, or from
a live :class:`~fdeplb.store.Store`) and checks the plan_id and ``new_phy2log``; :func:`check_gates` recomputes
the numbers of every gated round. :func:`whatif` replans every recorded round's snapshot with another policy.
:func:`rebuild` writes the replayed records into a Redis.

The first inconsistency raises :class:`~fdeplb.errors.ReplayError` naming the line (CLI exit 1).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from fdeplb.errors import CorruptRecordError, IllegalTransitionError, InputError, ReplayError
from fdeplb.machines.model import RecordModel, build_machine
from fdeplb.machines.tables import (
    CLUSTER,
    RANK,
    TABLES,
    WEIGHTS,
    Effect,
    Guard,
    GuardKind,
    MachineTable,
    TransitionSpec,
)
from fdeplb.recording import SCHEMA, array_from_json

__all__ = ["ReplayError", "chain_of", "parse_lines", "read_export", "replay", "replay_file", "check_plans",
           "check_gates", "whatif", "rebuild", "ReplayReport"]

#: fields every exported audit record must have
REQUIRED = ("machine", "key", "from", "to", "trigger", "version")
#: triggers that are audited but are not transitions
NOT_TRANSITIONS = frozenset({"alarm", "skip", "start_refused"})
#: fields of an exported audit line that the chain does not cover (the line type, the stream id, the chain itself)
CHAIN_EXCLUDED = frozenset({"type", "id", "chain"})
#: line types of a recording
LINE_TYPES = ("header", "audit", "snapshot", "plan")


def chain_of(previous: str, fields: Mapping[str, Any]) -> str:
    """The audit chain of a record: SHA-1 hex of ``previous`` (the predecessor's chain, "" for the first record),
    a newline, then for every field but ``type``/``id``/``chain``, by name in byte order,
    ``name=<byte length of value>:value`` and a newline. ``commit.lua`` and ``audit.lua`` compute the same with
    ``redis.sha1hex``. Integer values (the export writes version, round, ts_ms as ints) hash as their decimal text.
    """
    parts = [previous, "\n"]
    for name in sorted((n for n in fields if n not in CHAIN_EXCLUDED), key=lambda n: n.encode()):
        value = fields[name]
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str):
            raise ReplayError(f"field {name} is {type(value).__name__}, not text")
        parts.append(f"{name}={len(text.encode())}:{text}\n")
    return hashlib.sha1("".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class AuditLine:
    """One parsed line of a recording: its 1-based ``line`` number and the object."""

    line: int
    record: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.record.get("type", "audit"))

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
    plan_id: str = ""


@dataclass(frozen=True)
class LoadedPlan:
    """A ``load`` transition seen by the replay: its plan, round, and the plan committed before it."""

    where: str
    plan_id: str
    round: int
    previous_plan_id: str


@dataclass
class RoundSeen:
    """One round as the replay saw it: its plan (if it got one), the placement it started from, its outcome."""

    round: int
    placement_plan: str
    plan_id: str = ""
    outcome: str = "running"  # running, committed, aborted
    reason: str = ""
    where: str = ""  # the line of its abort


@dataclass
class ReplayReport:
    """Outcome of a replay: counts, the final state of every key, the plans to check and what the recording held."""

    records: int = 0
    transitions: int = 0
    skipped: int = 0
    final: dict[str, KeyState] = field(default_factory=dict)
    plans: list[LoadedPlan] = field(default_factory=list)
    plans_checked: list[str] = field(default_factory=list)
    plans_unchecked: list[str] = field(default_factory=list)
    header: dict[str, Any] | None = None
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)
    stored_plans: dict[str, Any] = field(default_factory=dict)
    rounds: list[RoundSeen] = field(default_factory=list)
    gates_checked: list[int] = field(default_factory=list)
    placement_plan: str = ""
    chained: int = 0
    chain: str = ""
    until: str | None = None
    audit: list[dict[str, Any]] = field(default_factory=list)
    cluster_round: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "transitions": self.transitions, "skipped": self.skipped,
                "final": {k: asdict(v) for k, v in self.final.items()},
                "plans": [p.plan_id for p in self.plans], "plans_checked": list(self.plans_checked),
                "plans_unchecked": list(self.plans_unchecked), "gates_checked": list(self.gates_checked),
                "chained": self.chained, "until": self.until,
                "placement_plan": self.placement_plan}


# ---- reading -------------------------------------------------------------------------------------------------------
#: longest line accepted (a plan line of DeepSeek-V3 is under 1 MiB; this stops a runaway read of a non-JSONL file)
MAX_LINE_BYTES = 16 * 1024 * 1024


def parse_lines(lines: Iterable[str]) -> Iterator[AuditLine]:
    """Parse JSONL recording lines (blank lines skipped); :class:`ReplayError` names the first bad line."""
    for n, text in enumerate(lines, start=1):
        if len(text) > MAX_LINE_BYTES:
            raise ReplayError(f"line {n}: longer than {MAX_LINE_BYTES} characters; not a recording")
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReplayError(f"line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
        except (ValueError, RecursionError) as exc:  # a number over Python's digit limit, nesting too deep
            raise ReplayError(f"line {n}: not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
        if not isinstance(record, dict):
            raise ReplayError(f"line {n}: expected a JSON object, got {type(record).__name__}")
        kind = record.get("type", "audit")
        if kind not in LINE_TYPES:
            raise ReplayError(f"line {n}: unknown line type {kind!r}; expected one of {', '.join(LINE_TYPES)}")
        if kind == "audit":
            missing = [f for f in REQUIRED if f not in record]
            if missing:
                raise ReplayError(f"line {n}: audit record without {', '.join(missing)}")
            for name, value in record.items():  # the stream holds text; the export writes version etc. as ints
                if name != "type" and (isinstance(value, bool) or not isinstance(value, (str, int))):
                    raise ReplayError(f"line {n}: audit field {name} is {type(value).__name__}, not text")
        yield AuditLine(n, record)


def read_export(path: str | Path) -> Iterator[AuditLine]:
    """The parsed lines of a recording file; :class:`InputError` (exit 2) if it cannot be read."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed by the generator below
    except OSError as exc:
        raise InputError(f"cannot read recording {path}: {exc.strerror}") from None
    with handle:
        # readline(limit) never holds more than one bounded chunk, even for a file without newlines (/dev/zero)
        yield from parse_lines(_decoded(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b"")))


def _decoded(chunks: Iterable[bytes]) -> Iterator[str]:
    """Each line as UTF-8 text; :class:`ReplayError` naming the first line that is not UTF-8."""
    for n, chunk in enumerate(chunks, start=1):
        try:
            yield chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReplayError(f"line {n}: not UTF-8 (byte {exc.start + 1} of the line is {chunk[exc.start]:#04x})") \
                from None


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


def _fence(line: AuditLine) -> tuple[int, str]:
    fence = str(line.record.get("fence", ""))
    n, sep, holder = fence.partition(":")
    if not sep or not n.isdigit() or not holder:
        raise ReplayError(f"{line.where}: cluster record with fence {fence!r}; a coordinator commits with its "
                          f"lease <n>:<holder>")
    return int(n), holder


def _check_header(line: AuditLine) -> None:
    """The types of a header's fields (docs/recordings.md); :class:`ReplayError` naming the first that is off."""
    rec = line.record

    def bad(what: str, want: str) -> ReplayError:
        return ReplayError(f"line {line.line}: not a recording header: {what} is not {want}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def str_list(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    def int_list(v: Any) -> bool:
        return isinstance(v, list) and all(is_int(x) for x in v)

    if not isinstance(rec.get("config"), dict):
        raise bad("config", "an object (the cluster configuration)")
    start = rec.get("start")
    if not isinstance(start, dict):
        raise bad("start", "an object {chain, records, placement}")
    if not isinstance(start.get("chain"), str):
        raise bad("start.chain", "text")
    if not isinstance(start.get("records"), dict):
        raise bad("start.records", "an object of machine records")
    for key, held in start["records"].items():
        if not isinstance(held, dict) or not isinstance(held.get("state"), str) or not is_int(held.get("version")) \
                or not isinstance(held.get("plan_id", ""), str):
            raise bad(f"start.records.{key}", "{state: text, version: integer, plan_id: text}")
    placement = start.get("placement")
    if placement is not None and (not isinstance(placement, dict) or not isinstance(placement.get("plan_id"), str)):
        raise bad("start.placement", "null or {plan_id: text, phy2log: array}")
    contents, missing = rec.get("contents", {}), rec.get("missing", {})
    if not isinstance(contents, dict) or not is_int(contents.get("records", 0)) \
            or not int_list(contents.get("snapshots", [])) or not str_list(contents.get("plans", [])):
        raise bad("contents", "{records: integer, snapshots: [round], plans: [plan_id]}")
    if not isinstance(missing, dict) or not int_list(missing.get("snapshots", [])) \
            or not str_list(missing.get("plans", [])):
        raise bad("missing", "{snapshots: [round], plans: [plan_id]}")
    span = rec.get("range", {})
    if not isinstance(span, dict) or any(not isinstance(span.get(k), (str, type(None))) for k in
                                         ("first_id", "last_id")):
        raise bad("range", "{round, first_id: text or null, last_id: text or null}")


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
        rec = line.record
        if self.report.header is not None or self.report.records:
            raise ReplayError(f"line {line.line}: a header must be the first line, and only one")
        if type(rec.get("schema")) is not int or rec.get("schema") != SCHEMA:
            raise ReplayError(f"line {line.line}: recording schema {rec.get('schema')!r}; this fdeplb reads "
                              f"schema {SCHEMA}")
        _check_header(line)
        from fdeplb.store.records import ClusterConfig

        try:
            config = ClusterConfig.from_json(rec["config"])
        except InputError as exc:
            raise ReplayError(f"line {line.line}: not a recording header: {exc}") from None
        start = rec["start"]
        self.ep_size = config.ep_size
        self.cordoned = config.cordoned
        for key, held in start["records"].items():
            table = self._table_of(line, key)
            try:
                self.machines[key] = _Replayed(table, key, held["state"], held["version"], held.get("plan_id", ""))
            except InputError as exc:
                raise ReplayError(f"line {line.line}: start record {key}: {exc}") from None
        self.chain = start["chain"]
        self.report.chain = self.chain
        placement = start.get("placement") or {}
        self.report.placement_plan = str(placement.get("plan_id", ""))
        self.placement_known = bool(placement)
        self.report.header = rec

    def _table_of(self, line: AuditLine, key: str, machine: str | None = None) -> MachineTable:
        name, sep, idx = key.partition(":")
        table = TABLES.get(machine if machine is not None else name)
        if table is None:
            raise ReplayError(f"{line.where}: unknown machine {machine or name!r}; expected one of "
                              f"{', '.join(TABLES)}")
        if table is CLUSTER:
            ok = key == CLUSTER.name
        else:
            ok = name == table.name and sep == ":" and idx.isdigit() and (
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
        key = str(rec["key"])
        table = self._table_of(line, key, str(rec["machine"]))
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
            spec = table.spec(model.state, str(rec["trigger"]))  # the table's own words when the pair is illegal
            state = held.fire(str(rec["trigger"]))
        except IllegalTransitionError as exc:
            raise ReplayError(f"{line.where}: {exc}") from None
        if state != rec["to"]:
            raise ReplayError(f"{line.where}: {table.name} {rec['trigger']} goes {rec['from']} -> {state} per the "
                              f"table, but the record says -> {rec['to']}")
        self._check_fence(line, table)
        plan_id = str(rec.get("plan_id", ""))
        for guard in spec.guards:
            self._check_guard(line, guard, plan_id)
        self._check_reason(line, table, spec, plan_id)
        self._chain(line)
        held.plan_id = plan_id
        report.transitions += 1
        report.audit.append(rec)
        final = report.final.get(key) or KeyState(table.name, key, state, 0, 0)
        report.final[key] = replace(final, state=state, code=table.to_code(state), version=model.version,
                                    transitions=final.transitions + 1, last_trigger=str(rec["trigger"]),
                                    last_id=str(rec.get("id", "")), plan_id=plan_id)
        if table is CLUSTER:
            self._cluster_effects(line, spec, plan_id)
        if self.until is not None and self._reached(line, table, version):
            self.stopped = True
            report.until = self.until

    def _reached(self, line: AuditLine, table: MachineTable, version: int) -> bool:
        if "-" in self.until:
            return str(line.record.get("id", "")) == self.until
        return table is CLUSTER and str(version) == self.until

    def _note(self, line: AuditLine, table: MachineTable, held: _Replayed) -> None:
        """An alarm, skip or start refusal: on the cluster as replayed; skips and refusals only in FREE (the
        coordinator's FREE entry work writes them); a refusal names ranks of the cluster and stays in force until
        a start."""
        rec, trigger = line.record, str(line.record["trigger"])
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

            stale = reasons.parse_refusal(str(rec.get("reason", "")))
            if stale is None:
                raise ReplayError(f"{line.where}: start_refused without its stale ranks: "
                                  f"{str(rec.get('reason', ''))[:80]!r}")
            strays = [r for r in stale if self.ep_size is not None and r >= self.ep_size]
            if strays:
                raise ReplayError(f"{line.where}: start_refused names ranks {strays}; the cluster has ranks "
                                  f"0..{self.ep_size - 1}")
            self.refused = (line.where, stale)

    def _check_reason(self, line: AuditLine, table: MachineTable, spec: TransitionSpec, plan_id: str) -> None:
        """What a transition's record says besides its states, checked against the replayed records: the start
        after a refusal shows every refused rank fresh again; a cordoned cluster commits on an external request
        only; a weight update reloads the cluster's current placement."""
        from fdeplb.orchestration import reasons

        reason, where = str(line.record.get("reason", "")), line.where
        if table is CLUSTER and spec.trigger == "start" and self.refused is not None:
            refused_at, stale = self.refused
            beats = reasons.parse_fresh(reason) or {}
            for r in sorted(stale):
                age, ttl = beats.get(r, (None, 0))
                if age is None or 0 < ttl < age:
                    shown = "no heartbeat of it" if age is None else f"its heartbeat {age} ms old (ttl {ttl} ms)"
                    raise ReplayError(f"{where}: cluster start over stale rank {r} (start refused at "
                                      f"{refused_at}): the start shows {shown}")
            self.refused = None
        elif table is CLUSTER and spec.trigger == "start":
            self.refused = None
        if table is CLUSTER and spec.trigger == "commit" and self.cordoned and not reason.startswith(
                reasons.EXTERNAL):
            raise ReplayError(f"{where}: cluster commit of a cordoned cluster without an external request "
                              f"(reason {reason[:80]!r})")
        if table is WEIGHTS and spec.trigger == "updated" and self.placement_known \
                and plan_id != self.report.placement_plan:
            raise ReplayError(f"{where}: {line.record['key']} updated into placement {plan_id or 'initial'}, but "
                              f"the cluster's current placement is {self.report.placement_plan or 'initial'} (an "
                              f"update reloads the current placement)")

    def _check_fence(self, line: AuditLine, table: MachineTable) -> None:
        rec = line.record
        if table is not CLUSTER:
            if rec.get("fence", "") not in ("", None):
                raise ReplayError(f"{line.where}: {table.name} records are not fenced, but this one carries fence "
                                  f"{rec['fence']!r}")
            return
        n, holder = _fence(line)
        if str(rec.get("actor", "")) != holder:
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
            for r in range(self.ep_size):
                state, held_plan = self._state_of(f"{table.name}:{r}", table)
                if state != guard.state:
                    bad = f"{table.name}:{r} is {state}, not {guard.state}"
                elif guard.same_plan and held_plan != plan_id:
                    bad = f"{table.name}:{r} holds plan {held_plan or '-'}, not {plan_id}"
                if bad:
                    break
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
        self.report.chained += 1

    def _cluster_effects(self, line: AuditLine, spec: TransitionSpec, plan_id: str) -> None:
        report = self.report
        if spec.trigger == "start":
            report.cluster_round = _int(line, "round")
            report.rounds.append(RoundSeen(report.cluster_round, report.placement_plan))
        current = report.rounds[-1] if report.rounds else None
        if spec.trigger == "load":
            report.plans.append(LoadedPlan(line.where, plan_id, _int(line, "round"), report.placement_plan))
            if current is not None:
                current.plan_id = plan_id
        if spec.effect is Effect.SET_PLACEMENT:
            report.placement_plan = plan_id
            self.placement_known = True
            if current is not None:
                current.outcome = "committed"
        if spec.trigger == "abort" and current is not None:
            current.outcome, current.reason = "aborted", str(line.record.get("reason", ""))
            current.where = line.where

    # ---- snapshots and plans ---------------------------------------------------------------------------------
    def snapshot(self, line: AuditLine) -> None:
        r = _int(line, "round")
        if r in self.report.snapshots:
            raise ReplayError(f"line {line.line}: a second snapshot of round {r}")
        self.report.snapshots[r] = array_from_json(line.record.get("expert_load"), f"line {line.line}: "
                                                   f"snapshot of round {r}")

    def plan(self, line: AuditLine) -> None:
        from fdeplb.store.records import PlanEntry

        rec, where = line.record, f"line {line.line}"
        plan_id = str(rec.get("plan_id", ""))
        if not plan_id or plan_id in self.report.stored_plans:
            raise ReplayError(f"{where}: plan without plan_id, or a second plan {plan_id}")
        arrays = {n: array_from_json(rec.get(n), f"{where}: plan {plan_id} {n}")
                  for n in ("expert_load", "old_phy2log", "new_phy2log")}
        try:
            self.report.stored_plans[plan_id] = PlanEntry(
                plan_id=plan_id, round=_int(line, "round"), policy=str(rec["policy"]),
                old_plan_id=str(rec.get("old_plan_id", "")), topology=dict(rec["topology"]),
                balancedness_before=float(rec["balancedness_before"]),
                balancedness_after=float(rec["balancedness_after"]), moved_experts=int(rec["moved_experts"]),
                **arrays)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"{where}: not a plan: {exc}") from None

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
        ids = [str(rec.get("id", "")) for rec in report.audit]
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


# ---- plans ---------------------------------------------------------------------------------------------------------
class Recorded:
    """What a recording holds, with the read methods of :class:`~fdeplb.store.Store` that :func:`check_plans`
    uses (a plan or snapshot not in the recording is None)."""

    def __init__(self, report: ReplayReport) -> None:
        if report.header is None:
            raise InputError("this export has no header (written before schema 1): its plans can only be checked "
                             "against the live cluster (--redis-url, --cluster)")
        from fdeplb.store.records import ClusterConfig

        self.report = report
        self.config = ClusterConfig.from_json(report.header["config"])
        self.missing = set((report.header.get("missing") or {}).get("plans", []))

    def read_config(self):
        return self.config

    def read_plan(self, plan_id: str):
        return self.report.stored_plans.get(plan_id)

    def read_snapshot(self, round_: int):
        return self.report.snapshots.get(round_)

    def start_placement(self) -> tuple[str, np.ndarray] | None:
        placement = self.report.header["start"].get("placement")
        if not placement:
            return None
        return str(placement.get("plan_id", "")), array_from_json(placement.get("phy2log"), "line 1: placement")


def check_plans(source: Any, report: ReplayReport) -> list[str]:
    """Recompute every ``load`` plan of ``report`` from what ``source`` holds (a :class:`Recorded` or a live
    :class:`~fdeplb.store.Store`) and compare; returns the plan_ids checked.

    For each plan: it is stored (a plan the recording lists as pruned is noted in ``report.plans_unchecked``), its
    round and previous placement match the audit, its load snapshot is the round's frozen snapshot,
    :func:`~fdeplb.placement.plan_digest` of (snapshot, old placement, policy, topology) is the plan_id, and the
    coordinator's planner on that snapshot gives the stored ``new_phy2log``.
    Raises :class:`ReplayError` at the first plan that does not reproduce.
    """
    from fdeplb.orchestration.gating import decide, default_planner
    from fdeplb.placement import plan_digest

    config = source.read_config()
    new_of: dict[str, np.ndarray] = {}
    start = source.start_placement() if isinstance(source, Recorded) else None
    if start is not None:
        new_of[start[0]] = start[1]
    recomputed: set[str] = set()
    for plan in report.plans:
        where = f"{plan.where}: plan {plan.plan_id or '(empty)'} of round {plan.round}"
        try:
            stored = source.read_plan(plan.plan_id)
        except CorruptRecordError as exc:
            raise ReplayError(f"{where}: {exc}") from None
        if stored is None:
            if isinstance(source, Recorded) and plan.plan_id in source.missing:
                report.plans_unchecked.append(plan.plan_id)
                continue
            raise ReplayError(f"{where}: not stored")
        load, old, new = stored.expert_load, stored.old_phy2log, stored.new_phy2log
        if not 0 < stored.round <= plan.round:  # a round that retries an aborted round's plan reuses it
            raise ReplayError(f"{where}: stored for round {stored.round}")
        # plans are content-addressed: a round that meets the same (snapshot, old placement) as an earlier one
        # reuses that plan, whose stored round and old_plan_id are the earlier one's; compare contents instead
        if plan.previous_plan_id in new_of and not np.array_equal(old, new_of[plan.previous_plan_id]):
            raise ReplayError(f"{where}: old_phy2log is not the placement it started from "
                              f"({plan.previous_plan_id or 'initial'})")
        snapshot = source.read_snapshot(plan.round)
        if snapshot is not None and not np.array_equal(snapshot, load):
            raise ReplayError(f"{where}: expert_load differs from round {plan.round}'s snapshot")
        policy = stored.policy or config.policy
        digest = plan_digest(load, old, policy, stored.topology)
        if digest != plan.plan_id:
            raise ReplayError(f"{where}: (snapshot, old placement, policy, topology) hash to {digest}")
        if stored.topology != config.topology():
            raise ReplayError(f"{where}: planned for topology {stored.topology}, the cluster has "
                              f"{config.topology()}")
        if plan.plan_id not in recomputed:  # the same plan again (an aborted round retried): recomputed already
            again = np.asarray(default_planner(load, old, replace(config, policy=policy)), dtype=np.int64)
            if not np.array_equal(again, new):
                diff = int(np.count_nonzero(again != new)) if again.shape == new.shape else new.size
                raise ReplayError(f"{where}: recomputing the {policy!r} plan gives a different new_phy2log "
                                  f"({diff} of {new.size} slots differ)")
            recomputed.add(plan.plan_id)
        decision = decide(load, old, new, config)
        figures = {"balancedness_before": decision.balancedness_before,
                   "balancedness_after": decision.balancedness_after, "moved_experts": decision.moved_experts}
        for name, value in figures.items():  # what `status` shows of a staged plan; the plan line is not chained
            # the store keeps balancedness to 6 decimals (Store.save_plan); moved experts exactly
            if not math.isclose(getattr(stored, name), value, rel_tol=0.0, abs_tol=1e-6):
                raise ReplayError(f"{where}: {name} is {getattr(stored, name)}, its arrays give {value}")
        new_of[plan.plan_id] = new
        report.plans_checked.append(plan.plan_id)
    return list(report.plans_checked)


# ---- gated rounds --------------------------------------------------------------------------------------------------
def check_gates(report: ReplayReport) -> list[int]:
    """Recompute every gated round of ``report`` (an abort whose reason starts ``gated:``): replan its snapshot
    from the placement it started from with the cluster's policy and check that the gate skips it with exactly the
    recorded numbers (mean balancedness before and after to 4 decimals, moved experts, min_gain; the reason is
    rebuilt by :func:`fdeplb.orchestration.reasons.gate`). Rounds whose snapshot or starting placement the
    recording lacks are left out. Returns the rounds checked (also in ``report.gates_checked``).

    Raises :class:`ReplayError` naming the abort's line when the numbers differ or the gate would have let the round
    through; :class:`InputError` for a recording without header.
    """
    from fdeplb.orchestration import reasons
    from fdeplb.orchestration.gating import plan_round

    source = Recorded(report)
    cfg = source.config
    placements = _placements(report, source)
    for seen in report.rounds:
        if seen.outcome != "aborted" or not seen.reason.startswith(reasons.GATED):
            continue
        load, old = report.snapshots.get(seen.round), placements.get(seen.placement_plan)
        if load is None or old is None:
            continue
        decision = plan_round(load, old, cfg)
        before, after, moved = decision.balancedness_before, decision.balancedness_after, decision.moved_experts
        expected = reasons.gated(decision)
        if expected is None:
            raise ReplayError(f"{seen.where}: round {seen.round} was gated, but its {cfg.policy!r} plan goes from "
                              f"balancedness {before:.4f} to {after:.4f} moving {moved} experts: a gain above "
                              f"min_gain {cfg.min_gain}, which the gate lets through")
        if expected != seen.reason:
            raise ReplayError(f"{seen.where}: gated round {seen.round} says {seen.reason!r}; recomputing its "
                              f"{cfg.policy!r} plan gives {expected!r}")
        report.gates_checked.append(seen.round)
    return list(report.gates_checked)


def _placements(report: ReplayReport, source: Recorded) -> dict[str, np.ndarray]:
    """plan_id -> phy2log of every placement the recording holds: its start placement and every plan's new one."""
    placements: dict[str, np.ndarray] = {}
    start = source.start_placement()
    if start is not None:
        placements[start[0]] = start[1]
    for p in report.stored_plans.values():
        placements.setdefault(p.plan_id, p.new_phy2log)
    return placements


# ---- what-if -------------------------------------------------------------------------------------------------------
def whatif(report: ReplayReport, policy: str) -> list[dict[str, Any]]:
    """Replan every recorded round that has a snapshot with ``policy`` (a name of
    :data:`fdeplb.placement.POLICIES`), from the placement the round started from.

    Returns one dict per round: round, outcome, recorded plan_id, balancedness (mean over layers) of the placement
    before, of the recorded plan (the placement before when the round had none) and of the new policy's plan, and
    moved experts of both. :class:`InputError` for an unknown policy or a recording without header.
    """
    from fdeplb.orchestration.gating import decide, plan_round
    from fdeplb.placement import POLICIES

    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    source = Recorded(report)
    cfg = replace(source.config, policy=policy)
    placements = _placements(report, source)
    rows = []
    for seen in report.rounds:
        load = report.snapshots.get(seen.round)
        plan = report.stored_plans.get(seen.plan_id) if seen.plan_id else None
        old = plan.old_phy2log if plan is not None else placements.get(seen.placement_plan)
        if load is None or old is None:
            continue
        recorded = decide(load, old, plan.new_phy2log if plan is not None else old, cfg)
        new = plan_round(load, old, cfg)
        rows.append({
            "round": seen.round, "outcome": seen.outcome, "recorded_plan": seen.plan_id,
            "recorded_policy": plan.policy if plan is not None else source.config.policy, "policy": policy,
            "balancedness_before": new.balancedness_before, "balancedness_recorded": recorded.balancedness_after,
            "balancedness_new": new.balancedness_after,
            "moved_recorded": recorded.moved_experts, "moved_new": new.moved_experts,
        })
    return rows


# ---- rebuild into a Redis ------------------------------------------------------------------------------------------
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
    commits = sum(1 for rec in report.audit if rec["machine"] == CLUSTER.name and rec["trigger"] == "commit")
    audit = [(str(rec["id"]), {k: str(v) for k, v in rec.items() if k not in ("type", "id")})
             for rec in report.audit]
    store.import_recording(source.config, plan_id=plan_id, phy2log=phy2log, placement_version=commits,
                           records=records, audit=audit, audit_head=report.chain,
                           snapshots=report.snapshots, plans=list(report.stored_plans.values()))
    return len(audit)


def _final_records(report: ReplayReport) -> dict[str, tuple[str, int, str]]:
    out: dict[str, tuple[str, int, str]] = {}
    header = report.header or {}
    for key, held in (header.get("start") or {}).get("records", {}).items():
        out[key] = (held["state"], int(held["version"]), held.get("plan_id", ""))
    for key, ks in report.final.items():
        out[key] = (ks.state, ks.version, ks.plan_id)
    return out
