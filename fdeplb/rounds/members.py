"""The rules a round applies to the ranks' membership: who counts (:func:`live_mask`, :func:`participants`), where the
placement is routed (:func:`routed_members`), the re-placement of experts left without a replica on a member
(:func:`replacement`, failing closed), the planner over the members' slots (:func:`live_planner`), the members a
round lost (:func:`lost_participants`) and the ranks it waits on (:func:`waited_on`). Used by the coordinator's
round entry work, the membership watch and the replay.

Pure numpy over a :class:`~fdeplb.store.liveness.MemberView`, no I/O, no clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdeplb.errors import RedundancyError
from fdeplb.machines.tables import ClusterState, MemberState
from fdeplb.placement.live_ranks import orphaned_experts, replace_orphans
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import default_planner
from fdeplb.store.liveness import MemberView
from fdeplb.store.records import member_ranks

M = MemberState

__all__ = ["live_mask", "live_planner", "lost_participants", "participants", "participants_text", "replacement",
           "routed_members", "waited_on"]


def live_mask(view: MemberView | None, ep_size: int) -> np.ndarray:
    """bool [ep_size]: the ACTIVE members of ``view`` (every rank when there is no view)."""
    mask = np.ones(ep_size, dtype=bool)
    if view is not None:
        for r, st in enumerate(view.states()):
            mask[r] = st is M.ACTIVE
    return mask


def routed_members(routed: tuple[int, ...], view: MemberView | None, ep_size: int) -> tuple[int, ...]:
    """The ranks the placement should be routed over, given the ranks it is ``routed`` over now: an EXCLUDED rank
    leaves, an ACTIVE one joins, and a SUSPECT, DRAINING or REJOINING rank stays as it is (a heartbeat that lapses
    for a moment must not cost a round: only its exclusion, after ``exclude_ms``, re-routes)."""
    if view is None:
        return tuple(range(ep_size))
    states = view.states()
    return tuple(r for r in range(ep_size) if (r in routed and states[r] is not M.EXCLUDED)
                 or (r not in routed and states[r] is M.ACTIVE))


def replacement(phy2log: np.ndarray, num_logical_experts: int, ep_size: int, live: np.ndarray,
                expert_load: np.ndarray | None) -> tuple[np.ndarray | None, reasons.Reason | None]:
    """The re-placement of ``phy2log``'s orphaned experts (no replica on a live rank) onto ``live`` ranks:
    (new phy2log, None); (None, None) when nothing is orphaned; (None, the fail-closed reason naming the experts)
    when the live ranks lack redundant replicas (:class:`RedundancyError`: nothing is placed)."""
    if not orphaned_experts(phy2log, num_logical_experts, ep_size, live):
        return None, None
    try:
        return replace_orphans(phy2log, num_logical_experts, ep_size, live, expert_load), None
    except RedundancyError as err:
        return None, reasons.fail_closed(str(err), [int(r) for r in np.flatnonzero(~live)], err.orphans or [])


def live_planner(planner: Any, live: np.ndarray) -> Any:
    """``planner`` (a :data:`~fdeplb.rounds.gating.Planner`) over the ``live`` ranks: the default planner
    plans on their slots only (``rebalance_experts(..., live_ranks=)``); another planner knows no mask, so any
    expert its plan leaves without a live replica is re-placed after it (:func:`replace_orphans`, which fails
    closed with :class:`RedundancyError`)."""
    def plan(expert_load: np.ndarray, old_phy2log: np.ndarray, cfg: Any) -> np.ndarray:
        if planner is default_planner:
            return default_planner(expert_load, old_phy2log, cfg, live_ranks=live)
        new = planner(expert_load, old_phy2log, cfg)
        return replace_orphans(np.asarray(new, dtype=np.int64), cfg.num_logical_experts, cfg.ep_size, live,
                               expert_load)

    return plan


def participants_text(active: list[int], ep_size: int) -> str:
    """The cluster record's ``members`` for a round started with ``active`` ACTIVE ranks ("" = every rank)."""
    return "" if len(active) == ep_size else ",".join(str(r) for r in active)


def participants(members: str, ep_size: int) -> list[int]:
    """The ranks a round counts (the cluster record's ``members``; "" = every rank)."""
    return list(member_ranks(members, ep_size))


def waited_on(state: ClusterState, members: str, ep_size: int) -> tuple[int, ...]:
    """The ranks a round in ``state`` waits on: its participants (the cluster record's ``members``) while a round
    is in flight, none while the cluster is FREE. The membership watch suspects a hung engine among them."""
    return () if state is ClusterState.FREE else tuple(participants(members, ep_size))


def lost_participants(members: str, view: MemberView | None, ep_size: int) -> list[int]:
    """The round's participants that are no longer ACTIVE members (a suspected, drained or excluded rank), and the
    ACTIVE members that are not participants (readmitted meanwhile): before the commit point the round aborts."""
    if view is None:
        return []
    states = view.states()
    part = set(participants(members, ep_size))
    return sorted(r for r, st in enumerate(states) if (r in part) != (st is M.ACTIVE))
