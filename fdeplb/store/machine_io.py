"""The machine records (the cluster, rank and weight-status hashes): read typed, created, updated outside a
transition, and committed through ``lua/commit.lua`` (state + version + fence checked, guards across records
checked, record written and audit record appended, all in one atomic step), at once or deferred; and a rank agent's
view read after its wait, in one round trip.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_commit`` (the registered script),
``_record_key``, ``_record``, ``_strict``, ``_parse_records``, ``ep_size``, ``now_ms``; from the other parts:
``_deferred_script`` and ``_write_outcomes`` (:mod:`fdeplb.store.deferred`), ``_advance``
(:mod:`fdeplb.store.streams`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import redis

from fdeplb.errors import CorruptRecordError, FenceError, GenerationError, GuardError, StaleStateError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, MachineTable, RankState, TransitionSpec
from fdeplb.store.connection import MAX_BLOCK_MS, as_str as _s, hgetall as _hgetall, typed as _typed
from fdeplb.store.deferred import PendingCall
from fdeplb.store.records import ClusterRecord, RankRecord, WeightRecord, encode_changes, record_type
from fdeplb.store.scripts import CommitCall, commit_call
from fdeplb.store.streams import AuditRecord, Cursor, detail_field
from fdeplb.store.txn import transaction

#: audit fields, in the order they are written (DESIGN.md section 4); version, fence and ts_ms come from the script.
AUDIT_FIELDS = ("machine", "key", "from", "to", "trigger", "actor", "round", "plan_id", "reason")
#: the audit field the script fills with the cluster's membership generation as the commit leaves it
GENERATION_FIELD = "generation"


@dataclass(frozen=True)
class CommitResult:
    """A committed transition: the record's new version, the audit entry id and the server time (ms)."""

    version: int
    audit_id: str
    ts_ms: int


