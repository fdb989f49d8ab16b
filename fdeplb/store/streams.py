"""The cluster's streams: the audit stream (append-only, chained: ``lua/audit.lua`` appends what is not a
transition, ``lua/commit.lua`` the transitions), the capped events stream (wake-ups that are not transitions), the
capped signal stream rank agents block on; cursors and blocking reads over them; and the one parser of a stream id
(:func:`parse_stream_id`).

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_append`` (the registered script).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from fdeplb.errors import FenceError, InputError
from fdeplb.machines.tables import CLUSTER, MachineTable
from fdeplb.store.connection import MAX_BLOCK_MS, as_str as _s, as_text as _text, typed as _typed
from fdeplb.store.records import ClusterRecord, RecordHeader
from fdeplb.store.scripts import SIGNAL_MAXLEN, audit_call

#: events kept in the capped wake-up stream
EVENTS_MAXLEN = 10_000

#: the largest part of a stream id: Redis keeps both as unsigned 64-bit integers
_U64_MAX = 2**64 - 1
_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")


def detail_text(detail: Mapping[str, Any]) -> str:
    """The audit ``detail`` field of ``detail``: canonical JSON (keys sorted, no spaces, floats as Python's
    shortest round-trip repr), so the chain over it is reproducible. :class:`InputError` for a value JSON cannot
    hold exactly (NaN, inf, a non-string key, an object of another type)."""
    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"audit detail holds a non-finite number {value!r}")
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    try:
        return json.dumps(finite(dict(detail)), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"audit detail is not JSON: {exc}") from None


def detail_field(detail: Mapping[str, Any] | None) -> dict[str, str]:
    """``{"detail": detail_text(detail)}``, or {} for no detail (a record without facts has no such field)."""
    return {"detail": detail_text(detail)} if detail else {}


def note_fields(table: MachineTable, ep_rank: int | None, *, state: str, version: int | str, trigger: str,
                actor: str, round_: int | str, plan_id: str, reason: str,
                detail: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The fields of an audit note (a record that is not a transition) on the cluster record (``table`` CLUSTER) or
    on rank ``ep_rank``'s record of ``table``: ``from`` = ``to`` = ``state``, the record's ``version``; fence,
    ts_ms and chain are added by ``lua/audit.lua``."""
    label = table.name if table is CLUSTER else f"{table.key_label}:{int(ep_rank)}"
    return {"machine": table.name, "key": label, "from": state, "to": state, "trigger": trigger, "actor": actor,
            "round": str(round_), "plan_id": plan_id, "reason": reason, "version": str(version),
            **detail_field(detail)}


def parse_stream_id(text: str) -> tuple[int, int]:
    """A stream id ``<ms>-<seq>`` (e.g. ``1700000000000-0``) as (ms, seq): ASCII digits, both parts, each at most
    2**64 - 1 (the whole text must be the id). :class:`InputError` for anything else (a str that is not one, or
    not a str)."""
    parts = _STREAM_ID.fullmatch(text) if isinstance(text, str) else None
    if parts is None or max(int(p) for p in parts.groups()) > _U64_MAX:
        shown = text[:40] if isinstance(text, str) else type(text).__name__
        raise InputError(f"not a stream id (<ms>-<seq>, like 1700000000000-0): {shown!r}")
    return int(parts[1]), int(parts[2])


@dataclass(frozen=True)
class AuditRecord:
    """One audit (or events) stream entry; ``fields`` holds every field as text (see DESIGN.md section 4)."""

    id: str
    fields: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.fields.get(name, "")

    def __contains__(self, name: object) -> bool:
        """Whether the entry has field ``name`` (without it, ``in`` would iterate through :meth:`__getitem__`, which
        answers "" for any key, and never end)."""
        return name in self.fields


#: an XREAD position per stream, opaque to callers: :meth:`Store.cursor` makes one, :meth:`Store.wait` moves it.
Cursor = dict


