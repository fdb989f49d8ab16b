"""Recovery from lost records (Redis restarted without persistence, FLUSHALL, failover to an empty replica).

Rank agent side (:class:`Recovery`, held by :class:`~fdeplb.orchestration.agent.RankAgent`, which asks it
:meth:`Recovery.rejoin` when its records are gone or its registry entry is): while the cluster has no
configuration, the agent reports the placement it holds live (:meth:`fdeplb.store.Store.report_live`: phy2log,
plan_id, agent id) at most every quarter TTL; once
``init-cluster`` created the cluster again (a configuration of another ``incarnation``), the agent checks that the
new cluster has its topology and the placement it holds live, then re-registers (API address, agent id), creates
its records and heartbeats again; otherwise it refuses, saying why, and stays unregistered (no round starts and
``/health`` is 503 until the worker is restarted).

Operator side (:func:`adopted_placement`, used by :func:`fdeplb.orchestration.cluster_setup.init_cluster`): the
placement the live ranks report, when they agree; :class:`~fdeplb.errors.StateError` naming the disagreement when
they do not. Staleness is the store's one rule (:func:`fdeplb.store.liveness.stale_of`).
"""

from __future__ import annotations

import time

import numpy as np

from fdeplb.errors import NotFoundError, StateError, TopologyError
from fdeplb.placement import routing_digest
from fdeplb.store import ClusterConfig, Store
from fdeplb.store.liveness import LiveReport, stale_of
from fdeplb.weights.backend import WeightBackend

__all__ = ["RecordsLostError", "Recovery", "adopted_placement"]


class RecordsLostError(NotFoundError):
    """The cluster's records are gone and it has not been created again yet (the agent reported its live
    placement and waits for ``init-cluster``)."""


class Recovery:
    """The rank side of recovery, held by one rank agent: given the store, the rank's ``ep_rank``, its live
    ``backend`` (whose ``phy2log`` is the placement it serves), its ``agent_id`` and ``heartbeat_ttl_ms`` (the live
    report expires after 3 TTLs and is sent at most every quarter TTL)."""

    def __init__(self, store: Store, ep_rank: int, backend: WeightBackend, *, agent_id: str,
                 heartbeat_ttl_ms: int) -> None:
        self.store, self.ep_rank, self.backend = store, int(ep_rank), backend
        self.agent_id, self.heartbeat_ttl_ms = agent_id, int(heartbeat_ttl_ms)
        self._reported_at = 0.0  # monotonic time of the last live report while the records are gone

    def rejoin(self, err: Exception | None, old: ClusterConfig | None, live_plan_id: str | None
               ) -> tuple[ClusterConfig, str]:
        """The rank's records or registry entry are gone (``err``: the :class:`NotFoundError` a step raised, None
        when the heartbeat found the registry without the agent; ``old``: the configuration the agent runs with;
        ``live_plan_id``: the plan it holds live). Returns (the configuration, the placement's plan_id) the agent
        registers again under. Raises :class:`RecordsLostError` while there is no cluster (after reporting the live
        placement), :class:`TopologyError` / :class:`StateError` when the cluster created again does not match
        what the rank serves (it then stays unregistered), ``err`` itself when the cluster is the same
        incarnation (some other record is missing)."""
        try:
            config = self.store.read_config(fresh=True)
        except NotFoundError:
            self._report(live_plan_id)
            raise RecordsLostError(
                f"rank {self.ep_rank}: the cluster's records are gone (did Redis lose its data?); reported the "
                f"placement held live (plan {live_plan_id or 'initial'}) for init-cluster to adopt") from None
        if old is not None and config.incarnation == old.incarnation and err is not None:
            raise err  # the same cluster: a record of another kind is missing (its reader says which)
        return config, self._readopt(config, old, live_plan_id)

    def _report(self, live_plan_id: str | None) -> None:
        now = time.monotonic()
        if now - self._reported_at < self.heartbeat_ttl_ms / 4000:
            return
        self.store.report_live(self.ep_rank, self.backend.phy2log, live_plan_id or "", agent_id=self.agent_id,
                               ttl_ms=self.heartbeat_ttl_ms)
        self._reported_at = now

    def _readopt(self, config: ClusterConfig, old: ClusterConfig | None, live_plan_id: str | None) -> str:
        """The plan_id of the cluster as created again when it has the same topology and placement as held live;
        else refuse."""
        store = self.store
        if old is not None and config.topology() != old.topology():
            raise TopologyError(f"rank {self.ep_rank}: cluster {store.cluster!r} was created again with topology "
                                f"{config.topology()}; this worker serves {old.topology()}: restart it")
        placement = store.current_placement()
        live = self.backend.phy2log
        if not np.array_equal(placement.phy2log, live):
            raise StateError(f"rank {self.ep_rank}: cluster {store.cluster!r} was created again with placement "
                             f"{placement.plan_id or 'initial'} ({routing_digest(placement.phy2log)}) but this rank "
                             f"holds plan {live_plan_id or 'initial'} ({routing_digest(live)}) live; not "
                             f"registering: restart this worker to load the cluster's placement")
        return placement.plan_id


def adopted_placement(store: Store, config: ClusterConfig) -> tuple[np.ndarray, str, list[int]] | None:
    """What ``init-cluster`` writes as the placement of a cluster created over live ranks: (phy2log int64 [L, P],
    plan_id, the reporting ranks) when every rank whose live report (:meth:`Store.live_reports`) is fresh reports
    the same phy2log; None when no rank reports. :class:`StateError` naming the groups of ranks and the plan each
    holds when they disagree; :class:`TopologyError` when what they hold is not of ``config``'s shape."""
    beyond = [r for r in store.live_report_ranks() if r >= config.ep_size]
    if beyond:
        raise TopologyError(f"cluster {store.cluster!r}: ranks {beyond} report the placement they hold live, but the "
                            f"configuration has ep_size {config.ep_size}; nothing written (create it with the ranks "
                            f"that serve, or stop those ranks first)")
    reports = store.live_reports(config.ep_size)
    stale = stale_of({r: (rep.age_ms, rep.ttl_ms) for r, rep in reports.items()})
    fresh = [rep for r, rep in sorted(reports.items()) if r not in stale]
    if not fresh:
        return None
    groups: dict[str, list[LiveReport]] = {}
    for rep in fresh:
        groups.setdefault(routing_digest(rep.phy2log), []).append(rep)
    if len(groups) > 1:
        said = "; ".join(f"ranks {[rep.ep_rank for rep in reps]} hold plan {reps[0].plan_id or 'initial'} "
                         f"({digest})" for digest, reps in groups.items())
        raise StateError(f"cluster {store.cluster!r}: the live ranks disagree on the placement they hold ({said}); "
                         f"nothing written: restart the ranks that differ (they load the placement once created)")
    rep = fresh[0]
    shape = (config.num_layers, config.num_physical_experts)
    if rep.phy2log.shape != shape:
        raise TopologyError(f"cluster {store.cluster!r}: the live ranks hold a placement of shape "
                            f"{rep.phy2log.shape}, the configuration says {shape}; nothing written")
    return rep.phy2log, rep.plan_id, [r.ep_rank for r in fresh]


