"""Writes that cover a whole cluster: creating one (configuration, initial placement and every machine record, in
one transaction; every rank a member, ACTIVE), rebuilding one from a recording (``fdeplb replay --into``), deleting one.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``url``, ``cluster``, ``_config``; from
the other parts: ``save_snapshot`` (:mod:`fdeplb.store.windows`), ``save_plan`` (:mod:`fdeplb.store.placements`).
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
from fdeplb.store.records import PlanEntry


class Bootstrap:
    """Creating, rebuilding and deleting a cluster (see the module doc)."""

    def create_cluster(self, config: ClusterConfig, phy2log: np.ndarray, plan_id: str = "") -> bool:
        """Write a new cluster in one MULTI/EXEC: its configuration (with a fresh ``incarnation`` unless it names
        one), the initial placement (``plan_id``: "" for an initial placement, or the plan live ranks reported
        holding, see :func:`fdeplb.orchestration.operations.init_cluster`) and one record per machine at version 0
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
                        *(self._keys.live(r) for r in range(config.ep_size)))
            pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)),
                                                     "plan_id": str(plan_id), "version": "0"})
            for key, initial in records:
                pipe.hset(key, mapping={"state": initial.value, "version": "0"})
            pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})
            return True

        created = self._client.transaction(txn, self._keys.config, value_from_callable=True)
        if created:
            self._config = config
        return created

    def import_recording(self, config: ClusterConfig, *, plan_id: str, phy2log: np.ndarray, placement_version: int,
                         records: dict[str, dict[str, str]], audit: list[tuple[str, dict[str, str]]],
                         audit_head: str, snapshots: dict[int, np.ndarray], plans: list[PlanEntry]) -> None:
        """Rebuild a replayed cluster (``fdeplb replay --into``): ``records`` maps ``cluster`` / ``rank:<r>`` /
        ``weights:<r>`` to the record fields to write; ``audit`` holds (stream id, fields) in order, written with
        their ids; ``audit_head`` is the last chain. Snapshots and plans are written once each, then the rest in one
        WATCHed MULTI/EXEC. Raises :class:`StateError` if the cluster exists (nothing written), :class:`InputError`
        for a record label that is not one of the cluster's."""
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
        refusal = StateError(f"cluster {self.cluster!r} exists at {self.url}; replay --into rebuilds only into a "
                             f"cluster id that is not in use")
        if self._client.exists(self._keys.config, self._keys.audit, self._keys.rearrange):
            raise refusal
        for round_, load in snapshots.items():
            self.save_snapshot(round_, load)
        for plan in plans:
            self.save_plan(plan)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(self._keys.config, self._keys.audit)
            if pipe.exists(self._keys.config, self._keys.audit):
                pipe.unwatch()
                raise refusal
            pipe.multi()
            pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)),
                                                     "plan_id": plan_id, "version": str(int(placement_version))})
            for key, fields in keyed.items():
                pipe.hset(key, mapping=fields)
            for entry_id, fields in audit:
                pipe.xadd(self._keys.audit, fields, id=entry_id)
            pipe.set(self._keys.audit_head, audit_head)
            pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})
            try:
                pipe.execute()
            except redis.WatchError:
                raise refusal from None
        self._config = config

    def delete_cluster(self) -> int:
        """Delete every key of this cluster (tests and demo clean-up); returns how many."""
        pattern = f"{self._keys.prefix.replace('{', '[{]').replace('}', '[}]')}:*"
        keys = list(self._client.scan_iter(match=pattern))
        self._config = None
        return int(self._client.delete(*keys)) if keys else 0