class Streams:
    """The audit, events and signal streams (see the module doc)."""

    def append_alarm(self, record: ClusterRecord, *, actor: str, reason: str, fence: str = "",
                     detail: Mapping[str, Any] | None = None) -> str:
        """Append an alarm to the audit stream: ``trigger`` = ``alarm``, ``from`` = ``to`` = the record's state and
        its current ``version`` (not a transition: replays skip it; the record is unchanged). With ``fence``,
        refused (:class:`FenceError`) unless that lease is held. Returns the audit id."""
        return self.append_note(record, trigger="alarm", actor=actor, reason=reason, fence=fence, detail=detail)

    def append_note(self, record: RecordHeader, *, trigger: str, actor: str, reason: str, fence: str = "",
                    detail: Mapping[str, Any] | None = None, table: MachineTable = CLUSTER,
                    ep_rank: int | None = None) -> str:
        """Append a cluster outcome that is not a transition (``alarm``, ``skip``, ``start_refused``) to the audit
        stream: ``from`` = ``to`` = the record's state, its current ``version``; the record is unchanged and
        replays skip it (:data:`fdeplb.replay.NOT_TRANSITIONS`). Appended by ``lua/audit.lua``, so it joins the
        audit chain like a transition; with ``fence``, refused (:class:`FenceError`) unless that lease is held.
        ``detail``: the facts behind ``reason`` as the record's ``detail`` field (:func:`detail_text`).
        ``table`` / ``ep_rank``: a note on a rank's record of that machine instead (``record``: that record; e.g.
        ``takeover_dead_pid`` on a rank record). Returns the stream id."""
        fields = note_fields(table, ep_rank, state=record.state.value, version=record.version, trigger=trigger,
                             actor=actor, round_=record.round, plan_id=record.plan_id, reason=reason, detail=detail)
        call = audit_call(self._keys, fence=fence, audit=fields)
        reply = self._append(keys=call.keys, args=call.args)
        if _s(reply[0]) != "OK":
            raise FenceError(f"{trigger} on {fields['key']}: {_s(reply[1])}")
        return _s(reply[1])

    def emit_event(self, kind: str, **fields: Any) -> str:
        """Append a wake-up event (not a transition) to the capped events stream."""
        body = {"kind": kind, **{k: str(v) for k, v in fields.items()}}
        return _s(self._client.xadd(self._keys.events, body, maxlen=EVENTS_MAXLEN, approximate=True))

    def _signal(self, pipe: Any, what: str) -> None:
        """Queue a signal-stream entry on ``pipe`` (in the same transaction as the cluster-record write it
        announces): rank agents blocked in :meth:`wait` on a :meth:`signal_cursor` wake up."""
        pipe.xadd(self._keys.signal, {"what": what}, maxlen=SIGNAL_MAXLEN, approximate=True)

    def signal_cursor(self) -> Cursor:
        """A position after the latest signal entry: what a rank agent waits on with :meth:`wait`. The signal
        stream gets an entry per cluster transition (commit.lua) and per weight or clear-stat request, so an agent
        wakes once per change of the cluster record, not once per audit record of every rank."""
        last = self._client.xrevrange(self._keys.signal, count=1)
        return {self._keys.signal: _s(last[0][0]) if last else "0-0"}

    def cursor(self, *, events_from: str | None = None) -> Cursor:
        """A position after the latest audit and events entries: where a new waiter starts reading.
        ``events_from`` starts the events stream at that id instead (e.g. "0-0": from its beginning)."""
        out = {}
        for key in (self._keys.audit, self._keys.events):
            with _typed(key):
                last = self._client.xrevrange(key, count=1)
            out[key] = _s(last[0][0]) if last else "0-0"
        if events_from is not None:
            out[self._keys.events] = events_from
        return out

    def wait(self, cursor: Cursor, block_ms: int) -> list[AuditRecord]:
        """Block until a new entry appears in a stream of ``cursor`` (updated in place) or ``block_ms`` passed;
        returns the new entries (audit records have a ``machine`` field, events a ``kind``, signals a ``state`` or a
        ``what``). ``cursor`` comes from :meth:`cursor` (audit + events) or :meth:`signal_cursor`.

        ``XREAD BLOCK`` from the last seen id, so nothing is lost across reconnects (unlike pub/sub).
        """
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        return self._advance(cursor, self._client.xread(cursor, block=block, count=1000))

    @staticmethod
    def _advance(cursor: Cursor, reply: Any) -> list[AuditRecord]:
        """An ``XREAD`` reply as entries, with ``cursor`` moved past them."""
        out = []
        for stream, entries in reply or []:
            stream = _s(stream)
            for entry_id, raw in entries:
                cursor[stream] = _s(entry_id)
                out.append(AuditRecord(_s(entry_id), _text(raw)))
        return out

    def audit(self, start: str = "-", end: str = "+", count: int | None = None) -> list[AuditRecord]:
        """Audit records between stream ids ``start`` and ``end``, oldest first."""
        with _typed(self._keys.audit):
            entries = self._client.xrange(self._keys.audit, start, end, count=count)
        return [AuditRecord(_s(i), _text(raw)) for i, raw in entries]

    def recent_audit(self, count: int) -> list[AuditRecord]:
        """The newest ``count`` audit records (at most), oldest first (what a view of "the last rounds" reads
        without walking the whole stream)."""
        with _typed(self._keys.audit):
            entries = self._client.xrevrange(self._keys.audit, "+", "-", count=max(1, int(count)))
        return [AuditRecord(_s(i), _text(raw)) for i, raw in reversed(entries)]

    def audit_head(self) -> str:
        """The ``chain`` of the newest audit record ("" before the first): the anchor a recording's last chain
        is compared with (see :func:`fdeplb.replay.chain_of`)."""
        return _s(self._client.get(self._keys.audit_head))

    def follow_audit(self, after_id: str, block_ms: int) -> list[AuditRecord]:
        """Audit records after stream id ``after_id`` ("0-0": from the first), blocking up to ``block_ms`` (capped
        at :data:`MAX_BLOCK_MS`) until there is one; [] when none came."""
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        reply = self._client.xread({self._keys.audit: after_id}, block=block, count=1000) or []
        return [AuditRecord(_s(i), _text(raw)) for _stream, entries in reply for i, raw in entries]

    def last_audit_id(self) -> str:
        """Id of the newest audit record ("0-0" when there is none)."""
        last = self._client.xrevrange(self._keys.audit, count=1)
        return _s(last[0][0]) if last else "0-0"

    def audit_length(self) -> int:
        """Number of records in the audit stream."""
        return int(self._client.xlen(self._keys.audit))

    def iter_audit(self, batch: int = 1000) -> Iterator[AuditRecord]:
        """Every audit record, oldest first, in batches."""
        start = "-"
        while True:
            chunk = self.audit(start, "+", count=batch)
            yield from chunk
            if len(chunk) < batch:
                return
            start = "(" + chunk[-1].id
