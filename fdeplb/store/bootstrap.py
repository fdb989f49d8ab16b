"""Writes that cover a whole cluster: creating one (configuration, initial placement and every machine record, in
one transaction; every rank a member, ACTIVE), rebuilding one from a recording (``fdeplb replay --into``), deleting one.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``url``, ``cluster``, ``_config``; from
the other parts: ``snapshot_fields`` (:mod:`fdeplb.store.windows`), ``PlanEntry.to_fields``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import numpy as np
import redis

from fdeplb.errors import InputError, StateError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, WEIGHTS
from fdeplb.store import arrays
from fdeplb.store.cluster_config import ClusterConfig
from fdeplb.store.connection import as_str as _s
from fdeplb.store.plan_entry import PlanEntry
from fdeplb.store.streams import parse_stream_id
from fdeplb.store.txn import transaction
from fdeplb.store.windows import snapshot_fields


#: how long an operator's ``cluster delete`` leaves its tombstone (ms): processes still running then stop when they
#: next look (a worker stopped longer than this finds no cluster, and no tombstone, when it continues)
TOMBSTONE_TTL_MS = 3_600_000


class Bootstrap:
    """Creating, rebuilding and deleting a cluster (see the module doc)."""

    def create_cluster(self, config: ClusterConfig, phy2log: np.ndarray, plan_id: str = "") -> bool:
        """Write a new cluster in one MULTI/EXEC: its configuration (with a fresh ``incarnation`` unless it names
        one), the initial placement (``plan_id``: "" for an initial placement, or the plan live ranks reported
        holding, see :func:`fdeplb.orchestration.cluster_setup.init_cluster`) and one record per machine at version 0
        in its initial state; the ranks' live reports (:meth:`Store.live_reports`) are deleted with it. Returns
        False, writing nothing, if the cluster's configuration exists already (WATCHed, so two creators cannot
        both win)."""
        if not config.incarnation:
            config = dataclasses.replace(config, incarnation=uuid.uuid4().hex)
        records = [(self._keys.rearrange, CLUSTER.initial)]
        for r in range(config.ep_size):
            records += [(self._keys.rank(r), RANK.initial), (self._keys.weights(r), WEIGHTS.initial),
                        (self._keys.member(r), MEMBERSHIP.initial)]

        def txn(pipe: Any) -> bool:
            if pipe.exists(self._keys.config):
                pipe.unwatch()  # nothing queued: EXEC is not sent
                return False
            pipe.multi()
            pipe.delete(self._keys.placement, *(key for key, _ in records),  # leftovers of a stray write
                        self._keys.deleted,  # a tombstone of the cluster deleted before: it exists again
                        *(self._keys.live(r) for r in range(config.ep_size)))
            pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)),
                                                     "plan_id": str(plan_id), "version": "0"})
            for key, initial in records:
                pipe.hset(key, mapping={"state": initial.value, "version": "0"})
            pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})
            return True

        created = transaction(self._client, txn, self._keys.config, value_from_callable=True)
        if created:
            self._config = config
        return created

    def import_recording(self, config: ClusterConfig, *, plan_id: str, phy2log: np.ndarray, placement_version: int,
                         records: dict[str, dict[str, str]], audit: list[tuple[str, dict[str, str]]],
                         audit_head: str, snapshots: dict[int, np.ndarray], plans: list[PlanEntry],
                         source_loads: dict[int, np.ndarray] | None = None) -> None:
        """Rebuild a replayed cluster (``fdeplb replay --into``): ``records`` maps ``cluster`` / ``rank:<r>`` /
        ``weights:<r>`` / ``member:<r>`` to the record fields to write; ``audit`` holds (stream id, fields) in
        order, written with their ids; ``audit_head`` is the last chain; ``source_loads``: the snapshots kept per
        source rank (round -> int64 [L, ep_size, E]).

        All or nothing: every input is checked first (record labels; audit ids are stream ids, after ``0-0`` and
        increasing, as ``XADD`` takes them), then everything (snapshots, plans and their retention index included) is
        written in one WATCHed MULTI/EXEC; should Redis still refuse a command inside it, every key it wrote is
        deleted again. Raises :class:`StateError` if the cluster exists, :class:`InputError` for a bad label or
        audit id; nothing is left written then."""
        def key_of(label: str) -> str:
            name, _, idx = label.partition(":")
            if label == CLUSTER.name:
                return self._keys.rearrange
            if name in (RANK.name, WEIGHTS.name, MEMBERSHIP.key_label) and idx.isdigit() and int(idx) < config.ep_size:
                if name == MEMBERSHIP.key_label:
                    return self._keys.member(int(idx))
                return self._keys.rank(int(idx)) if name == RANK.name else self._keys.weights(int(idx))
            raise InputError(f"not a record of the cluster: {label!r}")

        keyed = {key_of(label): fields for label, fields in records.items()}
        _check_audit_ids([entry_id for entry_id, _ in audit])
        split = source_loads or {}
        once = [(self._keys.snapshot(r), snapshot_fields(r, load, split.get(r)), r) for r, load in snapshots.items()]
        once += [(self._keys.plan(plan.plan_id), plan.to_fields(), plan.round) for plan in plans]
        written = [self._keys.placement, *keyed, self._keys.audit, self._keys.audit_head, self._keys.config,
                   self._keys.retained, *(key for key, _, _ in once)]
        refusal = StateError(f"cluster {self.cluster!r} exists at {self.url}; replay --into rebuilds only into a "
                             f"cluster id that is not in use")

        def txn(pipe: Any) -> None:
            if pipe.exists(self._keys.config, self._keys.audit, self._keys.rearrange):
                pipe.unwatch()
                raise refusal
            pipe.multi()
            pipe.delete(self._keys.deleted)  # the tombstone of the cluster deleted before
            for key, fields, round_ in once:
                pipe.hset(key, mapping=fields)
                pipe.zadd(self._keys.retained, {key: int(round_)})
            pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)),
                                                     "plan_id": plan_id, "version": str(int(placement_version))})
            for key, fields in keyed.items():
                pipe.hset(key, mapping=fields)
            for entry_id, fields in audit:
                pipe.xadd(self._keys.audit, fields, id=entry_id)
            pipe.set(self._keys.audit_head, audit_head)
            pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})

        try:
            transaction(self._client, txn, self._keys.config, self._keys.audit, self._keys.rearrange)
        except redis.ResponseError as exc:  # EXEC ran the other commands: take them back
            self._client.delete(*written)
            raise InputError(f"cannot rebuild cluster {self.cluster!r}: Redis refused a write ({exc}); nothing "
                             f"is left written") from None
        self._config = config

    def delete_cluster(self, *, by: str = "", tombstone_ttl_ms: int = TOMBSTONE_TTL_MS) -> int:
        """Delete every key of this cluster (a SCAN of :attr:`Keys.pattern`, deleted 500 at a time: ``fdeplb
        cluster delete``, the demo's and the tests' clean-up); returns how many. ``by`` (an operator's delete):
        in the same MULTI/EXEC, write the cluster's tombstone (:attr:`Keys.deleted`: who, when, how many keys;
        expires after ``tombstone_ttl_ms``), by which running agents and coordinators learn that the cluster was
        deleted on purpose and stop (:meth:`Liveness.tombstone`)."""
        keys = [k for k in self._client.scan_iter(match=self._keys.pattern, count=1000)
                if _s(k) != self._keys.deleted]
        self._config = None
        if not by:  # a clean-up: plain multi-key DELs (a cluster client's pipeline takes no multi-key DEL)
            return sum(int(self._client.delete(*keys[i:i + 500])) for i in range(0, len(keys), 500))
        pipe = self._client.pipeline(transaction=True)  # the keys and the tombstone share the cluster's hash slot
        for key in keys:
            pipe.delete(key)
        sec, _ = self._client.time()
        pipe.set(self._keys.deleted, json.dumps({"by": by, "at_ms": int(sec) * 1000, "keys": len(keys)}),
                 px=int(tombstone_ttl_ms))
        return sum(int(n) for n in pipe.execute()[:-1])


def _check_audit_ids(ids: list[str]) -> None:
    """Audit ids as ``XADD`` takes them: stream ids (:func:`~fdeplb.store.streams.parse_stream_id`), after ``0-0``,
    increasing. :class:`InputError` naming the first that is not."""
    last = (0, 0)
    for n, entry_id in enumerate(ids, start=1):
        sid = parse_stream_id(entry_id) if isinstance(entry_id, str) else None
        if sid is None or sid <= last:
            after = "0-0" if last == (0, 0) else f"{last[0]}-{last[1]}"
            raise InputError(f"audit record {n}: id {entry_id!r} is not after {after} (ids increase from 0-0 in a "
                             f"stream)")
        last = sid
