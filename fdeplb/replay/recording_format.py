"""The recording format (schema :data:`SCHEMA`, ``docs/recordings.md``), defined once, and its reader.

:func:`fdeplb.recording.export_recording` writes recordings with these constants; :func:`parse_lines` /
:func:`read_export` read them back. Each line is validated by a strict pydantic model, chosen by the line's
``type`` (a discriminated union; a line without ``type`` is an audit record, as fdeplb wrote them before schema 1):

- ``header``: :class:`HeaderLine`;
- ``audit``: :class:`AuditFields`, every field of the stream entry, text or an integer (the export writes
  :data:`INT_FIELDS` as integers). The reader turns them back into the stream's text here, once
  (:func:`decimal_text`), so the chain, the checks and a rebuild all see what Redis held;
- ``snapshot``: :class:`SnapshotLine`;
- ``plan``: a :class:`~fdeplb.store.PlanEntry` (:meth:`~fdeplb.store.PlanEntry.from_json`).

Arrays are :mod:`fdeplb.array_json` objects. Every problem is a :class:`~fdeplb.errors.ReplayError` whose message
starts ``line N:`` (the CLI's exit 1); a file that cannot be opened is an :class:`~fdeplb.errors.InputError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, Literal, Union

import numpy as np
from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PlainValidator, StrictInt,
                      StrictStr, Tag, TypeAdapter, ValidationError, ValidationInfo, field_validator)

from fdeplb.array_json import array_from_json
from fdeplb.errors import ReplayError
from fdeplb.input_files import open_input
from fdeplb.store import PlanEntry

__all__ = ["INT_FIELDS", "LINE_TYPES", "MAX_LINE_BYTES", "OLDEST_SCHEMA", "REQUIRED", "SCHEMA", "AuditFields", "AuditLine",
           "HeaderLine", "SnapshotLine", "decimal_text", "field_int", "parse_lines", "read_export"]

#: version of the recording format written by this fdeplb (bumped on any incompatible change). Schema 2: audit
#: records may carry ``detail``, the JSON facts behind their reason (:mod:`fdeplb.rounds.reasons`).
#: Schema 3: every balancedness figure (a plan's, a gate's) is over the round's members, which a gate's detail
#: names (``live_ranks``) when some rank is not one (before: over every rank); a gated ``load`` carries the gate's
#: figures (``detail.gate``). A recording of an older schema replays with its figures over every rank
SCHEMA = 3
#: oldest schema this fdeplb still reads (schema 1: the same lines, reasons in text only)
OLDEST_SCHEMA = 1
#: audit fields the export writes as integers in JSON (the stream stores text); the reader takes any field as
#: text or an integer, and turns integers back into text (:func:`decimal_text`)
INT_FIELDS = ("version", "round", "ts_ms")
#: line types of a recording
LINE_TYPES = ("header", "audit", "snapshot", "plan")
#: fields every exported audit record must have
REQUIRED = ("machine", "key", "from", "to", "trigger", "version")
#: longest line accepted (a plan line of DeepSeek-V3 is under 1 MiB; this stops a runaway read of a non-JSONL file)
MAX_LINE_BYTES = 16 * 1024 * 1024


def decimal_text(value: str | int) -> str:
    """An audit field's value as the stream holds it: text as it is, an integer as its decimal text. The one
    int-to-text step between a recording and the stream (the audit line model and
    :func:`fdeplb.replay.chain_of` use it)."""
    return value if isinstance(value, str) else str(value)


#: an audit field: text, or an integer the export wrote for text (never a bool, a float, null, a list or an object)
Text = Annotated[Union[StrictStr, StrictInt], AfterValidator(decimal_text)]


class _Strict(BaseModel):
    """No coercion (``"1"`` is not an integer, ``1`` not text, ``true`` neither); unknown fields are kept."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


# ---- audit ---------------------------------------------------------------------------------------------------------
class AuditFields(_Strict):
    """An audit line: the fields of :data:`REQUIRED` and any others (``id``, ``reason``, ``chain`` ...), each text
    or an integer, all kept as text."""

    __pydantic_extra__: dict[str, Text]

    type: Literal["audit"] = "audit"
    machine: Text
    key: Text
    from_: Text = Field(alias="from")
    to: Text
    trigger: Text
    version: Text


