"""Fire triggers on machine records stored in Redis: the glue between the tables and the store.

``fire`` follows DESIGN.md section 4: read the record, build a ``transitions`` machine at that state (the model's
initial-state write stays in memory), let the machine check the trigger is legal, then commit through the store's
Lua script (state + version + fence + guards + audit in one step). Memory changes only after the commit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fdeplb.machines.model import RecordModel, build_machine
from fdeplb.machines.tables import CLUSTER, MachineTable, StateEnum, TransitionSpec
from fdeplb.store import CommitResult, PendingCall, Store
from fdeplb.store.records import field_names


@dataclass(frozen=True)
class Fired:
    """Outcome of a committed trigger: the record before, the new state and the commit."""

    before: Any
    state: StateEnum
    commit: CommitResult
    after: Any
    """The record as the commit left it (state, version, updated_ms and the written ``changes``), without a read."""


class RecordHandle:
    """One machine record (cluster, or rank/weights of ``ep_rank``) and the actor that drives it.

    ``fence`` is the lease value of the caller for fenced machines (the cluster machine), else "".
    """

    def __init__(self, store: Store, table: MachineTable, ep_rank: int | None = None, *, actor: str,
                 fence: str = "") -> None:
        self.store = store
        self.table = table
        self.ep_rank = ep_rank
        self.actor = actor
        self.fence = fence
        self.label = table.name if table is CLUSTER else f"{table.key_label}:{int(ep_rank)}"
        self._machine = None  # built on first fire, then reused (building one per call costs ~0.2 ms)
        self._mirror: RecordModel | None = None
        self.committed: Any = None  # see take_committed

    def ensure(self) -> bool:
        """Create the record in the table's initial state if it does not exist (no audit: version 0)."""
        return self.store.ensure(self.table, self.ep_rank)

    def read(self) -> Any:
        """The record as stored now (typed: ClusterRecord, RankRecord or WeightRecord)."""
        return self.store.read(self.table, self.ep_rank)

    def update(self, **changes: Any) -> None:
        """Write fields of the record that are not its state (see :meth:`Store.update`)."""
        self.store.update(self.table, self.ep_rank, **changes)

    def fire(self, trigger: str, *, record: Any = None, plan_id: str | None = None, reason: str = "",
             changes: dict[str, Any] | None = None, round_: int | None = None,
             defer: list[PendingCall] | None = None, detail: dict[str, Any] | None = None) -> Fired | None:
        """Fire ``trigger`` on the record (``record`` = what the caller read; re-read when None).

        ``plan_id`` defaults to the record's plan_id; ``changes`` are other record fields written in the same
        atomic step; ``detail`` the facts behind ``reason`` (the audit record's JSON ``detail`` field, see
        :mod:`fdeplb.rounds.reasons`). Raises IllegalTransitionError, StaleStateError, FenceError or GuardError (all
        :class:`~fdeplb.errors.StateError`); nothing is written then.

        ``defer``: the machine checks the trigger is legal now, but the commit is appended to ``defer`` as a
        :class:`~fdeplb.store.PendingCall` for the caller to send (:meth:`fdeplb.store.Store.wait_view` or
        :meth:`~fdeplb.store.Store.send`, which return its outcome, a refusal included); returns None then, and
        :meth:`take_committed` has the record once the call succeeded.
        """
        rec = record if record is not None else self.read()
        pid = rec.plan_id if plan_id is None else plan_id
        result: dict[str, CommitResult] = {}

        def commit(model: RecordModel, spec: TransitionSpec, _kwargs: dict[str, Any]) -> None:
            kwargs = dict(actor=self.actor, label=self.label, fence=self.fence, plan_id=pid, round_=round_,
                          reason=reason, changes=changes, detail=detail)
            if defer is None:
                result["c"] = self.store.commit(self.table, spec, rec, **kwargs)
                model.version = result["c"].version
                return
            call = self.store.deferred_commit(self.table, spec, rec, **kwargs)
            defer.append(dataclasses.replace(call, then=lambda c: self._remember(rec, spec.dest, c, changes)))

        model = self._model(rec, commit)
        state = model.fire(trigger)
        if defer is not None:
            return None
        c = result["c"]
        return Fired(before=rec, state=state, commit=c, after=self._remember(rec, state, c, changes))

    def _remember(self, rec: Any, state: StateEnum, c: CommitResult, changes: dict[str, Any] | None) -> Any:
        """The record as a commit left it (state, version, updated_ms and the written ``changes``), kept for
        :meth:`take_committed`."""
        names = field_names(type(rec))
        self.committed = dataclasses.replace(rec, state=state, version=c.version, updated_ms=c.ts_ms,
                                             **{k: v for k, v in (changes or {}).items() if k in names})
        return self.committed

    def take_committed(self) -> Any:
        """The record as this handle's last commit left it, once (None if nothing was committed since the last
        call): lets a reconcile loop run the next state's entry work without reading the record again."""
        after, self.committed = self.committed, None
        return after

    def _model(self, rec: Any, commit) -> RecordModel:
        """The handle's model, attached once to a machine of its table, moved (in memory) to ``rec``'s state."""
        if self._machine is None:
            self._mirror = RecordModel(self.table, rec.key, rec.state, rec.version, commit)
            self._machine = build_machine(self.table, self._mirror)
        else:
            self._machine.set_state(rec.state, model=self._mirror)
            self._mirror.version = rec.version
            self._mirror.commit_hook = commit
        return self._mirror
