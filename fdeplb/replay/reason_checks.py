"""What a record says besides its states, checked against the records as replayed (the reasons and facts of
:mod:`fdeplb.rounds.reasons`): the notes (an alarm, skip, start refusal or weight withdrawal names the
cluster in its replayed state and version; skips and refusals only in FREE; a refusal names ranks of the cluster
and stays in force until a start), the start after a refusal shows every refused rank fresh again, a cordoned
cluster's commit names its external request, a weight ``updated`` names the current placement, a ``swapped``'s
``probe_mismatch`` names ranks of the cluster and a supplied round's ``load`` says what it goes back to. From
schema 2 on the facts are read from the record's ``detail`` only, and its ``reason`` must be the text they give.

:class:`RecordSays` is mixed into the machine replay (``fdeplb.replay.machine_replay._Replay``); of its host it
uses ``report``, ``ep_size``, ``schema``, ``cordoned``, ``placement_known``, ``refused``, ``weight_requests``,
``_state_of`` and ``_restart``.
"""

from __future__ import annotations

from fdeplb.errors import InputError, ReplayError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, WEIGHTS, MachineTable, MemberState, TransitionSpec
from fdeplb.replay.recording_format import AuditLine, field_int
from fdeplb.replay.report import ConfigNote
from fdeplb.rounds import reasons
from fdeplb.store.liveness import stale_of
from fdeplb.replay.start_state import NOTES_ON_RANKS

__all__ = ["RecordSays", "read_detail"]