class MachineIO:
    """Reads, writes and commits of the machine records (see the module doc)."""

    def read(self, table: MachineTable, ep_rank: int | None = None) -> Any:
        """The record of ``table`` (of ``ep_rank`` for rank and weights records), typed
        (:class:`ClusterRecord` / :class:`RankRecord` / :class:`WeightRecord`). :class:`NotFoundError` if it does
        not exist, :class:`CorruptRecordError` if it does not parse."""
        key = self._record_key(table, ep_rank)
        return self._record(table, key, _hgetall(self._client, key))

    def read_cluster(self) -> ClusterRecord:
        """The cluster rearrangement record."""
        return self.read(CLUSTER)

    def read_cluster_at(self) -> tuple[ClusterRecord, int]:
        """The cluster record and the server's clock (ms) when it was read, in one round trip (the coordinator
        compares the round's deadline with that time; two round trips on Redis Cluster, whose pipelines refuse
        keyless commands such as TIME). Errors as :meth:`read`."""
        if isinstance(self._client, redis.cluster.RedisCluster):
            return self.read(CLUSTER), self.now_ms()
        key = self._record_key(CLUSTER, None)
        pipe = self._client.pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.time()
        with _typed(key):
            raw, (sec, usec) = pipe.execute()
        return self._record(CLUSTER, key, raw), int(sec) * 1000 + int(usec) // 1000

    def read_rank(self, ep_rank: int) -> RankRecord:
        """The rank record of ``ep_rank``."""
        return self.read(RANK, ep_rank)

    def read_weights(self, ep_rank: int) -> WeightRecord:
        """The weight-status record of ``ep_rank``."""
        return self.read(WEIGHTS, ep_rank)

    def rank_states(self) -> list[tuple[RankState, str]]:
        """Every rank's (state, plan_id), ep_rank order, in one round trip of two fields per rank: what the
        coordinator checks at each wake-up while the ranks load or swap (a whole record is parsed only when it
        needs more). :class:`NotFoundError` for a missing record, :class:`CorruptRecordError` naming the key for a
        state that is not a :class:`RankState` or a record without one."""
        keys = [self._keys.rank(r) for r in range(self.ep_size())]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "state", "plan_id")
        out = []
        for r, (key, (state, plan_id)) in enumerate(zip(keys, pipe.execute())):
            if state is None:  # no record (NotFoundError), or one without a state (its CorruptRecordError)
                rec = self._strict([(RANK, r)])[0]
                out.append((rec.state, rec.plan_id))  # written meanwhile
                continue
            try:
                out.append((RankState(_s(state)), _s(plan_id)))
            except ValueError:
                raise CorruptRecordError(f"{key}: field 'state' holds {_s(state)[:40]!r}, not a valid RankState",
                                         key=key) from None
        return out

    def read_view(self, ep_rank: int) -> tuple[ClusterRecord, RankRecord, WeightRecord]:
        """What a rank agent's reconcile step reads: the cluster record and ``ep_rank``'s rank and weight-status
        records, in one round trip. :class:`NotFoundError` / :class:`CorruptRecordError` as :meth:`read`."""
        cluster, rank, weights = self._strict(self._view_of(ep_rank))
        return cluster, rank, weights

    @staticmethod
    def _view_of(ep_rank: int) -> list[tuple[MachineTable, int | None]]:
        """The records of a rank agent's view, in order: cluster, ``ep_rank``'s rank and weight-status records."""
        return [(CLUSTER, None), (RANK, ep_rank), (WEIGHTS, ep_rank)]

    def wait_view(self, cursor: Cursor, ep_rank: int, block_ms: int, writes: list[PendingCall] = ()
                  ) -> tuple[list[AuditRecord], tuple[ClusterRecord, RankRecord, WeightRecord], list[Any]]:
        """A rank agent's wait, in one round trip: ``writes`` (sent first, in order), then :meth:`wait` on
        ``cursor`` (a :meth:`signal_cursor`), then :meth:`read_view` of ``ep_rank``, all in one pipeline (Redis
        runs a client's pipelined commands in order, the reads as soon as the blocking ``XREAD`` returns).

        Returns (the new signal entries, the view as read after the wait, each write's outcome as :meth:`send`).
        Raises as :meth:`read_view` for the view, :class:`RedisUnavailableError` when the round trip fails (then
        the writes' fate is unknown)."""
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        which = self._view_of(ep_rank)
        keys = [self._record_key(table, r) for table, r in which]
        pipe = self._client.pipeline(transaction=False)
        for w in writes:
            w.queue(pipe)
        pipe.xread(cursor, block=block, count=1000)
        for key in keys:
            pipe.hgetall(key)
        replies = pipe.execute(raise_on_error=False)
        outcomes = self._write_outcomes(writes, replies)
        replies = replies[len(writes):]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        signals = self._advance(cursor, replies[0])
        view = self._strict(which, self._parse_records(which, keys, replies[1:]))
        return signals, tuple(view), outcomes

    def ensure(self, table: MachineTable, ep_rank: int | None = None) -> bool:
        """Create the record in the table's initial state at version 0 unless it exists (both fields in one MULTI,
        so a crash cannot leave a record without a version); True if created."""
        key = self._record_key(table, ep_rank)
        pipe = self._client.pipeline(transaction=True)
        pipe.hsetnx(key, "state", table.initial.value)
        pipe.hsetnx(key, "version", "0")
        created, _ = pipe.execute()
        return bool(created)

    def update(self, table: MachineTable, ep_rank: int | None = None, **changes: Any) -> None:
        """Write fields of a record that are not its state (heartbeat, alarm, reports); names are checked against
        the record type (:class:`InputError` for an unknown one, or for state / version)."""
        fields = encode_changes(record_type(table), changes)
        if fields:
            self._client.hset(self._record_key(table, ep_rank), mapping=fields)

    def heartbeat(self, ep_rank: int, *, safe_point_age_ms: int | None = None, **changes: Any) -> int | None:
        """Stamp ``ep_rank``'s heartbeat with the server's clock (plus any other rank-record ``changes``);
        returns the time written (ms), or None when the rank record is gone (the cluster deleted, Redis lost its
        data): a heartbeat never writes a record anew (WATCHed). ``safe_point_age_ms``: ms since the worker's last
        safe point, written as the server time ``safe_point_ms`` (``now - safe_point_age_ms``); None: not an engine
        (0 written: an engine's last safe point is not left to the agent that replaced it). :class:`InputError` for
        a field the rank record does not have."""
        key = self._record_key(RANK, ep_rank)
        now = self.now_ms()
        changes["safe_point_ms"] = 0 if safe_point_age_ms is None else max(1, now - max(0, int(safe_point_age_ms)))
        fields = encode_changes(record_type(RANK), {**changes, "heartbeat_ms": now})

        def txn(pipe: Any) -> int | None:
            if not pipe.exists(key):
                pipe.unwatch()
                return None
            pipe.multi()
            pipe.hset(key, mapping=fields)
            return now

        return transaction(self._client, txn, key, value_from_callable=True)

    def commit(
        self,
        table: MachineTable,
        spec: TransitionSpec,
        record: Any,
        *,
        actor: str,
        label: str,
        fence: str = "",
        plan_id: str = "",
        round_: int | None = None,
        reason: str = "",
        changes: dict[str, Any] | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> CommitResult:
        """Commit ``spec`` (a transition of ``table``) on ``record`` atomically with its audit record.

        ``label`` names the record in the audit (``cluster``, ``rank:3``); ``plan_id`` is the plan the transition
        concerns (guards with ``same_plan`` compare against it); ``changes`` are other record fields written in the
        same step (checked against the record type); ``detail`` (JSON-able facts behind ``reason``, e.g. a gate's
        figures) is written as the audit record's ``detail`` field, canonical JSON (:func:`detail_text`). Raises :class:`FenceError` (lease not held),
        :class:`StaleStateError` (record changed since read) or :class:`GuardError` (a guard refused); Redis is
        unchanged then.
        """
        call, what = self._commit_call(table, spec, record, actor=actor, label=label, fence=fence, plan_id=plan_id,
                                       round_=round_, reason=reason, changes=changes, detail=detail)
        return self._commit_outcome(self._commit(keys=call.keys, args=call.args), what)

    def deferred_commit(self, table: MachineTable, spec: TransitionSpec, record: Any, *, actor: str, label: str,
                        fence: str = "", plan_id: str = "", round_: int | None = None, reason: str = "",
                        changes: dict[str, Any] | None = None,
                        detail: Mapping[str, Any] | None = None) -> "PendingCall":
        """:meth:`commit`, laid out now and sent with the next :meth:`wait_view` (see :class:`PendingCall`);
        its outcome is a :class:`CommitResult` or the error :meth:`commit` would raise."""
        call, what = self._commit_call(table, spec, record, actor=actor, label=label, fence=fence, plan_id=plan_id,
                                       round_=round_, reason=reason, changes=changes, detail=detail)
        return self._deferred_script(what, self._commit, call, lambda reply: self._commit_outcome(reply, what))

    def _commit_call(self, table: MachineTable, spec: TransitionSpec, record: Any, *, actor: str, label: str,
                     fence: str, plan_id: str, round_: int | None, reason: str,
                     changes: dict[str, Any] | None,
                     detail: Mapping[str, Any] | None = None) -> tuple[CommitCall, str]:
        """The ``commit.lua`` call of a transition, and what it is (for error messages)."""
        round_ = record.round if round_ is None else round_
        audit = {
            "machine": table.name, "key": label, "from": record.state.value, "to": spec.dest.value,
            "trigger": spec.trigger, "actor": actor, "round": str(round_), "plan_id": plan_id, "reason": reason,
        }
        per_rank = any(g.kind.per_rank for g in spec.guards)
        call = commit_call(
            self._keys, record_key=record.key, expected_state=record.state, expected_version=record.version,
            fence=fence, new_state=spec.dest, fields=encode_changes(record_type(table), changes or {}),
            audit={**{k: audit[k] for k in AUDIT_FIELDS}, GENERATION_FIELD: "", **detail_field(detail)},
            guards=spec.guards, effect=spec.effect, plan_id=plan_id,
            plan_key=self._keys.plan(plan_id or "_none"), ep_size=self.ep_size() if per_rank else 0,
            signal=spec.wakes_ranks, generation=record.generation if table is CLUSTER else None,
        )
        return call, f"{table.name} {spec.trigger} on {label}"

    @staticmethod
    def _commit_outcome(reply: Any, what: str) -> CommitResult:
        """``commit.lua``'s reply as a :class:`CommitResult`, or its refusal as the typed error."""
        status = _s(reply[0])
        if status == "OK":
            return CommitResult(version=int(_s(reply[1])), audit_id=_s(reply[2]), ts_ms=int(_s(reply[3])))
        detail = f"{what}: {_s(reply[1])}"
        if status == "ERR_FENCE":
            raise FenceError(detail)
        if status == "ERR_GUARD":
            raise GuardError(detail)
        if status == "ERR_GENERATION":
            raise GenerationError(detail)
        raise StaleStateError(detail)