# ---- header --------------------------------------------------------------------------------------------------------
class StartRecord(_Strict):
    state: StrictStr
    version: StrictInt
    plan_id: StrictStr = ""


class StartPlacement(_Strict):
    plan_id: StrictStr
    phy2log: Any = None  # decoded where it is used (fdeplb.replay.recompute.Recorded.start_placement)


class Start(_Strict):
    chain: StrictStr
    records: dict[str, StartRecord]
    placement: StartPlacement | None = None
    generation: Annotated[StrictInt, Field(ge=0)] | None = None  # the membership generation (None: not exported)


class Contents(_Strict):
    records: StrictInt = 0
    snapshots: list[StrictInt] = []
    plans: list[StrictStr] = []


class Missing(_Strict):
    snapshots: list[StrictInt] = []
    plans: list[StrictStr] = []


class Range(_Strict):
    round: Any = None
    first_id: StrictStr | None = None
    last_id: StrictStr | None = None


class HeaderLine(_Strict):
    """The first line: the cluster configuration, the exported range and where it starts, what the file holds."""

    type: Literal["header"]
    schema_version: Annotated[StrictInt, Field(alias="schema", ge=OLDEST_SCHEMA, le=SCHEMA)]
    config: dict[str, Any]
    start: Start
    contents: Contents = Contents()
    missing: Missing = Missing()
    range: Range = Range()


#: what a header's part must be, by its path ("*": any key), for the message naming the first part that is not
HEADER_PARTS = {
    ("config",): "an object (the cluster configuration)",
    ("start",): "an object {chain, records, placement, generation}",
    ("start", "generation"): "an integer >= 0 (the membership generation)",
    ("start", "chain"): "text",
    ("start", "records"): "an object of machine records",
    ("start", "records", "*"): "{state: text, version: integer, plan_id: text}",
    ("start", "placement"): "null or {plan_id: text, phy2log: array}",
    ("contents",): "{records: integer, snapshots: [round], plans: [plan_id]}",
    ("missing",): "{snapshots: [round], plans: [plan_id]}",
    ("range",): "{round, first_id: text or null, last_id: text or null}",
}


