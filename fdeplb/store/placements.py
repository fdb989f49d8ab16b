"""Plans and the current placement: stored plans (write-once, content-addressed; their hash through
:meth:`fdeplb.store.PlanEntry.to_fields` / :meth:`~fdeplb.store.PlanEntry.from_fields`), the new phy2log of one
(at once or deferred), the cluster's current placement (written by ``commit.lua``'s ``set_placement`` effect), the
corruption checks of a placement table on read (int64 [L, P], expert ids in [0, E)), which ranks' routing
tables disagree with the placement, and a placement supplied for the next round (a rollback).

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``cluster``, ``_array``, ``_put_once``,
``read_config``, ``read_all``; from :mod:`fdeplb.store.windows`: ``_loads``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from fdeplb.errors import CorruptRecordError, InputError, NotFoundError
from fdeplb.machines.tables import RANK
from fdeplb.placement import routing_digest
from fdeplb.store.connection import as_str as _s, as_text as _text, hgetall as _hgetall
from fdeplb.store.deferred import PendingCall
from fdeplb.store import arrays
from fdeplb.store.plan_entry import PlanEntry, json_text
from fdeplb.store.records import ClusterRecord, PlacementEntry, has_control_character, parse_record
from fdeplb.store.txn import transaction


class Placements:
    """Plans and the current placement (see the module doc)."""

    def save_plan(self, plan: PlanEntry) -> bool:
        """Store ``plan``; write-once (plans are content-addressed: False if this plan_id is stored)."""
        return self._put_once(self._keys.plan(plan.plan_id), plan.to_fields(), plan.round)

    def read_plan(self, plan_id: str) -> PlanEntry | None:
        """The stored plan ``plan_id`` or None; :class:`CorruptRecordError` if a field does not parse, or an array is
        of the wrong dtype, shape or range for the cluster."""
        if not plan_id:
            return None
        key = self._keys.plan(plan_id)
        raw = {_s(k): v for k, v in _hgetall(self._client, key).items()}
        if not raw:
            return None
        plan = PlanEntry.from_fields(key, raw, plan_id)
        self._loads(key, plan.expert_load)
        for name in ("old_phy2log", "new_phy2log"):
            self._table(key, getattr(plan, name), name)
        return plan

    def plan_phy2log(self, plan_id: str) -> np.ndarray | None:
        """Only the new phy2log (int64 [L, P]) of plan ``plan_id``, or None if no such plan is stored;
        :class:`CorruptRecordError` naming the key for a table of the wrong dtype, shape or expert ids."""
        if not plan_id:
            return None
        key = self._keys.plan(plan_id)
        arr = self._array(key, "new_phy2log")
        return None if arr is None else self._table(key, arr, "new_phy2log")

    def has_plan(self, plan_id: str) -> bool:
        """Whether plan ``plan_id`` is stored (one EXISTS; its content is checked by :meth:`plan_phy2log`)."""
        return bool(plan_id) and bool(self._client.exists(self._keys.plan(plan_id)))

    def deferred_plan_read(self, plan_id: str) -> PendingCall:
        """:meth:`plan_phy2log` as a :class:`PendingCall` (for :meth:`send`, next to a commit)."""
        key = self._keys.plan(plan_id)
        names = ["new_phy2log", "new_phy2log:dtype", "new_phy2log:shape"]

        def outcome(reply: Any) -> np.ndarray | None:
            if isinstance(reply, Exception):
                raise reply
            arr = self._array(key, names[0], dict(zip(names, reply)))
            return None if arr is None else self._table(key, arr, names[0])

        return PendingCall(f"plan {plan_id}", lambda pipe: pipe.hmget(key, names), outcome)

    def current_placement(self) -> PlacementEntry:
        """The cluster's current placement; :class:`NotFoundError` if the cluster has none."""
        raw = {_s(k): v for k, v in _hgetall(self._client, self._keys.placement).items()}
        phy2log = self._array(self._keys.placement, "phy2log", raw)
        if phy2log is None:
            raise NotFoundError(f"cluster {self.cluster!r} has no current placement")
        phy2log = self._table(self._keys.placement, phy2log, "phy2log")
        try:
            version = int(raw.get("version", b"0") or 0)
        except ValueError:
            key = self._keys.placement
            raise CorruptRecordError(f"{key}: version is not an integer", key=key) from None
        members = _s(raw.get("members", b""))
        if members and not all(x.isascii() and x.isdigit() and int(x) < self.ep_size() for x in members.split(",")):
            key = self._keys.placement
            raise CorruptRecordError(f"{key}: members {members[:60]!r} is not a list of ep_ranks", key=key)
        return PlacementEntry(plan_id=_s(raw.get("plan_id", b"")), phy2log=phy2log, version=version, members=members)

    # ---- a placement supplied for the next round (a rollback) -----------------------------------------------------
    def supply_placement(self, phy2log: np.ndarray, facts: dict[str, Any], *,
                         check: Callable[[ClusterRecord], None] | None = None) -> None:
        """Store ``phy2log`` (int64 [L, P], checked against the configuration: :class:`InputError` otherwise,
        nothing written) as the placement the next round goes to instead of planning one, with its ``facts``
        (JSON-able: what :func:`fdeplb.rounds.reasons.supplied_round` takes). Replaces an earlier one; kept
        until :meth:`drop_supplied_placement` (the round that commits it), never pruned by retention.

        ``check``: called with the cluster record inside a transaction that WATCHes it and the supplied placement
        (run again when either changes before the write); what it raises is raised, nothing written. A rule on
        the cluster as the placement is written (an operator's plan: only while FREE, none waiting); ``facts`` is
        read after it (it may fill them in). A text of ``facts`` with a control character is refused
        (:class:`InputError`, nothing written; one stored before is corrupt to :meth:`supplied_placement`): the
        round's request reason is made of them, and a request reason holds none
        (:func:`~fdeplb.store.records.check_request_reason`), so the coordinator could never request that round."""
        arr = np.asarray(phy2log)
        try:
            self._table(self._keys.supplied_placement, arr, "phy2log")
        except CorruptRecordError as err:
            raise InputError(f"supplied placement: {err}") from None
        key, cluster = self._keys.supplied_placement, self._keys.rearrange

        def txn(pipe: Any) -> None:
            if check is not None:
                check(parse_record(ClusterRecord, cluster, _text(_hgetall(pipe, cluster))))
            # after the check: ``facts`` may name what it read (the round the plan follows)
            _check_facts_text(facts)
            mapping = {**arrays.encode("phy2log", arr), "facts": json_text(facts), "supplied_ms": str(self.now_ms())}
            pipe.multi()
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)

        transaction(self._client, txn, cluster, key)

    def supplied_placement(self) -> tuple[np.ndarray, dict[str, Any]] | None:
        """(phy2log int64 [L, P], facts) of the placement supplied for the next round, or None;
        :class:`CorruptRecordError` naming the key for a table or facts that do not parse, or facts whose text
        :meth:`supply_placement` refuses (a control character: the round could never be requested with it)."""
        key = self._keys.supplied_placement
        raw = {_s(k): v for k, v in _hgetall(self._client, key).items()}
        if not raw:
            return None
        arr = self._array(key, "phy2log", raw)
        try:
            facts = json.loads(_s(raw.get("facts", b"{}")))
        except ValueError:
            facts = None
        if arr is None or not isinstance(facts, dict):
            raise CorruptRecordError(f"{key}: not a supplied placement (phy2log and facts)", key=key)
        try:  # the writer's rule (:meth:`supply_placement`): the round's request could never hold such a text
            _check_facts_text(facts)
        except InputError as err:
            raise CorruptRecordError(f"{key}: {err}", key=key) from None
        return self._table(key, arr, "phy2log"), facts

    def drop_supplied_placement(self) -> None:
        """Delete the supplied placement (its round committed it); nothing when there is none."""
        self._client.delete(self._keys.supplied_placement)

    def _table(self, key: str, arr: np.ndarray, name: str) -> np.ndarray:
        """A stored placement table checked against the configuration: int64 [L, P], ids in [0, E)."""
        cfg = self.read_config()
        shape = (cfg.num_layers, cfg.num_physical_experts)
        if arr.dtype != np.int64 or arr.shape != shape:
            raise CorruptRecordError(f"{key}: {name} is {arr.dtype} {arr.shape}, expected int64 {shape}", key=key)
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.num_logical_experts):
            raise CorruptRecordError(f"{key}: {name} holds expert ids outside [0, {cfg.num_logical_experts})", key=key)
        return arr

    def drop_plan(self, plan_id: str) -> bool:
        """Delete stored plan ``plan_id`` (a corrupt one: the next round computes it again) unless the current
        placement refers to it; returns whether it deleted."""
        key = self._keys.plan(plan_id)
        if _s(self._client.hget(self._keys.placement, "plan_id")) == plan_id:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.zrem(self._keys.retained, key)
        pipe.execute()
        return True

    def routing_mismatches(self) -> list[tuple[int, str, str]]:
        """Ranks whose reported routing-table digest (:attr:`RankRecord.routing_digest`) differs from the current
        placement's (:func:`fdeplb.placement.routing_digest`): a list of (ep_rank, reported, expected); ranks that
        have not reported one yet are listed with "" as reported."""
        expected = routing_digest(self.current_placement().phy2log)
        return [(r, x.routing_digest, expected) for r, x in enumerate(self.read_all(RANK))
                if x.routing_digest != expected]


def _check_facts_text(facts: dict[str, Any]) -> None:
    """:class:`InputError` naming the field when a text of a supplied placement's ``facts`` holds a control
    character (see :meth:`Placements.supply_placement`)."""
    for name, value in facts.items():
        if isinstance(value, str) and has_control_character(value):
            raise InputError(f"supplied placement: {name} {value[:80]!r} holds a control character (a round's "
                             f"request reason is made of it)")
