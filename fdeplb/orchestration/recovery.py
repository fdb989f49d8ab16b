"""Recovery from lost records (Redis restarted without persistence, FLUSHALL, failover to an empty replica).

Rank agent side (:class:`Recovery`, held by :class:`~fdeplb.orchestration.agent.RankAgent`, which asks it
:meth:`Recovery.rejoin` when its records are gone or its registry entry is): while the cluster has no
configuration, the agent reports the placement it holds live (:meth:`fdeplb.store.Store.report_live`: phy2log,
plan_id, agent id) as soon as it notices, then every quarter TTL; once ``init-cluster`` created the cluster again
(a configuration of another ``incarnation``) with the agent's topology, the agent registers again, after loading
the cluster's placement from the checkpoint when it holds another one (verified, audited ``placement_loaded``:
:meth:`Recovery.loaded`). A cluster created again with another topology is refused: the agent stays unregistered
and says why in its live report, which ``/health`` names (:func:`fdeplb.status.unhealthy_ranks`).

Operator side (used by :func:`fdeplb.orchestration.cluster_setup.init_cluster`): :func:`await_live_reports` waits
for the live ranks' reports, :func:`adopted_placement` is the placement they report when they agree
(:class:`~fdeplb.errors.StateError` naming the disagreement when they do not). Staleness is the store's one rule
(:func:`fdeplb.store.liveness.stale_of`).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from fdeplb.errors import NotFoundError, StateError, TopologyError, VerificationError
from fdeplb.machines.tables import RANK
from fdeplb.placement import routing_digest
from fdeplb.store import ClusterConfig, PlacementEntry, Store
from fdeplb.store.liveness import LiveReport, stale_of
from fdeplb.weights.backend import WeightBackend

__all__ = ["PLACEMENT_LOADED", "RecordsLostError", "Recovery", "Rejoining", "adopted_placement", "await_live_reports"]

#: the audit trigger of a rank that loaded the placement of the cluster created again over it (a note on its record)
PLACEMENT_LOADED = "placement_loaded"


_pause = threading.Event()  # never set: await_live_reports' poll interval


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
        #: the last load of the cluster's placement failed its verification: load it again before registering
        self.load_failed = False

    def rejoin(self, err: Exception | None, old: ClusterConfig | None, live_plan_id: str | None
               ) -> tuple[ClusterConfig, PlacementEntry]:
        """The rank's records or registry entry are gone (``err``: the :class:`NotFoundError` a step raised, None
        when the heartbeat found the registry without the agent; ``old``: the configuration the agent runs with;
        ``live_plan_id``: the plan it holds live). Returns (the configuration, the cluster's current placement)
        the agent registers again under, after loading that placement when it holds another one (the agent's
        safe point does, then :meth:`loaded` audits it). Raises :class:`RecordsLostError` while there is no cluster
        (after reporting the live placement), :class:`TopologyError` when the cluster created again has another
        topology (reported in the live report for ``/health``; the agent stays unregistered), ``err`` itself when
        the cluster is the same incarnation (some other record is missing)."""
        try:
            config = self.store.read_config(fresh=True)
        except NotFoundError:
            self._report(live_plan_id)
            raise RecordsLostError(
                f"rank {self.ep_rank}: the cluster's records are gone (did Redis lose its data?); reported the "
                f"placement held live (plan {live_plan_id or 'initial'}) for init-cluster to adopt") from None
        if old is not None and config.incarnation == old.incarnation and err is not None:
            raise err  # the same cluster: a record of another kind is missing (its reader says which)
        if old is not None and config.topology() != old.topology():
            why = (f"rank {self.ep_rank}: cluster {self.store.cluster!r} was created again with topology "
                   f"{config.topology()}; this worker serves {old.topology()}: not registering (restart it with "
                   f"the cluster's topology, or create the cluster with the worker's)")
            self._report(live_plan_id, refused=why)
            raise TopologyError(why)
        return config, self.store.current_placement()

    def _report(self, live_plan_id: str | None, refused: str = "") -> None:
        now = time.monotonic()
        if now - self._reported_at < self.heartbeat_ttl_ms / 4000:
            return
        self.store.report_live(self.ep_rank, self.backend.phy2log, live_plan_id or "", agent_id=self.agent_id,
                               ttl_ms=self.heartbeat_ttl_ms, refused=refused)
        self._reported_at = now

    def loaded(self, placement: PlacementEntry, check: tuple[int, int], held_plan_id: str | None, actor: str) -> None:
        """Audit that the rank loaded ``placement`` (the cluster's, created again over it) from the checkpoint in
        place of plan ``held_plan_id``; ``check``: (slots verified, slots in total) after the load.
        :class:`VerificationError` (nothing audited; the agent stays unregistered and retries) when a slot does
        not match the checkpoint."""
        verified, total = check
        self.load_failed = verified != total
        if self.load_failed:
            raise VerificationError(f"rank {self.ep_rank}: loaded the cluster's placement "
                                    f"{placement.plan_id or 'initial'} but {total - verified} of {total} slots do not "
                                    f"match the checkpoint; not registering")
        reason = (f"rank {self.ep_rank} held plan {held_plan_id or 'initial'} live; loaded the placement of the "
                  f"cluster created again, plan {placement.plan_id or 'initial'} ({routing_digest(placement.phy2log)})"
                  f", from the checkpoint, {verified} of {total} slots verified")
        self.store.append_note(self.store.read(RANK, self.ep_rank), trigger=PLACEMENT_LOADED, actor=actor, reason=reason,
                               detail={"held_plan_id": held_plan_id or "", "plan_id": placement.plan_id,
                                       "slots_verified": verified, "slots_total": total},
                               table=RANK, ep_rank=self.ep_rank)


class Rejoining:
    """The rank agent's side of a cluster created again over it (a mixin of
    :class:`~fdeplb.orchestration.agent.RankAgent`, whose attributes it uses: ``recovery``, ``backend``, ``config``,
    ``live_plan_id``, ``live_ranks``, its safe points and registration)."""

    def _records_lost(self, err: Exception | None) -> None:
        """The rank's records or registry entry are gone: once the cluster was created again over this live agent
        with its topology (:meth:`Recovery.rejoin`, which raises otherwise), load the cluster's placement when it
        holds another one (from the checkpoint, at the next safe point, verified and audited), forget the old
        cluster's round state (staging, published round, clear_stat requests seen), create the rank's records and
        register again. An operator's delete (its tombstone) stops the agent instead, writing nothing."""
        if self._stop_if_deleted():
            self._outbox.clear()
            return
        self.config, placement = self.recovery.rejoin(err, self.config, self.live_plan_id)
        loading = self.switch.op is not None and self.switch.op.key[0] == "load_placement"  # applied at a safe point since
        if (loading or self.recovery.load_failed or not np.array_equal(self.backend.phy2log, placement.phy2log)) \
                and not self._load_placement(placement):
            return  # the worker's next safe point loads it; the heartbeat after it registers
        plan_id = placement.plan_id
        self._drop_staging()
        self._plan_read = ("", None)
        self._published_round = -1
        self.rank.ensure()
        self.weights.ensure()
        self._clear_stat_seen = self.store.read_cluster().clear_stat_request
        self.live_plan_id = plan_id
        self.live_ranks = placement.live_ranks(self.config.ep_size)  # as start() routes
        self.backend.set_live_ranks(self.live_ranks)
        self._register(plan_id)
        self.log.warning("registered again", incarnation=self.config.incarnation, plan_id=plan_id,
                         agent_id=self.agent_id)
        self.store.emit_event("rank_registered_again", rank=self.ep_rank, plan_id=plan_id)

    def _load_placement(self, placement: PlacementEntry) -> bool:
        """Reload every live slot for the cluster's ``placement`` from the checkpoint at a safe point (at once in a
        threaded agent), routed over its members; True once loaded, verified and audited
        (:meth:`Recovery.loaded`), False while it waits for the worker's safe point."""
        members = placement.live_ranks(self.config.ep_size)

        def load() -> tuple[int, int]:
            check = self.backend.reload_in(placement.phy2log)
            self.backend.set_live_ranks(members)
            self.live_ranks = members
            return tuple(check)

        op = self.switch.schedule(("load_placement", self.config.incarnation, placement.plan_id), 0, load)
        if op is None:
            return False
        self.switch.op = None
        if op.error is not None:
            raise op.error
        self.recovery.loaded(placement, op.result, self.live_plan_id, self.actor)
        self.log.warning("loaded the cluster's placement", held_plan_id=self.live_plan_id, plan_id=placement.plan_id)
        return True


def await_live_reports(store: Store, ep_size: int, wait_ms: int, *, since_start: bool = False
                       ) -> tuple[list[int], float]:
    """Wait until ranks ``0..ep_size-1`` all have a live report (:meth:`Store.live_report_ranks`) or ``wait_ms``
    has passed: from now, or with ``since_start`` from the Redis server's start (agents report as soon as they
    notice their records are gone: the moment Redis answers again after a restart, else within a quarter heartbeat
    TTL, so the agents' TTL + TTL/4 covers them). With ``since_start`` a server up longer than that (a cluster
    created for the first time) is not waited on unless some rank has reported; then the others get the full
    ``wait_ms`` from now. Returns (the ranks that reported, seconds waited). Polls every 50 ms; Redis errors as
    the store raises them."""
    t0 = time.monotonic()
    deadline = t0 + max(0, wait_ms - (store.uptime_ms() if since_start else 0)) / 1000
    wanted = set(range(int(ep_size)))
    while True:
        ranks = store.live_report_ranks()
        if wanted <= set(ranks):
            break
        if ranks:  # live agents exist: the others may still be noticing
            deadline = max(deadline, t0 + wait_ms / 1000)
        if time.monotonic() >= deadline:
            break
        _pause.wait(0.05)
    return [r for r in ranks if r in wanted], time.monotonic() - t0


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
                         f"nothing written: run init-cluster again with --adopt-wait-ms 0 to write the initial "
                         f"placement instead (every live rank loads it from the checkpoint and registers; no restart "
                         f"needed)")
    rep = fresh[0]
    shape = (config.num_layers, config.num_physical_experts)
    if rep.phy2log.shape != shape:
        raise TopologyError(f"cluster {store.cluster!r}: the live ranks hold a placement of shape "
                            f"{rep.phy2log.shape}, the configuration says {shape}; nothing written")
    return rep.phy2log, rep.plan_id, [r.ep_rank for r in fresh]