# ---- snapshot and plan ---------------------------------------------------------------------------------------------
class SnapshotLine(_Strict):
    """A round's load snapshot: ``round``, ``expert_load`` (int64 [L, E]) and, when the cluster kept it, its split
    per source rank ``source_load`` (int64 [L, ep_size, E], summing over ranks to ``expert_load``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    type: Literal["snapshot"]
    round: StrictInt
    expert_load: np.ndarray = Field(None, validate_default=True)  # missing: array_from_json's own words
    source_load: np.ndarray | None = None

    @field_validator("expert_load", mode="plain")
    @classmethod
    def _array(cls, value: Any, info: ValidationInfo) -> np.ndarray:
        return array_from_json(value, f"line {info.context['line']}: snapshot of round {info.data.get('round')}")

    @field_validator("source_load", mode="plain")
    @classmethod
    def _split(cls, value: Any, info: ValidationInfo) -> np.ndarray | None:
        where = f"line {info.context['line']}: snapshot of round {info.data.get('round')} per source rank"
        split = array_from_json(value, where)
        total = info.data.get("expert_load")
        if split.ndim != 3 or total is None or not np.array_equal(split.sum(axis=1), total):
            raise ReplayError(f"{where}: shape {split.shape} does not sum over source ranks to its expert_load")
        return split


def _plan(value: Any, info: ValidationInfo) -> PlanEntry:
    where = f"line {info.context['line']}"
    if not value.get("plan_id"):
        raise ReplayError(f"{where}: plan without plan_id, or a second plan {value.get('plan_id', '')}")
    return PlanEntry.from_json(value, where, error=ReplayError)


def _line_type(value: Any) -> str:
    return value.get("type", "audit")


#: one line of a recording, by its ``type``; a plan line is validated by PlanEntry.from_json, its one JSON reader
LINE = TypeAdapter(Annotated[
    Union[Annotated[HeaderLine, Tag("header")], Annotated[AuditFields, Tag("audit")],
          Annotated[SnapshotLine, Tag("snapshot")], Annotated[Any, PlainValidator(_plan), Tag("plan")]],
    Discriminator(_line_type)])


# ---- reading -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditLine:
    """One parsed line of a recording: its 1-based ``line`` number, the object (an audit line's fields all as
    text, the stream's form; any other line as read) and, but for an audit line, the validated ``value``
    (:class:`HeaderLine`, :class:`SnapshotLine` or :class:`~fdeplb.store.PlanEntry`)."""

    line: int
    record: dict[str, Any]
    value: Any = None

    @property
    def type(self) -> str:
        return str(self.record.get("type", "audit"))

    @property
    def where(self) -> str:
        rid = self.record.get("id")
        return f"line {self.line}" + (f" (audit id {rid})" if rid else "")


def field_int(line: AuditLine, name: str) -> int:
    """An audit line's field ``name`` (its decimal text) as an int; :class:`ReplayError` naming the line for anything
    else (1.5, true, [], "--1", "²")."""
    value = line.record.get(name, "")
    if not re.fullmatch(r"\s*-?\d+\s*", value):  # what int() reads, no "--1", no "²"
        raise ReplayError(f"{line.where}: {name} is not an integer: {value!r}")  # 1.5, true, [] ...
    return int(value)


def read_line(n: int, record: Any) -> AuditLine:
    """Line ``n``'s JSON value checked against the format; :class:`ReplayError` naming the line otherwise."""
    if not isinstance(record, dict):
        raise ReplayError(f"line {n}: expected a JSON object, got {type(record).__name__}")
    kind = record.get("type", "audit")
    if kind not in LINE_TYPES:
        raise ReplayError(f"line {n}: unknown line type {kind!r}; expected one of {', '.join(LINE_TYPES)}")
    try:
        value = LINE.validate_python(record, context={"line": n})
    except ValidationError as exc:
        raise _refusal(n, kind, record, [(err["loc"][1:], err) for err in exc.errors()]) from None
    if kind == "audit":
        text = value.model_dump(by_alias=True)
        return AuditLine(n, {name: text[name] for name in record})
    return AuditLine(n, record, value)


def _refusal(n: int, kind: str, record: dict[str, Any], errors: list[tuple[tuple, dict]]) -> ReplayError:
    """The message for the first problem of line ``n`` (in the order the hand-written checks had)."""
    cause = (errors[0][1].get("ctx") or {}).get("error")
    if isinstance(cause, ReplayError):  # an array or a plan: its own words, naming the line
        return cause
    if kind == "audit":
        missing = [str(loc[0]) for loc, err in errors if err["type"] == "missing"]
        if missing:
            return ReplayError(f"line {n}: audit record without {', '.join(missing)}")
        name = min((str(loc[0]) for loc, _ in errors), key=list(record).index)  # the first in the line
        return ReplayError(f"line {n}: audit field {name} is {type(record[name]).__name__}, not text")
    if kind == "header":
        if any(loc[:1] == ("schema",) for loc, _ in errors):
            return ReplayError(f"line {n}: recording schema {record.get('schema')!r}; this fdeplb reads schemas "
                               f"{OLDEST_SCHEMA} to {SCHEMA}")
        loc = errors[0][0]
        for depth in range(len(loc), 0, -1):
            path = tuple(str(p) for p in loc[:depth])
            want = HEADER_PARTS.get(path) or HEADER_PARTS.get((*path[:-1], "*"))
            if want is not None:
                return ReplayError(f"line {n}: not a recording header: {'.'.join(path)} is not {want}")
        return ReplayError(f"line {n}: not a recording header: {'.'.join(map(str, loc))}: {errors[0][1]['msg']}")
    if kind == "snapshot":  # its round (its array speaks for itself, above)
        return ReplayError(f"line {n}: round is not an integer: {record.get('round', '')!r}")
    return ReplayError(f"line {n}: not a {kind} line: {errors[0][1]['msg']}")


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
        yield read_line(n, record)


def read_export(path: str | Path) -> Iterator[AuditLine]:
    """The parsed lines of a recording file; :class:`InputError` (exit 2) if it cannot be read."""
    # a regular file only (a FIFO or a device is refused, never waited on), of any size: it is read line by line
    handle = open_input(path, "recording", max_bytes=None)
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
