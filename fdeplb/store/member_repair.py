"""Repairing a corrupt or deleted membership record from the audit (issue 34, QA HIGH 3, QA H2): the record's
truth is what the last audited record of that rank's membership left (a transition's ``to``, ``version`` and
``generation``, or an earlier repair's, whose note keeps the generation in its ``detail``). When nothing of it is
audited: the machine's initial state at version 0 when the corrupt record says it never transitioned (its
``version`` is 0), or when its version is not there (a deleted record, or one without the field) and the audit
stream provably holds the whole history (:meth:`Repair.whole_audit`: its oldest record chains from nothing, so
it is the first ever appended); otherwise the audit was trimmed and does not tell, so the rank is excluded (fail
closed: EXCLUDED at the corrupt record's version, 0 when it has none; it comes back as an excluded rank does: a new
agent rejoins, or ``rank readmit``).

One rule for every missing record (:meth:`Repair.to_restore`, which the coordinator and every reader apply): it is
"a cluster made before membership" (left missing, read as the initial ACTIVE) only while no member record of any
rank exists and the cluster's generation is 0; otherwise it was deleted and is restored as above, by the
coordinator at its next pass, and shown so by the readers until then (:meth:`Repair.restored_members`).

The rewrite and its audit note (``record_repaired``, on the member record, from = to = the restored state at the
restored version, the corrupt fields, the source and the restored generation in its ``detail``) commit in one
``lua/audit.lua`` call (the note appended, then the record rewritten; nothing when the append fails), queued in a
``MULTI`` / ``EXEC`` WATCHing the record and the coordinator lease: a record fixed or changed meanwhile, or a lease
lost, writes nothing.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_append`` (the registered audit script),
``ep_size``;
from :mod:`fdeplb.store.streams`: :func:`~fdeplb.store.streams.note_fields`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import json
from typing import Any, Collection, Sequence

from fdeplb.errors import CorruptRecordError, FenceError
from fdeplb.machines.tables import MEMBERSHIP, MemberState
from fdeplb.store.connection import as_str as _s, as_text as _text
from fdeplb.store.records import MemberRecord, parse_record
from fdeplb.store.scripts import audit_call, audit_chain
from fdeplb.store.streams import note_fields
from fdeplb.store.txn import transaction

#: the audited trigger of a repair (a note on the member record)
REPAIRED = "record_repaired"

#: audit records read per request while looking back for a rank's last membership record
_BATCH = 500


@dataclass(frozen=True)
class MemberRepair:
    """A repaired member record: the record as restored, where its truth came from (``source``: the audit id of
    the record it restores, ``initial`` or ``excluded``, see the module doc) and the audit id of the
    ``record_repaired`` note."""

    record: MemberRecord
    source: str
    audit_id: str


class Repair:
    """Member-record repair (see the module doc)."""

    def member_of(self, key: str | None) -> int | None:
        """The ep_rank whose member record ``key`` is (e.g. a :class:`CorruptRecordError`'s ``key``), or None."""
        prefix = self._keys.member(0)[:-1]
        tail = key[len(prefix):] if isinstance(key, str) and key.startswith(prefix) else ""
        return int(tail) if tail.isascii() and tail.isdigit() and 0 <= int(tail) < self.ep_size() else None

    def last_member_audit(self, ep_rank: int) -> tuple[str, dict[str, str]] | None:
        """(stream id, fields) of the newest audit record of ``ep_rank``'s membership (a transition or a note on
        it), walking the audit stream back from its end (:meth:`member_audits`); None when the stream holds none."""
        return self.member_audits([int(ep_rank)])[0].get(int(ep_rank))

    def member_audits(self, ranks: Collection[int], after: str = "-"
                      ) -> tuple[dict[int, tuple[str, dict[str, str]]], str]:
        """The newest membership audit record of each of ``ranks`` newer than stream id ``after`` ("-": any):
        ``(ep_rank -> (its stream id, fields), the newest audit id walked)``, walking the stream back from its end
        in batches once for all of them, stopping when each was found or at ``after``. A rank with none is left
        out. The newest id walked is ``after`` when nothing is newer; a caller passes it back as ``after`` to walk
        only what came since."""
        labels = {f"{MEMBERSHIP.key_label}:{int(r)}": int(r) for r in ranks}
        found: dict[int, tuple[str, dict[str, str]]] = {}
        start, end, head = ("(" + after) if after != "-" else "-", "+", after
        while labels:
            batch = self._client.xrevrange(self._keys.audit, end, start, count=_BATCH)
            if batch and end == "+":
                head = _s(batch[0][0])
            for entry_id, raw in batch:
                fields = _text(raw)
                r = labels.pop(fields.get("key", ""), None)
                if r is not None:
                    found[r] = _s(entry_id), fields
            if len(batch) < _BATCH:
                break
            end = "(" + _s(batch[-1][0])
        return found, head

    def to_restore(self, members: Sequence[Any]) -> list[int]:
        """The ranks whose member record is missing in ``members`` (ep_rank order, None where missing, as read) and
        is restored from the audit (see the module doc): every missing one, or none while the cluster was made
        before membership (no member record of any rank, and the cluster's ``generation`` 0 or not written). The
        one rule of the coordinator (:meth:`repair_member`) and of every reader (:func:`fdeplb.status.member_states`).
        One HGET when every record is missing, none otherwise."""
        missing = [r for r, m in enumerate(members) if m is None]
        if len(missing) < len(members):
            return missing
        generation = _s(self._client.hget(self._keys.rearrange, "generation")) or "0"  # commit.lua: none is 0
        made_before_membership = generation.isascii() and generation.isdigit() and int(generation) == 0
        return [] if made_before_membership else missing

    def whole_audit(self) -> bool:
        """Whether the audit stream holds the cluster's whole history: its oldest record chains from nothing (its
        ``chain`` is :func:`~fdeplb.store.scripts.audit_chain` of its other fields after "", so it was the first
        ever appended: no trim removed any before it), or it is empty and no record was ever appended (no audit
        head). One read of the oldest record (two when the stream is empty)."""
        oldest = self._client.xrange(self._keys.audit, "-", "+", count=1)
        if not oldest:
            return not _s(self._client.get(self._keys.audit_head))
        fields = _text(oldest[0][1])
        return fields.pop("chain", "") == audit_chain("", fields)

    def restored_view(self) -> Any:
        """:meth:`~fdeplb.store.liveness.Liveness.member_view` with every missing member record that the leading
        coordinator restores (:meth:`to_restore`) as its next pass restores it (:meth:`restored_members`; writes
        nothing): the view an action judges membership by before that pass (an operator's plan, a drain's last
        member, the weights wait and watchdog), as every reader shows it. :class:`CorruptRecordError` for a member
        record that does not parse, or a missing one whose audit record does not give one."""
        view = self.member_view()
        missing = self.to_restore(view.members)
        if not missing:
            return view
        members = list(view.members)
        for r, restored in self.restored_members(missing).items():
            if isinstance(restored, CorruptRecordError):
                raise restored
            members[r] = restored
        return dataclasses.replace(view, members=members)

    def restored_members(self, ranks: Collection[int]) -> dict[int, MemberRecord | CorruptRecordError]:
        """The record :meth:`repair_member` restores each of ``ranks`` to when its member record is missing (see the
        module doc: as its last audited membership record left it, one walk of the audit for all,
        :meth:`member_audits`; the initial state or EXCLUDED when none is audited, as :meth:`whole_audit` says), a
        :class:`CorruptRecordError` in its place when that audit record does not give one. Writes nothing: what
        readers show of a deleted record before the coordinator's next pass restores it."""
        audited = self.member_audits(ranks)[0] if ranks else {}
        whole = self.whole_audit() if set(ranks) - audited.keys() else False
        out: dict[int, MemberRecord | CorruptRecordError] = {}
        for r in ranks:
            key = self._keys.member(r)
            try:
                out[r] = parse_record(MemberRecord, key, _restored(key, {}, audited.get(r), whole)[1])
            except CorruptRecordError as err:
                out[r] = err
        return out

    def repair_member(self, ep_rank: int, *, fence: str, actor: str) -> MemberRepair | None:
        """Rewrite ``ep_rank``'s member record if it does not parse, or is missing and not "a cluster made before
        membership" (:meth:`to_restore`), as the audit tells (see the module doc), with the ``record_repaired``
        note, atomically; ``fence`` ("" = unfenced): the caller's lease. Returns the repair, or None when the
        record parses, or is missing in a cluster made before membership (nothing written; a record changed
        between the read and the write is read again).
        :class:`FenceError` (nothing written) when ``fence`` does not hold the lease."""
        r, key = int(ep_rank), self._keys.member(ep_rank)
        found = self.last_member_audit(r)
        whole = found is None and self.whole_audit()
        self._client.script_load(self._append.script)  # EVALSHA inside the MULTI below

        def txn(pipe: Any) -> None:  # run again when a WATCHed key changed before EXEC (store.txn)
            done.clear()
            raw = _text(pipe.hgetall(key))
            if not raw and r not in self.to_restore([bool(e) or None for e in self._members_exist()]):
                pipe.unwatch()  # a cluster made before membership: the initial state, as readers take it
                return
            try:
                if raw:
                    parse_record(MemberRecord, key, raw)
                    pipe.unwatch()
                    return  # not corrupt (repaired or rewritten meanwhile)
            except CorruptRecordError:
                pass
            if fence and _s(pipe.get(self._keys.lease)) != fence:
                pipe.unwatch()
                raise FenceError(f"{REPAIRED} on {key}: the lease is not held by {fence}")
            source, restored = _restored(key, raw, found, whole)
            detail = {"ep_rank": r, "source": source, "found": {k: v[:80] for k, v in sorted(raw.items())},
                      **({"generation": int(restored["generation"])} if "generation" in restored else {})}
            text = (f"member record of rank {r} was {_corrupt_of(key, raw)}; " + {
                "initial": "restored as the initial state (it never transitioned: none audited, the audit whole)",
                "excluded": "excluded: the audit holds no membership record of it (trimmed) to restore",
            }.get(source, f"restored as {restored['state']} v{restored['version']} from audit record {source}"))
            call = audit_call(self._keys, fence=fence, delete=[key], hset={key: restored}, audit=note_fields(
                MEMBERSHIP, r, state=restored["state"], version=restored["version"], trigger=REPAIRED, actor=actor,
                round_=restored.get("round", "0"), plan_id="", reason=text, detail=detail))
            pipe.multi()  # the note appended, then the record rewritten: one script, never one without the other
            pipe.execute_command("EVALSHA", self._append.sha, len(call.keys), *call.keys, *call.args)
            done.append((parse_record(MemberRecord, key, restored), source))

        done: list[tuple[MemberRecord, str]] = []
        replies = transaction(self._client, txn, key, self._keys.lease)
        if not done:
            return None
        (reply,) = replies
        if _s(reply[0]) != "OK":  # not reached while the lease is WATCHed; the script's own check, all the same
            raise FenceError(f"{REPAIRED} on {key}: {_s(reply[1])}")
        return MemberRepair(*done[0], _s(reply[1]))

    def _members_exist(self) -> list[int]:
        """EXISTS of every rank's member record, ep_rank order (one round trip)."""
        pipe = self._client.pipeline(transaction=False)
        for r in range(self.ep_size()):
            pipe.exists(self._keys.member(r))
        return pipe.execute()


def _corrupt_of(key: str, raw: dict[str, str]) -> str:
    """What was wrong with the record: ``missing`` (deleted), or ``corrupt (<why>)``."""
    if not raw:
        return "missing (deleted)"
    try:
        parse_record(MemberRecord, key, raw)
    except CorruptRecordError as err:
        return f"corrupt ({str(err).removeprefix(f'{key}: ')})"
    return "parses"


def _restored(key: str, raw: dict[str, str], found: tuple[str, dict[str, str]] | None,
              whole: bool) -> tuple[str, dict[str, str]]:
    """(source, the record fields to write) for the corrupt or missing (``raw`` empty) record ``key``: the state,
    version, generation (a transition's field, a repair note's ``detail``), round, actor and update time of the
    audit record ``found`` (source: its id); without one the initial state at version 0 (``initial``) when the
    corrupt record's version is 0, or it has none and the audit is ``whole`` (:meth:`Repair.whole_audit`); else
    EXCLUDED at that version (``excluded``; 0 when it has none or it does not parse). ``generation`` and
    ``deadline_ms`` (a SUSPECT rank's exclusion deadline; 0 otherwise: a still stale rank is then excluded at once)
    are kept where the audit does not give them and they parse."""
    version = raw.get("version")
    if found is not None:
        source, audit = found
        out = {"state": audit["to"], "version": audit.get("version", "0"), "round": audit.get("round", "0"),
               "actor": audit.get("actor", ""), "updated_ms": audit.get("ts_ms", "0")}
        generation = str(audit.get("generation") or _repaired_generation(audit))
        if generation.isascii() and generation.isdigit():
            out["generation"] = generation
    elif version == "0" or (version is None and whole):
        source, out = "initial", {"state": MEMBERSHIP.initial.value, "version": "0"}
    else:
        source = "excluded"
        out = {"state": MemberState.EXCLUDED.value, "version": version if (version or "").isdigit() else "0"}
    for name in ("generation", "deadline_ms"):
        if name not in out and raw.get(name, "").isdigit():
            out[name] = raw[name]
    parse_record(MemberRecord, key, out)  # a forged audit record that does not give a record: CorruptRecordError
    return source, out


def _repaired_generation(audit: dict[str, str]) -> object:
    """The generation a ``record_repaired`` note's ``detail`` restored ("" for another record, or none)."""
    if audit.get("trigger") != REPAIRED:
        return ""
    try:
        detail = json.loads(audit.get("detail", "") or "{}")
    except ValueError:
        return ""
    value = detail.get("generation", "") if isinstance(detail, dict) else ""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else ""
