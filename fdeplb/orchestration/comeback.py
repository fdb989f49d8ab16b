"""A rank agent that lived on through its rank's exclusion comes back as a member (:class:`ComeBack`, mixed into
:class:`~fdeplb.orchestration.agent.RankAgent`): a hung engine that steps again, or a worker that was stopped
(SIGSTOP) and continued, was suspected and excluded meanwhile while its process, and its agent, stayed. A restarted
worker rejoins at its start (:class:`~fdeplb.orchestration.membership.Rejoin`); this agent does the same once it is
back: it holds the cluster's current placement for its slots (reloaded from the checkpoint at a safe point when it
holds another one, routed over the placement's members), then fires ``rejoin`` (REJOINING, admitted while FREE).

An agent only comes back from an absence it saw itself (:meth:`ComeBack._note_away`: its heartbeats stopped for
more than their TTL, or its engine passed no safe point for ``deadlines.exclude_ms``): a rank drained by the
operator, whose agent never was away, stays EXCLUDED until readmitted.

Of its host it uses ``store``, ``config``, ``backend``, ``live_ranks``, ``live_plan_id``, ``rank`` (its
:class:`~fdeplb.orchestration.handles.RecordHandle`), ``_rejoin``, ``_at_safe_point``, ``_op``,
``heartbeat_ttl_ms``, ``safe_point_age_ms``, ``log`` and ``ep_rank``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fdeplb.errors import CorruptRecordError, NotFoundError
from fdeplb.machines.tables import ClusterState, MemberState, RankState
from fdeplb.placement import routing_digest
from fdeplb.store import ClusterRecord, RankRecord
from fdeplb.store.liveness import hung_of, stale_of

__all__ = ["ComeBack"]


class ComeBack:
    """The way back of an agent whose rank was excluded while it lived on (see the module doc)."""

    _away = ""  # why the agent was away ("" = it was not), until it is back as a member or never left

    def _hung(self, now: float) -> bool:
        """Whether the worker's engine passed no safe point for ``deadlines.exclude_ms`` up to ``now``
        (monotonic s), by the coordinator's rule (:func:`~fdeplb.store.liveness.hung_of`); never for an agent
        without an engine."""
        age = self.switch.safe_point_age_ms(now)
        return age is not None and bool(hung_of({self.ep_rank: age}, (self.ep_rank,),
                                                self.config.deadlines.exclude_ms))

    def _note_away(self, now: float, last_t: float) -> None:
        """At a heartbeat at ``now`` (monotonic s), the previous one at ``last_t`` (0 = none): note that the agent
        was away when the heartbeats stopped for more than their TTL (its process was stopped) or its engine is
        hung; logged once."""
        if self._away or self.config is None:
            return
        gap = round((now - last_t) * 1000)
        if last_t and stale_of({self.ep_rank: (gap, self.heartbeat_ttl_ms)}):  # it lapsed, as others saw it
            self._away = f"no heartbeat for {gap} ms"
        elif self._hung(now):
            self._away = f"no safe point for {self.switch.safe_point_age_ms(now)} ms"
        if self._away:
            self.log.warning("away: the rank may be suspected and excluded", why=self._away)

    def _come_back(self, cluster: ClusterRecord, me: RankRecord) -> bool:
        """After an absence (:meth:`_note_away`), once the engine steps again, the cluster is FREE and the rank
        IDLE: if the rank was excluded meanwhile, hold the current placement and fire ``rejoin``; if it was not
        (or recovered), forget the absence; while it is SUSPECT, wait for the coordinator's verdict. True when it
        fired ``rejoin``. A member record that is missing (a cluster made before membership) or corrupt (the
        coordinator repairs it) is left alone."""
        if not self._away or self._hung(time.monotonic()):
            return False
        if cluster.state is not ClusterState.FREE or me.state is not RankState.IDLE:
            return False
        try:
            state = self._rejoin.handle.read().state
        except NotFoundError:
            self._away = ""
            return False
        except CorruptRecordError:
            return False
        if state is not MemberState.EXCLUDED:
            if state is not MemberState.SUSPECT:
                self._away = ""
            return False
        current = self.store.current_placement()
        if not self._hold(("come_back", current.plan_id), current):
            return False  # at the worker's next safe point
        self.live_plan_id = current.plan_id
        self.rank.update(live_plan_id=current.plan_id, routing_digest=routing_digest(self.backend.phy2log))
        self.log.warning("back after an exclusion", why=self._away, plan_id=current.plan_id)
        self._rejoin.begin(current.plan_id, back=self._away)
        self._away = ""
        return True

    def _hold(self, key: tuple, current: Any) -> bool:
        """Have the live slots hold placement ``current`` (a :class:`~fdeplb.store.PlanEntry`), routed over its
        members: reloaded from the checkpoint at a safe point (op ``key``) when they hold another one. True once
        they hold it; False while the op waits for a safe point; an error of the reload raises."""
        members = current.live_ranks(self.config.ep_size)
        if np.array_equal(self.backend.phy2log, current.phy2log) and members == self.live_ranks:
            return True

        def reload() -> None:
            self.backend.reload_in(current.phy2log)
            self.backend.set_live_ranks(members)
            self.live_ranks = members

        op = self.switch.schedule(key, 0, reload)
        if op is None:
            return False
        self.switch.op = None
        if op.error is not None:
            raise op.error
        return True
