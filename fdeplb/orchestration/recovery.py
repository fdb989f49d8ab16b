"""Recovery from lost records (Redis restarted without persistence, FLUSHALL, failover to an empty replica).

Rank agent side (:func:`records_lost`, called by :class:`~fdeplb.orchestration.agent.RankAgent` when its records
are gone or its registry entry is): while the cluster has no configuration, the agent reports the placement it
holds live (:meth:`fdeplb.store.Store.report_live`: phy2log, plan_id, agent id) at most every quarter TTL; once
``init-cluster`` created the cluster again (a configuration of another ``incarnation``), the agent checks that the
new cluster has its topology and the placement it holds live, then re-registers (API address, agent id), creates
its records and heartbeats again; otherwise it refuses, saying why, and stays unregistered (no round starts and
``/health`` is 503 until the worker is restarted).

Operator side (:func:`adopted_placement`, used by :func:`fdeplb.orchestration.operations.init_cluster`): the
placement the live ranks report, when they agree; :class:`~fdeplb.errors.StateError` naming the disagreement when
they do not. Staleness is the store's one rule (:func:`fdeplb.store.redis_store.stale_of`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from fdeplb.errors import NotFoundError, StateError, TopologyError
from fdeplb.placement import routing_digest
from fdeplb.store import ClusterConfig, Store
from fdeplb.store.redis_store import LiveReport, stale_of

if TYPE_CHECKING:
    from fdeplb.orchestration.agent import RankAgent

__all__ = ["RecordsLostError", "adopted_placement", "records_lost"]


class RecordsLostError(NotFoundError):
    """The cluster's records are gone and it has not been created again yet (the agent reported its live
    placement and waits for ``init-cluster``)."""


def records_lost(agent: "RankAgent", err: Exception | None) -> None:
    """Handle ``agent``'s records or registry entry being gone (``err``: the :class:`NotFoundError` a step raised,
    None when the heartbeat found the registry without the agent). Returns once the agent re-registered (or there
    was nothing to do); raises :class:`RecordsLostError` while there is no cluster (after reporting the live
    placement), :class:`TopologyError` / :class:`StateError` when the cluster created again does not match what
    the agent serves (it then stays unregistered), ``err`` itself when the cluster is the same incarnation (some
    other record is missing)."""
    store = agent.store
    try:
        config = store.read_config(fresh=True)
    except NotFoundError:
        _report(agent)
        raise RecordsLostError(
            f"rank {agent.ep_rank}: the cluster's records are gone (did Redis lose its data?); reported the "
            f"placement held live (plan {agent.live_plan_id or 'initial'}) for init-cluster to adopt") from None
    old = agent.config
    if old is not None and config.incarnation == old.incarnation and err is not None:
        raise err  # the same cluster: a record of another kind is missing (its reader says which)
    _readopt(agent, config)


def _report(agent: "RankAgent") -> None:
    now = time.monotonic()
    if now - agent._reported_live < agent.heartbeat_ttl_ms / 4000:
        return
    agent.store.report_live(agent.ep_rank, agent.backend.phy2log, agent.live_plan_id or "",
                            agent_id=agent.agent_id, ttl_ms=agent.heartbeat_ttl_ms)
    agent._reported_live = now


def _readopt(agent: "RankAgent", config: ClusterConfig) -> None:
    """Join the cluster as created again: same topology and placement as held live, else refuse."""
    store, old = agent.store, agent.config
    if old is not None and config.topology() != old.topology():
        raise TopologyError(f"rank {agent.ep_rank}: cluster {store.cluster!r} was created again with topology "
                            f"{config.topology()}; this worker serves {old.topology()}: restart it")
    placement = store.current_placement()
    live = agent.backend.phy2log
    if not np.array_equal(placement.phy2log, live):
        raise StateError(f"rank {agent.ep_rank}: cluster {store.cluster!r} was created again with placement "
                         f"{placement.plan_id or 'initial'} ({routing_digest(placement.phy2log)}) but this rank "
                         f"holds plan {agent.live_plan_id or 'initial'} ({routing_digest(live)}) live; not "
                         f"registering: restart this worker to load the cluster's placement")
    agent.config = config
    agent.rejoined_records(placement.plan_id)
    agent.log.warning("registered again", incarnation=config.incarnation, plan_id=placement.plan_id,
                      agent_id=agent.agent_id)
    store.emit_event("rank_registered_again", rank=agent.ep_rank, plan_id=placement.plan_id)


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


