"""Where each expert a rank must load comes from: a peer rank that holds it live, or the checkpoint. Pure numpy.

:func:`~fdeplb.weights.plan.plan_transfer` names the experts new to a rank (``TransferPlan.disk``); every one of
them is live in some rank's slot of the current placement. :func:`peer_sources` picks, for each, a **peer rank
that holds it live** (a member other than the rank itself) or :data:`CHECKPOINT` when no member does.

Spread: the choice is made over the whole cluster's needs at once, the same on every rank (same placements, same
members): needs are taken in (layer, requesting rank, expert) order and each goes to its holder that has been given
the fewest experts so far, the lowest rank on ties. So with several holders every peer serves a share, and two
ranks never disagree on who serves what.

Safety: a peer serves from the slots of the placement it holds live, which is the placement the round started from.
Staging completes in LOADING, before the commit point, and live slots change only at a committed swap's safe point,
so no slot a peer serves from is overwritten while the transfer runs. The peer checks it anyway: every request
names the placement it expects (:func:`~fdeplb.placement.digest.routing_digest` of ``old_phy2log``) and the peer
refuses one that names another (:mod:`fdeplb.weights.peer`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from fdeplb.errors import InputError
from fdeplb.weights.plan import changed_layers, rank_slots

#: the source of an expert no member holds live: read from the checkpoint
CHECKPOINT = -1


def _new_to_rank(old: np.ndarray, new: np.ndarray, layer: int) -> list[int]:
    """Logical experts of ``new``'s row not in ``old``'s row (the rank's slots), each once, in slot order."""
    have = set(old[layer].tolist())
    out: list[int] = []
    for e in new[layer].tolist():
        if e not in have and e not in out:
            out.append(e)
    return out


def peer_sources(old_phy2log: np.ndarray, new_phy2log: np.ndarray, ep_rank: int, ep_size: int,
                 members: Iterable[int]) -> dict[tuple[int, int], int]:
    """For every ``(layer, logical expert)`` new to ``ep_rank``, the peer rank that serves it, or :data:`CHECKPOINT`.

    Args:
        old_phy2log: int [L, P], the placement every member holds live now (-1: an empty slot, held by nobody).
        new_phy2log: int [L, P], the round's target placement.
        ep_rank, ep_size: the requesting rank; slots of rank r are ``[r*P/ep_size, (r+1)*P/ep_size)``.
        members: the ranks that hold ``old_phy2log`` live and serve peers (the round's members); ranks outside
            ``[0, ep_size)`` are an error, duplicates are ignored, ``ep_rank`` itself never serves itself.

    Returns:
        ``{(layer, expert): peer rank or CHECKPOINT}`` with one entry per expert in
        :attr:`~fdeplb.weights.plan.TransferPlan.disk` of the same placements. Deterministic (see the module doc).

    Raises:
        InputError: placements of different shapes or non-integer dtypes, a member outside ``[0, ep_size)``.
        TopologyError: P not a multiple of ``ep_size``, ``ep_rank`` out of range.
    """
    changed_layers(old_phy2log, new_phy2log)  # InputError: not two integer placements of one shape
    old, new = np.asarray(old_phy2log, dtype=np.int64), np.asarray(new_phy2log, dtype=np.int64)
    rank_slots(old.shape[1], ep_rank, ep_size)  # TopologyError for a rank outside the cluster
    servers = sorted({int(r) for r in members})
    if any(not 0 <= r < ep_size for r in servers):
        raise InputError(f"members {servers} must lie in [0, ep_size={ep_size})")
    slots = [rank_slots(old.shape[1], r, ep_size) for r in range(ep_size)]
    requesters = sorted(set(servers) | {int(ep_rank)})
    served = {r: 0 for r in servers}
    out: dict[tuple[int, int], int] = {}
    for layer in range(old.shape[0]):
        held = {r: set(old[layer, slots[r]].tolist()) for r in servers}
        for r in requesters:
            for e in _new_to_rank(old[:, slots[r]], new[:, slots[r]], layer):
                holders = [h for h in servers if h != r and e in held[h]]
                source = min(holders, key=lambda h: (served[h], h)) if holders else CHECKPOINT
                if source != CHECKPOINT:
                    served[source] += 1
                if r == ep_rank:
                    out[(layer, e)] = source
    return out
