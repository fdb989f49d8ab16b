"""Rounds to a given placement, and the rollback after a swap whose output probe failed.

A *supplied* round goes to a placement given to it (stored with :meth:`fdeplb.store.Store.supply_placement`)
instead of one its policy computes: the coordinator's next round plans it with no gain gate, its plan's topology
and its ``load`` record carry the facts (``supplied``: kind, the round it undoes, the placement it goes to;
:func:`fdeplb.rounds.reasons.supplied_round`), and the round that commits it drops it. Two kinds:

- an **operator's plan** (``fdeplb rearrange --plan FILE``, ``POST /v1/round/plan``): :func:`supply_operator_plan`
  checks it against the configuration and the ACTIVE members (refused, nothing written, when it has another
  shape, lacks a logical expert, or leaves one with replicas only on non-members) and supplies it while the
  cluster is FREE; the round is requested by the caller (and by FREE's entry work, which coalesces);
- the **rollback**:

1. every rank reports its swap's probe in its rank record (:mod:`fdeplb.orchestration.probe`); when every rank has
   swapped, :func:`probe_outcome` reads them and the round's ``swapped`` is audited as a ``probe_mismatch`` naming
   the ranks and layers (the cluster record keeps it in ``probe_mismatch``: ``/health`` is 503);
2. in DONE (:func:`after_round`), before retention prunes anything, the placement the round replaced (its plan
   entry's ``old_phy2log``) is supplied for the next round;
3. in FREE (:func:`request_supplied`) a round is requested at once; it goes back to that placement, the probe
   runs again (compared with the outputs of the placement it goes back to), and its ``swapped`` clears
   ``probe_mismatch`` when no probe fails (``/health`` 200 again). A rollback whose probe fails again is not
   rolled back once more: an alarm says so and ``/health`` stays 503 until a later round swaps with no probe
   failing (an operator's).

A supplied placement that leaves a logical expert without a replica on a member aborts its round and is dropped
(:func:`supplied_for_planning`); one whose round aborts otherwise stays, and FREE requests a round for it again.

Functions of the coordinator's entry work (their ``store``: a :class:`~fdeplb.store.Store`); no state of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdeplb.errors import CorruptRecordError, InputError, StateError
from fdeplb.machines.tables import RANK, ClusterState
from fdeplb.rounds import reasons
from fdeplb.orchestration.probe import ProbeOutcome
from fdeplb.placement import orphaned_experts
from fdeplb.placement.digest import routing_digest
from fdeplb.rounds.members import live_mask
from fdeplb.store import ClusterRecord

__all__ = ["after_round", "probe_outcome", "request_supplied", "supplied_for_planning", "check_operator_plan",
           "supply_operator_plan"]

_FAILED = (ProbeOutcome.MISMATCH.value, ProbeOutcome.FAILED.value)


def probe_outcome(store: Any, plan_id: str) -> reasons.Reason:
    """The reason of the ``swapped`` of plan ``plan_id``'s round: :func:`~fdeplb.rounds.reasons.
    probe_mismatch` naming every rank whose record reports a failed probe for that plan, or an empty reason when
    none does. Reads every rank's whole record (one round trip; :class:`CorruptRecordError` for one that does not
    parse)."""
    items = [{"ep_rank": r, "outcome": x.probe, "message": x.probe_message,
              "layers": [int(v) for v in x.probe_layers.split(",") if v.isdigit()]}
             for r, x in enumerate(store.read_all(RANK)) if x.plan_id == plan_id and x.probe in _FAILED]
    return reasons.probe_mismatch(items) if items else reasons.Reason("")


def after_round(store: Any, rec: ClusterRecord) -> str | None:
    """DONE entry work, before retention: a supplied round that committed drops its supplied placement; a round
    whose probe failed (``rec.probe_mismatch``) supplies the placement it replaced (its plan entry's
    ``old_phy2log``) for a rollback round. Idempotent (a coordinator replaced mid-way does it again). Returns an
    alarm's text when no rollback can be made (the round was itself a rollback, or its plan is gone), else None."""
    try:
        supplied = store.supplied_placement()
    except CorruptRecordError:  # never blocks the release: a placement nobody can read is no rollback
        store.drop_supplied_placement()
        supplied = None
    if not rec.probe_mismatch and supplied is None:
        return None  # the usual round: nothing supplied, nothing to undo (its plan is not read)
    plan = store.read_plan(rec.plan_id)
    facts = None if plan is None else reasons.supplied_of(plan.topology)
    if facts is not None and supplied is not None and _facts(supplied[1]) == facts:
        store.drop_supplied_placement()  # this round went to it (one supplied since stays for the next round)
    if not rec.probe_mismatch:
        return None
    if facts is not None and facts["kind"] == "rollback":
        return (f"rollback round {rec.round} (of round {facts['undoes']}) still fails its probe: no further rollback; "
                f"{rec.probe_mismatch}")
    if plan is None:
        return f"cannot roll back round {rec.round}: its plan {rec.plan_id} is not stored; {rec.probe_mismatch}"
    store.supply_placement(plan.old_phy2log, reasons.supplied_round(
        "rollback", rec.round, plan.old_plan_id, "probe_mismatch").detail["supplied"])
    return None


def request_supplied(store: Any) -> bool:
    """FREE entry work with no round pending: request the round a supplied placement waits for (True), or nothing
    to do (False). An operator's plan is tried by one round only: once a round after the one it was supplied in
    (its ``undoes``) has ended without committing it (aborted; a committed one drops it), it is dropped here, so a
    plan that cannot load never loops (the operator saw the abort and may supply it again). A request for it that
    expires or is cancelled drops it in its own transaction (:meth:`fdeplb.store.Store.withdraw_request`)."""
    try:
        supplied = store.supplied_placement()
    except CorruptRecordError as err:
        store.drop_supplied_placement()  # never a round to a placement nobody can read: planned as usual
        raise CorruptRecordError(f"{err}; dropped, the next round is planned from the loads", key=err.key) from None
    if supplied is None:
        return False
    try:
        facts = _facts(supplied[1])
        why = reasons.supplied_round(**facts).text
    except (ValueError, KeyError, TypeError, InputError):  # planning drops it, aborting that round with the error
        facts, why = None, "supplied placement"
    if facts is not None and facts["kind"] == "operator" and store.read_cluster().round > facts["undoes"]:
        store.drop_supplied_placement()  # its round ended without it: not retried
        return False
    store.request_round(why[:100])
    return True


def supplied_for_planning(store: Any, num_logical_experts: int, live: np.ndarray) -> \
        tuple[np.ndarray, dict[str, Any]] | None:
    """PLANNING: the supplied placement (int64 [L, P]) and its checked facts
    (:func:`~fdeplb.rounds.reasons.supplied_of`), or None. ``live``: bool [ep_size], the round's members.
    A stored value that does not parse raises :class:`CorruptRecordError`, one that leaves a logical expert
    without a replica on a member :class:`InputError` naming them; either way it is dropped (never retried) and
    the round aborts with the error."""
    try:
        supplied = store.supplied_placement()
        if supplied is None:
            return None
        phy2log, facts = supplied[0], _facts(supplied[1])
    except (CorruptRecordError, InputError, ValueError, KeyError, TypeError) as err:
        store.drop_supplied_placement()
        raise CorruptRecordError(f"supplied placement: {err}") from None
    orphans = orphaned_experts(phy2log, num_logical_experts, len(live), live)  # also an expert it lacks
    if orphans:
        store.drop_supplied_placement()
        raise InputError(f"the supplied placement ({reasons.supplied_round(**facts).text}) leaves {len(orphans)} "
                         f"experts (layer, log_id) without a replica on a member, e.g. {orphans[:5]}: dropped")
    return phy2log, facts


def check_operator_plan(store: Any, phy2log: np.ndarray) -> np.ndarray:
    """An operator's plan ``phy2log`` (int [L, P]) checked against the configuration and the ACTIVE members, as
    int64 [L, P]; reads only. :class:`InputError` for another shape than [num_layers, num_physical_experts], an
    id outside [0, E), a logical expert it lacks, or one whose replicas are all on ranks that are not ACTIVE
    members (an EXCLUDED rank is never routed to: the expert would have no route)."""
    cfg = store.read_config()
    arr = np.asarray(phy2log)
    shape = (cfg.num_layers, cfg.num_physical_experts)
    if arr.shape != shape or arr.dtype.kind not in "iu":
        raise InputError(f"plan has shape {arr.shape} ({arr.dtype}), the cluster's placement is int {shape} "
                         f"(num_layers x num_physical_experts): nothing supplied")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() >= cfg.num_logical_experts:
        raise InputError(f"plan holds expert ids outside [0, {cfg.num_logical_experts}): nothing supplied")
    live = live_mask(store.restored_view(), cfg.ep_size)  # a deleted record as the coordinator restores it
    orphans = orphaned_experts(arr, cfg.num_logical_experts, cfg.ep_size, live)
    if orphans:
        raise InputError(f"plan leaves {len(orphans)} experts (layer, log_id) without a replica on an ACTIVE member "
                         f"(ACTIVE: ranks {np.flatnonzero(live).tolist()}), e.g. {orphans[:5]}: nothing supplied")
    return arr


def supply_operator_plan(store: Any, phy2log: np.ndarray, source: str) -> str:
    """Supply an operator's plan ``phy2log`` (int [L, P]; ``source``: where it came from, e.g. the file, kept in
    the round's reason, at most 200 characters) for the next round; returns its routing digest (the ``plan_id``
    of its facts). Refused with nothing written: :class:`InputError` as :func:`check_operator_plan`;
    :class:`StateError` when the cluster is not FREE (a round in flight would take it mid-way) or a supplied
    placement waits already (a rollback's)."""
    arr = check_operator_plan(store, phy2log)
    digest = routing_digest(arr)
    supplied: dict[str, Any] = {}

    def while_free(rec: Any) -> None:  # inside the store's WATCHed write: a round that starts meanwhile refuses it
        if rec.state is not ClusterState.FREE:
            raise StateError(f"cluster {store.cluster} is in {rec.state.value} (round {rec.round}): a plan is "
                             f"supplied only while it is FREE; try again when the round is over")
        _refuse_if_waiting(store)
        # rec.round: the last round; the next one goes to the plan
        supplied.update(reasons.supplied_round("operator", rec.round, digest, source[:200]).detail["supplied"])

    store.supply_placement(arr, supplied, check=while_free)
    return digest


def _refuse_if_waiting(store: Any) -> None:
    """:class:`StateError` when a supplied placement waits for the next round already (naming it)."""
    waiting = store.supplied_placement()
    if waiting is None:
        return
    try:
        facts = _facts(waiting[1])
        what = reasons.supplied_round(**facts).text
    except (ValueError, KeyError, TypeError, InputError):
        facts, what = {}, "unreadable facts"
    hint = ("`fdeplb round cancel` withdraws it before its round starts" if facts.get("kind") == "operator"
            else "try again after it")
    raise StateError(f"a supplied placement waits for the next round of cluster {store.cluster} already "
                     f"({what}): {hint}")


def _facts(stored: Any) -> dict[str, Any]:
    """Stored facts of a supplied placement, checked (ValueError / InputError / KeyError otherwise)."""
    return reasons.supplied_of({"supplied": stored})
