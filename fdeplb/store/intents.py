"""What operators and the API ask of a cluster, written into the cluster record (or beside it) for the coordinator
and the rank agents to act on: a round, a commit of a cordoned cluster's staged plan, a weight clear or update, a
``clear_stat``, an operator-supplied load. Each request is checked and written in one optimistic transaction
(:func:`fdeplb.store.txn.transaction`: WATCH, check, MULTI/EXEC, again if a watched key changed, a bounded number
of times), so concurrent callers coalesce or are refused, never both accepted; a request is only a wish, the
transitions stay guarded and audited.

A weight request nobody can switch is withdrawn by :meth:`Intents.cancel_weights` (``lua/weights_cancel.lua``: the
withdrawal, its checks and its audit record in one atomic step). A pending round request is withdrawn by
:meth:`Intents.withdraw_request` (an operator's cancel, or its expiry past ``deadlines.request_ttl_ms``), and the
settings that may change on a running cluster change through :meth:`Intents.change_config`: the transaction of
each queues one ``lua/audit.lua`` call that appends its audit note and writes the change in one atomic step.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``cluster``, ``_strict``, ``_record``,
``ep_size``, ``read_config``, ``_parse_config``, ``read_cluster``, ``now_ms``, ``_weights_cancel`` and ``_append``
(the registered scripts); from :mod:`fdeplb.store.streams`: ``emit_event``, ``_signal``,
:func:`~fdeplb.store.streams.note_fields`.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from fdeplb.errors import FenceError, InputError, NotFoundError, StateError
from fdeplb.machines.tables import CLUSTER, WEIGHTS, ClusterState, WeightState
from fdeplb.store import arrays
from fdeplb.store.connection import as_str as _s, as_text as _text, hgetall as _hgetall
from fdeplb.store.records import ClusterRecord, check_request_reason, parse_record
from fdeplb.store.scripts import audit_call, weights_cancel_call
from fdeplb.store.streams import detail_field, note_fields
from fdeplb.store.txn import transaction


class Intents:
    """Operator requests (see the module doc)."""

    def request_round(self, reason: str = "operator") -> int:
        """Ask the coordinator for a round; returns the number of the round that will serve the request.

        Requests coalesce (one WATCHed transaction on the cluster record): while a round is in flight the request
        is served by it; while the cluster is FREE with a round already pending, by the pending one; otherwise
        it asks for round ``round + 1`` (``requested``). Any number of requests therefore yield exactly one round.
        The start itself stays a guarded, audited transition; a request is only a wish.

        ``reason`` (kept as ``requested_reason`` and in the ``round_requested`` event): at most
        :data:`MAX_REQUEST_REASON` characters, none of them a control character; :class:`InputError` otherwise
        (nothing is written)."""
        check_request_reason(reason)
        key = self._keys.rearrange
        now = self.now_ms()

        def txn(pipe: Any) -> tuple[int, bool]:
            rec = parse_record(ClusterRecord, key, _text(_hgetall(pipe, key)))
            if rec.state is not ClusterState.FREE:
                serving, write = rec.round, False
            elif rec.requested > rec.round:
                serving, write = rec.round + 1, False
            else:
                serving, write = rec.round + 1, True
            pipe.multi()  # EXEC even when nothing is written: the record read is the one a retry would see
            if write:
                pipe.hset(key, mapping={"requested": str(serving), "requested_reason": reason,
                                        "requested_ms": str(now)})
            return serving, write

        serving, write = transaction(self._client, txn, key, value_from_callable=True)
        self.emit_event("round_requested", reason=reason, requested=serving, new=int(write))
        return serving

    def request_round_if_free(self, reason: str = "api") -> tuple[bool, ClusterRecord]:
        """Ask for one round only if the cluster is FREE with no round pending (``requested <= round``) and every
        rank's weights are NORMAL with no clear pending, checked and written in one WATCHed transaction: of many
        concurrent callers, exactly one is accepted, and a clear requested meanwhile
        (:meth:`request_weights`) refuses the start instead of leaving the round waiting for an update.

        Returns (accepted, the cluster record as read); :class:`StateError` when the weights refuse it,
        :class:`CorruptRecordError` for a weight-status record that does not parse (:class:`NotFoundError` for a
        missing one). Nothing is written when
        refused. ``reason`` as for :meth:`request_round`."""
        check_request_reason(reason)
        key = self._keys.rearrange
        wkeys = [self._keys.weights(r) for r in range(self.ep_size())]
        now = self.now_ms()

        def txn(pipe: Any) -> tuple[bool, ClusterRecord]:
            raw = _hgetall(pipe, key)
            if not raw:
                raise NotFoundError(f"no cluster record at {key}")  # leaving the pipeline UNWATCHes
            rec = parse_record(ClusterRecord, key, _text(raw))
            if rec.state is not ClusterState.FREE or rec.requested > rec.round:
                pipe.unwatch()  # nothing queued: EXEC is not sent
                return False, rec
            # read in one round trip (another connection): WATCH, issued before, still sees any change
            weights = self._strict([(WEIGHTS, r) for r in range(len(wkeys))])
            unloaded = [r for r, w in enumerate(weights) if w.state is not WeightState.NORMAL]
            clearing = [r for r, w in enumerate(weights) if rec.weights_action == "clear"
                        and w.request < rec.weights_request and rec.weights_cancelled != rec.weights_request]
            if unloaded or clearing:
                raise StateError(
                    f"weights of ranks {unloaded} are not NORMAL ({weights[unloaded[0]].state})" if unloaded
                    else f"weight clear {rec.weights_request} is pending on ranks {clearing}")
            pipe.multi()
            pipe.hincrby(key, "requested", 1)
            pipe.hset(key, mapping={"requested_reason": reason, "requested_ms": str(now)})
            return True, rec

        accepted, rec = transaction(self._client, txn, key, *wkeys, value_from_callable=True)
        if accepted:
            self.emit_event("round_requested", reason=reason, requested=rec.round + 1)
        return accepted, rec

    def withdraw_request(self, round_: int | None, *, trigger: str, actor: str, reason: str, fence: str = "",
                         detail: dict[str, Any] | None = None,
                         drop_supplied: str = "") -> tuple[int, str, dict[str, Any] | None]:
        """Withdraw the pending round request (``requested`` back to ``round``: the round never starts) together
        with its audit note ``trigger`` (``request_cancelled`` by an operator, ``request_expired`` by the
        coordinator past ``deadlines.request_ttl_ms``) with ``reason`` and ``detail`` plus the withdrawn round and
        its ``requested_reason``; with ``fence``, both are refused (:class:`FenceError`, nothing written) unless
        that lease is held.

        ``round_``: withdraw only if round ``round_`` is the pending one (the coordinator's expiry); None: whichever
        is pending (an operator's cancel). The check is one WATCHed transaction whose MULTI / EXEC queues one
        ``lua/audit.lua`` call that appends the note and then writes the withdrawal (never one without the other):
        a start that committed meanwhile wins and nothing is withdrawn. ``drop_supplied``: a kind of supplied
        placement (``operator``) that the same step deletes when the waiting one is of that kind, so that FREE's
        entry work does not request its round again; the note's detail then names it (``dropped_supplied``: its
        facts).

        Returns (the withdrawn round, the note's audit id, the facts of the supplied placement dropped or None).
        :class:`StateError` (nothing written) when no request is pending: the cluster is FREE with none, or its
        round has started (before the commit point, ``fdeplb round abort`` ends it);
        :class:`~fdeplb.errors.ContentionError` (nothing written) when the cluster record or the supplied placement
        changed under every attempt."""
        key, supplied_key = self._keys.rearrange, self._keys.supplied_placement
        self._client.script_load(self._append.script)  # EVALSHA inside the MULTI below

        def txn(pipe: Any) -> None:
            done.clear()
            rec = parse_record(ClusterRecord, key, _text(_hgetall(pipe, key)))
            pending = rec.state is ClusterState.FREE and rec.requested > rec.round
            if not pending or (round_ is not None and rec.requested != round_):
                raise StateError(
                    f"no round request is pending: cluster {self.cluster!r} is {rec.state}, round {rec.round}" +
                    (" in flight (fdeplb round abort ends it before the commit point)"
                     if rec.state is not ClusterState.FREE else ""))
            dropped = _supplied_facts(pipe.hget(supplied_key, "facts")) if drop_supplied else None
            if not (isinstance(dropped, dict) and dropped.get("kind") == drop_supplied):
                dropped = None
            facts = {**(detail or {}), "round": rec.requested, "requested_reason": rec.requested_reason,
                     **({"dropped_supplied": dropped} if dropped is not None else {})}
            call = audit_call(self._keys, fence=fence, delete=[supplied_key] if dropped is not None else [],
                              hset={key: {"requested": str(rec.round), "requested_ms": "0"}},
                              audit=note_fields(CLUSTER, None, state=rec.state.value, version=rec.version,
                                                trigger=trigger, actor=actor, round_=rec.round,
                                                plan_id=rec.plan_id, reason=reason, detail=facts))
            pipe.multi()
            pipe.execute_command("EVALSHA", self._append.sha, len(call.keys), *call.keys, *call.args)
            done.append((rec.requested, dropped))

        done: list[tuple[int, Any]] = []
        (reply,) = transaction(self._client, txn, key, supplied_key)
        withdrawn, dropped = done[0]
        if _s(reply[0]) != "OK":
            raise FenceError(f"{trigger} on {CLUSTER.name}: {_s(reply[1])}")
        self.emit_event(trigger, round=withdrawn, reason=reason[:500])
        return withdrawn, _s(reply[1]), dropped

    def change_config(self, changes: dict[str, Any], *, actor: str, reason: str = "",
                      check: Callable[[Any], None] | None = None) -> tuple[Any, Any, str]:
        """Change settings of the cluster's configuration (``fdeplb config set``): ``changes`` maps names of
        :data:`~fdeplb.store.cluster_config.SETTABLE` to new values (``deadlines`` a partial dict of ms). The new
        configuration (``version`` + 1) is checked in one WATCHed transaction and written together with its
        ``config_changed`` audit note by one ``lua/audit.lua`` call queued in that transaction's MULTI/EXEC (the
        configuration never changes without its audit record). The note names who (``actor``), why (``reason``)
        and each change (``detail``: ``{"changes": {"min_gain": [0.0, 0.05], "deadlines.commit_ms": [...]},
        "version": n}``), on the cluster record as read in the same transaction. The coordinator reads the
        configuration again between rounds: a round in flight keeps the settings it started with.

        ``check``: called with the new configuration inside the transaction, before anything is written (what it
        raises is raised, nothing written): a rule on the configuration as it will be stored.

        Returns (old config, new config, audit id; "" and the config unchanged when nothing differs).
        :class:`InputError` for a setting that may not change or an invalid value (nothing written);
        :class:`~fdeplb.errors.ContentionError` when the configuration or the cluster record changed under every
        attempt (:func:`~fdeplb.store.txn.transaction`; nothing written)."""
        from fdeplb.store.cluster_config import ClusterConfig

        key, cluster = self._keys.config, self._keys.rearrange
        self._client.script_load(self._append.script)  # EVALSHA inside the MULTI below

        def txn(pipe: Any) -> None:
            done.clear()
            old = self._parse_config(_hgetall(pipe, key))
            new = old.with_settings(changes)
            if check is not None:
                check(new)  # raising: the pipeline is reset, nothing was queued
            before, after = old.flat_settings(), new.flat_settings()
            diff = {name: [before[name], after[name]] for name in before if before[name] != after[name]}
            if not diff:
                pipe.unwatch()  # nothing queued: EXEC is not sent
                done.append((old, old, diff))
                return
            rec = self._record(CLUSTER, cluster, _hgetall(pipe, cluster))
            text = "config changed: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()) + \
                (f" ({reason})" if reason else "")
            call = audit_call(self._keys, fence="", hset={key: {k: json.dumps(v) for k, v in new.to_json().items()}},
                              audit=note_fields(CLUSTER, None, state=rec.state.value, version=rec.version,
                                                trigger="config_changed", actor=actor, round_=rec.round,
                                                plan_id=rec.plan_id, reason=text[:2000],
                                                detail={"changes": diff, "version": new.version, "by": actor}))
            pipe.multi()
            pipe.execute_command("EVALSHA", self._append.sha, len(call.keys), *call.keys, *call.args)
            done.append((old, new, diff))

        done: list[tuple[ClusterConfig, ClusterConfig, dict[str, list]]] = []
        replies = transaction(self._client, txn, key, cluster)
        old, new, diff = done[0]
        self._config = new
        if not diff:
            return old, new, ""
        audit_id = _s(replies[0][1])  # unfenced: audit.lua's reply is {"OK", id, ts_ms}
        self.emit_event("config_changed", version=new.version, by=actor)
        return old, new, audit_id

    def request_commit(self, plan_id: str, by: str = "operator") -> None:
        """Allow a cordoned cluster's LOAD_SUCC round with ``plan_id`` to commit (FastDeploy's
        ``update_weight_from_tensor`` step). Checked and written in one WATCHed transaction. ``by`` (who asked:
        ``http``, ``cli``, ...) is kept in ``commit_requested_by`` and named in the commit's audit record.

        Raises :class:`StateError` unless the cluster is cordoned and in LOAD_SUCC with exactly this plan (nothing
        is written then); its message says so when that plan is committed already (another commit won). The
        coordinator still commits only a LOAD_SUCC round whose plan_id matches."""
        if not self.read_config(fresh=True).cordoned:
            raise StateError(f"cluster {self.cluster!r} is not cordoned: its rounds commit on their own")
        key = self._keys.rearrange

        def txn(pipe: Any) -> None:
            rec = parse_record(ClusterRecord, key, _text(_hgetall(pipe, key)))
            if rec.state is not ClusterState.LOAD_SUCC and _s(pipe.hget(self._keys.placement, "plan_id")) == plan_id:
                raise StateError(f"plan {plan_id} is committed already: it is cluster {self.cluster!r}'s current "
                                 f"placement (round {rec.round}, {rec.state}); nothing to commit")
            if rec.state is not ClusterState.LOAD_SUCC or rec.plan_id != plan_id:
                raise StateError(
                    f"cluster {self.cluster!r} is {rec.state} with plan {rec.plan_id or '-'}; a commit is "
                    f"only accepted in LOAD_SUCC for the staged plan (asked: {plan_id!r})")
            pipe.multi()
            pipe.hset(key, mapping={"commit_requested": plan_id, "commit_requested_by": by})

        transaction(self._client, txn, key, value_from_callable=True)
        self.emit_event("commit_requested", plan_id=plan_id, by=by)

    def request_weights(self, action: str, reason: str = "operator", *, when_idle: bool = False) -> int:
        """Ask every rank to ``"clear"`` or ``"update"`` its expert weights (FastDeploy's ``clear_load_weight`` /
        ``update_model_weight``); returns the request number. Each rank agent carries out request n once, at a
        safe point, through its weight-status machine; embedded agents all at the same step, fixed once every rank
        is armed for the request (``weights_switch_step``, reset to 0 = not fixed here; :meth:`arm_switch`).

        Raises :class:`InputError` for another action, :class:`StateError` while a rank is still CLEARING or
        UPDATING for an earlier request, and with ``when_idle`` also while the cluster is not FREE or has a round
        pending (the API's clear: a round accepted meanwhile would wait for the weights to be loaded again). Checked
        and written in one WATCHed transaction; nothing is written when refused."""
        if action not in ("clear", "update"):
            raise InputError(f"weight request must be 'clear' or 'update', got {action!r}")
        busy_states = {WeightState.CLEARING.value.encode(), WeightState.UPDATING.value.encode()}
        wkeys = [self._keys.weights(r) for r in range(self.ep_size())]
        cluster = self._keys.rearrange

        def txn(pipe: Any) -> None:
            busy = [r for r, key in enumerate(wkeys) if pipe.hget(key, "state") in busy_states]
            if when_idle and not busy:
                rec = parse_record(ClusterRecord, cluster, _text(_hgetall(pipe, cluster)))
                if rec.state is not ClusterState.FREE or rec.requested > rec.round:
                    raise StateError(f"cannot {action} weights while rearrangement round "
                                     f"{max(rec.round, rec.requested)} is "
                                     f"{'pending' if rec.state is ClusterState.FREE else rec.state}")
            if busy:
                raise StateError(f"ranks {busy} are still carrying out the previous weight request "
                                 f"(CLEARING or UPDATING); ask again when they finish")
            pipe.multi()
            pipe.hincrby(cluster, "weights_request", 1)
            pipe.hset(cluster, mapping={"weights_action": action, "weights_reason": reason,
                                        "weights_switch_step": "0"})
            self._signal(pipe, "weights")

        # the request number is HINCRBY's reply, so the transaction's value is EXEC's (not the callable's)
        n, _, _ = transaction(self._client, txn, cluster, *wkeys)
        self.emit_event("weights_requested", action=action, request=n, reason=reason)
        return int(n)

    def cancel_weights(self, request: int, *, held_by: list[int], reason: str, actor: str, fence: str = "",
                       detail: dict[str, Any] | None = None) -> tuple[str, str]:
        """Withdraw weight request ``request`` (``lua/weights_cancel.lua``, one atomic step): set the cluster
        record's ``weights_cancelled`` (with ``weights_held_by`` = ``held_by`` and ``weights_cancel_reason`` =
        ``reason``), append the audit note (trigger ``weights_cancelled``, ``reason`` and ``detail``, fenced with
        ``fence``) and wake the rank agents, who then fire their ``cancel`` transitions. From then on
        :meth:`arm_switch` refuses an arm for it (``cancelled``), so its switch step is never fixed.

        Refused with nothing written while the request may have been applied by some rank. Returns (outcome,
        info): ``("cancelled", audit id)``; ``("already", "")`` (withdrawn before); ``("switched", why)`` (its
        switch step is fixed: every rank switches at it); ``("applied", why)`` (a rank carried it out, or carries it
        out without a switch step: a threaded agent); ``("gone", why)`` (not the cluster's latest request).
        :class:`FenceError` when ``fence`` is not the lease holder."""
        rec = self.read_cluster()
        audit = {"machine": CLUSTER.name, "key": CLUSTER.name, "trigger": "weights_cancelled", "actor": actor,
                 "round": str(rec.round), "plan_id": rec.plan_id, "reason": reason, **detail_field(detail)}
        call = weights_cancel_call(self._keys, ep_size=self.ep_size(), request=request, fence=fence,
                                   busy=(WeightState.CLEARING, WeightState.UPDATING), held_by=held_by,
                                   reason=reason, audit=audit)
        code, info = (_s(x) for x in self._weights_cancel(keys=call.keys, args=call.args))
        if code == "ERR_FENCE":
            raise FenceError(f"weights_cancelled on {CLUSTER.name}: {info}")
        outcome = {"OK": "cancelled", "ALREADY": "already"}.get(code) or code.removeprefix("ERR_").lower()
        if outcome == "cancelled":
            self.emit_event("weights_cancelled", request=request, ranks=",".join(map(str, held_by)), reason=reason)
        return outcome, info

    def request_clear_stat(self, reason: str = "operator") -> int:
        """Ask every rank agent to empty its expert_load window (FastDeploy's ``clear_stat`` of
        ``get_per_expert_tokens_stats``); returns the request number (``clear_stat_request``)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hincrby(self._keys.rearrange, "clear_stat_request", 1)
        self._signal(pipe, "clear_stat")
        n = pipe.execute()[0]
        self.emit_event("clear_stat_requested", request=n, reason=reason)
        return int(n)

    def supply_load(self, round_: int, expert_load: np.ndarray) -> None:
        """Store an operator-supplied expert_load (int64 [L, E]) to be round ``round_``'s snapshot instead of the
        ranks' windows (FastDeploy's ``recv_expert_weight``); replaces an earlier one. The caller checks the shape.

        Raises :class:`StateError` when round ``round_``'s snapshot is frozen already (the load could no longer be
        used; nothing is written): checked and written in one WATCHed transaction against
        :meth:`freeze_windows`."""
        mapping = {**arrays.encode("expert_load", np.asarray(expert_load, dtype=np.int64)),
                   "round": str(int(round_)), "supplied_ms": str(self.now_ms())}
        snapshot, key = self._keys.snapshot(round_), self._keys.supplied_load

        def txn(pipe: Any) -> None:
            if pipe.exists(snapshot):
                raise StateError(f"round {round_}'s load snapshot is frozen already: a load supplied now "
                                 "would not be used")
            pipe.multi()
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)

        transaction(self._client, txn, snapshot, key, value_from_callable=True)
        self.emit_event("load_supplied", round=round_)


def _supplied_facts(raw: Any) -> Any:
    """The stored facts of a supplied placement (its ``facts`` field), or None when absent or not JSON."""
    try:
        return json.loads(_s(raw)) if raw else None
    except ValueError:
        return None
