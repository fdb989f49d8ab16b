"""The operator's escape hatches on a cluster (``fdeplb round abort|cancel``, ``fdeplb config set``, ``fdeplb
cluster delete`` and their HTTP routes): abort the round in flight before the commit point, cancel a pending round
request, change the settings that may change, delete the cluster. Each is audited with who asked (``by``, the
actor) and why (``reason``), as structured detail (:class:`~fdeplb.rounds.reasons.Reason`); a command that
cannot apply changes nothing and raises a typed error saying why. The membership commands on one rank are
:func:`fdeplb.orchestration.membership.operator_fire`'s.
"""

from __future__ import annotations

from typing import Any

from fdeplb.errors import GenerationError, IllegalTransitionError, StaleStateError, StateError
from fdeplb.machines.tables import CLUSTER, ClusterState
from fdeplb.orchestration.handles import Fired, RecordHandle
from fdeplb.rounds import reasons
from fdeplb.store import ClusterConfig, Store
from fdeplb.store.audit_export import check_export_path, check_trimming
from fdeplb.store.records import check_request_reason
from fdeplb.store.liveness import stale_of

__all__ = ["OPERATOR_ABORT", "abort_round", "cancel_request", "change_settings", "delete_cluster"]

#: the cluster trigger of an operator's abort (unfenced, :attr:`~fdeplb.machines.tables.TransitionSpec.by_operator`)
OPERATOR_ABORT = "operator_abort"
#: how often an abort is tried again when the coordinator committed between its read and its commit
_ABORT_TRIES = 20


def _why(verb: str, by: str, reason: str, **facts: Any) -> reasons.Reason:
    check_request_reason(reason)
    return reasons.Reason(f"operator {verb} by {by}" + (f": {reason}" if reason else ""), {"by": by, **facts})


def abort_round(store: Store, *, by: str, reason: str = "") -> Fired:
    """Abort the round in flight (COLLECTING, PLANNING, LOADING or LOAD_SUCC) with the ``operator_abort``
    transition: audited (actor ``by``; reason ``operator abort by <by>: <reason>``, detail ``{"by", "round"}``), the
    old placement stays, the ranks drop their staging. The commit step checks the state and version the abort was
    decided on, so a commit that came first wins: the abort is then refused, saying so.

    Raises :class:`IllegalTransitionError` (exit 3, HTTP 409; nothing written) when the cluster is FREE (naming a
    pending request, which :func:`cancel_request` withdraws) or past the commit point (SWAPPING, DONE: the round
    rolls forward); :class:`InputError` for a bad ``reason``."""
    handle = RecordHandle(store, CLUSTER, actor=by)
    for _ in range(_ABORT_TRIES):
        rec = handle.read()
        if rec.state is ClusterState.FREE:
            pending = (f"; round {rec.requested} is requested and not started: `fdeplb round cancel` withdraws the "
                       f"request" if rec.requested > rec.round else "")
            raise IllegalTransitionError(f"no round in flight to abort (cluster FREE, round {rec.round}){pending}")
        if rec.state not in CLUSTER.spec(ClusterState.COLLECTING, OPERATOR_ABORT).sources:
            raise IllegalTransitionError(
                f"round {rec.round} is {rec.state}: past the commit point (plan {rec.plan_id} is the cluster's "
                f"placement), so it cannot be aborted; it rolls forward to FREE")
        why = _why("abort", by, reason, round=rec.round, state=rec.state.value)
        try:
            return handle.fire(OPERATOR_ABORT, record=rec, reason=why.text[:2000], detail=why.detail,
                               changes={"deadline_ms": 0, "reason": why.text[:2000]})
        except (StaleStateError, GenerationError):  # the coordinator moved the round meanwhile: decide again
            continue
    raise StateError(f"the cluster record kept changing under the abort ({_ABORT_TRIES} tries); try again")