class RecordSays:
    """The reason and note checks of a replay (see the module doc)."""

    def _note(self, line: AuditLine, table: MachineTable, state: str, version: int) -> None:
        """An alarm, skip, start refusal or weight withdrawal, on the record the replay holds in ``state`` at
        ``version``: on the cluster as replayed (a takeover or a repair, :data:`NOTES_ON_RANKS`, on the rank's
        record as replayed: a repaired record holds what its audited transitions left, or is excluded from there
        on); skips and refusals only in FREE (the coordinator's FREE entry work writes them); a refusal names ranks
        of the cluster and stays in force until a start."""
        rec, trigger = line.record, line.record["trigger"]
        if trigger == "record_repaired" and self._repair_excludes(line, table):
            state, version = rec["to"], field_int(line, "version")
            self._restart(line, table, rec["key"], state, version)
        if table is not CLUSTER and trigger not in NOTES_ON_RANKS:
            raise ReplayError(f"{line.where}: {trigger} on {rec['key']}; it is raised on the cluster record")
        if rec["from"] != state or rec["to"] != state or field_int(line, "version") != version:
            held = "the cluster" if table is CLUSTER else rec["key"]
            raise ReplayError(f"{line.where}: {trigger} for {rec['key']} {rec['from']} v{rec['version']}, but "
                              f"{held} is {state} v{version} in the replay")
        if trigger in ("skip", "start_refused") and state != CLUSTER.initial:
            raise ReplayError(f"{line.where}: {trigger} while the cluster is {state}; starts are decided in "
                              f"{CLUSTER.initial.value} only")
        if trigger == "start_refused":
            stale = self._detail(line, reasons.stale_ranks, lambda v: reasons.refusal(v).text)
            if stale is None:
                raise ReplayError(f"{line.where}: start_refused without its stale ranks: "
                                  f"{rec.get('reason', '')[:80]!r}")
            strays = [r for r in stale if self.ep_size is not None and r >= self.ep_size]
            if strays:
                raise ReplayError(f"{line.where}: start_refused names ranks {strays}; the cluster has ranks "
                                  f"0..{self.ep_size - 1}")
            self.refused = (line.where, stale)
        elif trigger == "weights_cancelled":
            self.weight_requests.cancelled(line)
        elif trigger == "config_changed":  # the settings as changed from here on (``fdeplb config set``)
            note = self.config_note(line)
            if "cordoned" in note.changes:
                self.cordoned = bool(note.changes["cordoned"][1])

    def config_note(self, line: AuditLine) -> ConfigNote:
        """A ``config_changed`` note's :class:`~fdeplb.replay.report.ConfigNote`, appended to the report's
        ``config_changes`` (also for a note past ``--until``: the header's configuration is the range's end, and
        the notes lead back from it to where the range starts)."""
        try:
            detail = reasons.detail_of(line.record) or {}
            changes, version = dict(detail.get("changes", {})), int(detail.get("version", 0))
            if not all(isinstance(v, list) and len(v) == 2 for v in changes.values()):
                raise ValueError("changes are not {name: [old, new]}")
        except (ValueError, TypeError) as exc:
            raise ReplayError(f"{line.where}: config_changed detail is not what the note carries: {exc}") from None
        note = ConfigNote(field_int(line, "round"), changes, line.where, version)
        self.report.config_changes.append(note)
        return note

    def _repair_excludes(self, line: AuditLine, table: MachineTable) -> bool:
        """Whether a ``record_repaired`` note is a member record's exclusion (detail ``source`` ``excluded``: the
        audit did not hold its truth, :mod:`fdeplb.store.member_repair`); :class:`ReplayError` for one that says so
        on another machine or into another state. Any other repair restores what the replay holds."""
        source = self._detail(line, lambda rec: (reasons.detail_of(rec) or {}).get("source"))
        if source != "excluded":
            return False
        if table is not MEMBERSHIP or line.record["to"] != MemberState.EXCLUDED.value:
            raise ReplayError(f"{line.where}: record_repaired excluding {line.record['key']} into "
                              f"{line.record['to']}; only a member record is excluded by a repair")
        return True

    def _check_reason(self, line: AuditLine, table: MachineTable, spec: TransitionSpec, plan_id: str) -> None:
        """What a transition's record says besides its states, checked against the replayed records: the start
        after a refusal shows every refused rank fresh again; a cordoned cluster commits on an external request
        only; a weight update reloads the cluster's current placement."""
        reason, where = line.record.get("reason", ""), line.where
        if table is CLUSTER and spec.trigger == "start" and self.refused is not None:
            refused_at, stale = self.refused
            beats = self._detail(line, reasons.heartbeats, lambda v: reasons.fresh(v).text) or {}
            for r in sorted(stale):
                if self._state_of(f"{MEMBERSHIP.key_label}:{r}", MEMBERSHIP)[0] == MemberState.EXCLUDED.value:
                    continue  # the start ignores excluded ranks
                age, ttl = beats.get(r, (None, 0))
                if age is None or stale_of({r: (age, ttl)}):
                    shown = "no heartbeat of it" if age is None else f"its heartbeat {age} ms old (ttl {ttl} ms)"
                    raise ReplayError(f"{where}: cluster start over stale rank {r} (start refused at "
                                      f"{refused_at}): the start shows {shown}")
            self.refused = None
        elif table is CLUSTER and spec.trigger == "start":
            self.refused = None
        if table is CLUSTER and spec.trigger == "commit" and self.cordoned and \
                self._detail(line, reasons.requested_by, lambda v: reasons.external_commit(v).text) is None:
            raise ReplayError(f"{where}: cluster commit of a cordoned cluster without an external request "
                              f"(reason {reason[:80]!r})")
        if table is CLUSTER and spec.trigger == "swapped":  # a probe_mismatch names ranks of the cluster
            failed = self._detail(line, reasons.probe_mismatches, lambda v: reasons.probe_mismatch(v).text) or []
            strays = [i["ep_rank"] for i in failed if self.ep_size is not None and i["ep_rank"] >= self.ep_size]
            if strays:
                raise ReplayError(f"{where}: probe_mismatch names ranks {strays}; the cluster has ranks "
                                  f"0..{self.ep_size - 1}")
        if table is CLUSTER and spec.trigger == "load":  # a round to a supplied placement says which and why
            self._detail(line, reasons.supplied_of, lambda v: reasons.supplied_round(**v).text)
        if table is WEIGHTS and spec.trigger == "updated" and self.placement_known \
                and plan_id != self.report.placement_plan:
            raise ReplayError(f"{where}: {line.record['key']} updated into placement {plan_id or 'initial'}, but "
                              f"the cluster's current placement is {self.report.placement_plan or 'initial'} (an "
                              f"update reloads the current placement)")

    def _request_of(self, line: AuditLine) -> int | None:
        return self._detail(line, reasons.request_of)

    def _detail(self, line: AuditLine, read, derive=None):
        """:func:`read_detail` of ``line``; None for a record without ``detail`` in a recording of schema 2 or
        later (the facts are in the detail: its text alone proves nothing)."""
        if self.schema >= 2 and not line.record.get("detail"):
            return None
        return read_detail(line, read, derive)


def read_detail(line: AuditLine, read, derive=None):
    """``read(record)`` (a :mod:`fdeplb.rounds.reasons` reader of the record's structured ``detail``, or of
    its text in a schema 1 recording). With ``derive`` (value -> the reason text it gives) and a ``detail`` field,
    the record's ``reason`` must be that text: the text is derived from the facts, never a second source. A
    ``detail`` that is not a JSON object of the right shape, or a text that does not match it, is a
    :class:`ReplayError` naming the line."""
    try:
        value = read(line.record)
    except (ValueError, TypeError, KeyError, InputError) as exc:
        raise ReplayError(f"{line.where}: detail is not what a {line.record.get('trigger', '')} record carries: "
                          f"{exc}") from None
    if derive is not None and value is not None and line.record.get("detail"):
        expected = derive(value)
        if line.record.get("reason", "") != expected:
            raise ReplayError(f"{line.where}: reason {str(line.record.get('reason', ''))[:80]!r} is not what its "
                              f"detail says ({expected[:80]!r})")
    return value
