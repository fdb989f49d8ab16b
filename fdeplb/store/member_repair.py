"""Repairing a corrupt or deleted membership record from the audit (issue 34, QA HIGH 3): the record's truth is
what the last audited record of that rank's membership left (a transition's ``to`` and ``version``, or an earlier
repair's), or the machine's initial state at version 0 when nothing of it was audited and the record says it never
transitioned (its ``version`` is 0 or missing). When the audit does not tell (no record of it, but a version that is
not 0 or does not parse: the audit was trimmed), the rank is excluded instead (EXCLUDED at that version; it comes
back as an excluded rank does: a new agent rejoins, or ``rank readmit``). A *missing* record is restored the same way
when the audit holds a membership record of the rank (it transitioned, so it is not the initial state any more); one
of a rank with no audited membership is left missing, which readers take as the initial ACTIVE v0 (a cluster made
before membership; :meth:`Repair.member_audits` tells the two apart in one walk of the audit). The rewrite and its
audit note (``record_repaired``, on the member record, from = to = the restored state at the restored version, the
corrupt fields in its ``detail``, none for a missing record) commit in one ``lua/audit.lua`` call (the note appended,
then the record rewritten; nothing when the append fails), queued in a ``MULTI`` / ``EXEC`` WATCHing the record and
the coordinator lease: a record fixed or changed meanwhile, or a lease lost, writes nothing.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_append`` (the registered audit script),
``ep_size``;
from :mod:`fdeplb.store.streams`: :func:`~fdeplb.store.streams.note_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

from fdeplb.errors import CorruptRecordError, FenceError
from fdeplb.machines.tables import MEMBERSHIP, MemberState
from fdeplb.store.connection import as_str as _s, as_text as _text
from fdeplb.store.records import MemberRecord, parse_record
from fdeplb.store.scripts import audit_call
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

    def restored_members(self, ranks: Collection[int]) -> dict[int, MemberRecord | CorruptRecordError]:
        """The record :meth:`repair_member` restores each of ``ranks`` to when its member record is missing (as its
        last audited membership record left it; one walk of the audit for all, :meth:`member_audits`), a
        :class:`CorruptRecordError` in its place when that audit record does not give one; a rank with none
        audited is left out (the initial state, as readers take it). Writes nothing: what readers show of a
        deleted record before the coordinator's next pass restores it."""
        out: dict[int, MemberRecord | CorruptRecordError] = {}
        for r, found in self.member_audits(ranks)[0].items():
            key = self._keys.member(r)
            try:
                out[r] = parse_record(MemberRecord, key, _restored(key, {}, found)[1])
            except CorruptRecordError as err:
                out[r] = err
        return out

    def repair_member(self, ep_rank: int, *, fence: str, actor: str) -> MemberRepair | None:
        """Rewrite ``ep_rank``'s member record if it does not parse, or is missing while the audit holds a
        membership record of the rank, as its last audited record left it (see the module doc), with the
        ``record_repaired`` note, atomically; ``fence`` ("" = unfenced): the caller's lease. Returns the repair,
        or None when the record parses, or is missing with no audited membership (nothing written; a record
        changed between the read and the write is read again).
        :class:`FenceError` (nothing written) when ``fence`` does not hold the lease."""
        r, key = int(ep_rank), self._keys.member(ep_rank)
        found = self.last_member_audit(r)
        self._client.script_load(self._append.script)  # EVALSHA inside the MULTI below

        def txn(pipe: Any) -> None:  # run again when a WATCHed key changed before EXEC (store.txn)
            done.clear()
            raw = _text(pipe.hgetall(key))
            if not raw and found is None:  # never transitioned: the initial state, as readers take it
                pipe.unwatch()
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
            source, restored = _restored(key, raw, found)
            detail = {"ep_rank": r, "source": source, "found": {k: v[:80] for k, v in sorted(raw.items())}}
            text = (f"member record of rank {r} was {_corrupt_of(key, raw)}; " + {
                "initial": "restored as the initial state (it never transitioned, none audited)",
                "excluded": "excluded: the audit holds no membership record of it (trimmed?) to restore",
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


def _corrupt_of(key: str, raw: dict[str, str]) -> str:
    """What was wrong with the record: ``missing`` (deleted), or ``corrupt (<why>)``."""
    if not raw:
        return "missing (deleted)"
    try:
        parse_record(MemberRecord, key, raw)
    except CorruptRecordError as err:
        return f"corrupt ({str(err).removeprefix(f'{key}: ')})"
    return "parses"


def _restored(key: str, raw: dict[str, str], found: tuple[str, dict[str, str]] | None) -> tuple[str, dict[str, str]]:
    """(source, the record fields to write): the state, version, generation, round, actor and update time of the
    audit record ``found`` (source: its id); without one the initial state at version 0 (``initial``) when the
    corrupt record's version is 0 or missing, else EXCLUDED at that version (``excluded``, 0 when it does not
    parse). ``generation`` and ``deadline_ms`` (a SUSPECT rank's exclusion deadline; 0 otherwise: a still stale
    rank is then excluded at once) are kept where the audit does not give them and they parse."""
    version = raw.get("version", "0")
    if found is not None:
        source, audit = found
        out = {"state": audit["to"], "version": audit.get("version", "0"), "round": audit.get("round", "0"),
               "actor": audit.get("actor", ""), "updated_ms": audit.get("ts_ms", "0")}
        if audit.get("generation", "").isdigit():
            out["generation"] = audit["generation"]
    elif version == "0":
        source, out = "initial", {"state": MEMBERSHIP.initial.value, "version": "0"}
    else:
        source = "excluded"
        out = {"state": MemberState.EXCLUDED.value, "version": version if version.isdigit() else "0"}
    for name in ("generation", "deadline_ms"):
        if name not in out and raw.get(name, "").isdigit():
            out[name] = raw[name]
    parse_record(MemberRecord, key, out)  # a forged audit record that does not give a record: CorruptRecordError
    return source, out