def cancel_request(store: Store, *, by: str, reason: str = "") -> tuple[int, str]:
    """Withdraw the pending round request (the cluster is FREE and a round is requested, not started): audited as a
    ``request_cancelled`` note (actor ``by``, detail ``{"by", "round", "requested_reason"}``). An operator's plan
    waiting for that round (``fdeplb rearrange --plan``) is withdrawn with it, in the same transaction (the note's
    ``dropped_supplied``): otherwise FREE's entry work would request its round again at once; a rollback stays.
    Returns (the withdrawn round, the routing digest of the operator's plan withdrawn, or "").
    :class:`StateError` (nothing written) when no request is pending; :class:`InputError` for a bad ``reason``."""
    why = _why("cancel", by, reason)
    withdrawn, _, dropped = store.withdraw_request(None, trigger="request_cancelled", actor=by, reason=why.text[:2000],
                                                   detail=why.detail, drop_supplied="operator")
    return withdrawn, str((dropped or {}).get("plan_id", ""))


def change_settings(store: Store, changes: dict[str, Any], *, by: str, reason: str = "",
                    audit_dir: str | None = None) -> tuple[ClusterConfig, ClusterConfig]:
    """Change the settings of :data:`~fdeplb.store.cluster_config.SETTABLE` (policy, min_gain, cordoned,
    retention, deadlines, the audit export path) of a running cluster: the configuration's ``version`` goes up by
    one and a ``config_changed`` note audits each change with who and why (:meth:`fdeplb.store.Store.change_config`).
    Applies from the next round (a round in flight keeps the settings it started with). A non-empty
    ``audit_export_path`` must lie in ``audit_dir`` and be a regular file
    (:func:`~fdeplb.store.audit_export.check_export_path`; stored as its absolute path); with no ``audit_dir`` it is
    refused. A change of ``audit_keep`` or ``audit_export_path`` that leaves ``audit_keep`` > 0 is refused unless
    the resulting export path passes that check for ``audit_dir`` (:func:`~fdeplb.store.audit_export.check_trimming`,
    as a coordinator started with that ``--audit-dir`` checks it), checked against the configuration as written (in
    its transaction): a setting no coordinator would start with is never stored. Returns (old, new);
    :class:`InputError` for a setting that may not change or a bad value (nothing written)."""
    check_request_reason(reason)
    if changes.get("audit_export_path"):
        changes = {**changes, "audit_export_path": check_export_path(changes["audit_export_path"], audit_dir)}

    def trimming(new: ClusterConfig) -> None:
        check_trimming(new.audit_keep, new.audit_export_path, audit_dir)

    touched = {"audit_keep", "audit_export_path"} & changes.keys()
    old, new, _ = store.change_config(changes, actor=by, reason=reason, check=trimming if touched else None)
    return old, new


def delete_cluster(store: Store, *, force: bool = False, by: str = "") -> int:
    """Delete every key of the cluster (:meth:`fdeplb.store.Store.delete_cluster`: a SCAN of its key prefix).
    Refused with :class:`StateError` (nothing deleted) while an agent is alive (a registered rank whose heartbeat
    is within its TTL, :func:`~fdeplb.store.liveness.stale_of`) or a coordinator holds the lease, unless
    ``force``. ``by`` (the operator): the delete leaves the cluster's tombstone, in the same transaction, so that
    agents and coordinators still running stop (:class:`~fdeplb.orchestration.reconcile.StopsWhenDeleted`).
    Returns how many keys were deleted."""
    if not force:
        beats = store.heartbeats()
        alive = sorted(set(beats) - set(stale_of(beats)))
        holder = store.lease_info().holder
        if alive or holder:
            who = ([f"ranks {alive} heartbeat within their TTL"] if alive else []) + \
                  ([f"coordinator {holder} holds the lease"] if holder else [])
            raise StateError(f"cluster {store.cluster!r} is in use ({'; '.join(who)}): stop them first, or "
                             f"delete anyway with --force (they find the cluster deleted and stop)")
    return store.delete_cluster(by=by)
