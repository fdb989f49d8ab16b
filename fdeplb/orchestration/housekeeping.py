"""The coordinator's housekeeping: work beside the rounds that never fails one.

- :func:`prune_after_round`: retention as a round ends (old snapshots and plans; the audit stream's length,
  :func:`export_and_trim_audit`: exported before it is trimmed, never trimmed when the export fails, which raises
  an alarm);
- :class:`WeightsWatchdog`: the cancel of a weight clear / update whose switch step is not fixed in time (or the
  alarm, when a rank carried it out already), with its own memory of when it first saw each request pending.
"""

from __future__ import annotations

import time
from typing import Any

from fdeplb.errors import FenceError, InputError, StateError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHT_CANCELS, WEIGHTS, WeightState
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.rounds import reasons
from fdeplb.store import ClusterConfig, ClusterRecord, RankRecord, Store, WeightRecord


def prune_after_round(store: Store, cfg: ClusterConfig, rec: ClusterRecord, log: Any, actor: str, fence: str,
                      audit_dir: str | None) -> None:
    """As a round ends, just before its release or abort commits (so whoever sees the cluster FREE sees the store
    pruned; a coordinator that dies in between prunes again at the next round's end): drop snapshots and plans
    older than the last ``cfg.retain_rounds`` rounds, keeping the current placement's plan; record what went in the
    cluster record's ``pruned`` field and a ``pruned`` event; with ``cfg.audit_keep`` set, export and trim the
    audit stream (:func:`export_and_trim_audit`: alarms audited as ``actor`` with ``fence``, the export confined
    to ``audit_dir``). Never fails the round: an error is logged and the next round's end prunes again."""
    try:
        dropped = store.prune(cfg.retain_rounds, (store.current_placement().plan_id,))
        if dropped:
            short = ",".join(k.rsplit(":", 2)[-2] + ":" + k.rsplit(":", 1)[-1] for k in dropped)
            store.update(CLUSTER, pruned=short)
            store.emit_event("pruned", round=rec.round, keys=short)
            log.info("pruned", round=rec.round, keys=short)
    except Exception as err:  # noqa: BLE001 - retention is housekeeping
        log.error("pruning failed", error=str(err))
    if cfg.audit_keep:
        export_and_trim_audit(store, cfg, rec, log, actor=actor, fence=fence, audit_dir=audit_dir)


def export_and_trim_audit(store: Store, cfg: ClusterConfig, rec: ClusterRecord, log: Any, *, actor: str,
                          fence: str, audit_dir: str | None) -> int:
    """Export the audit records but the newest ``cfg.audit_keep`` to ``cfg.audit_export_path`` (confined to this
    coordinator's ``audit_dir``, :mod:`fdeplb.store.audit_export`) and trim them only once they are appended and
    fsynced (:meth:`fdeplb.store.Store.trim_audit`; an ``audit_trimmed`` event). An export that is refused (no
    ``audit_dir``, a path outside it, not a regular file) or fails to write trims nothing: the stream stays whole
    and an alarm is raised (an audited ``alarm`` note with ``detail`` ``{"export", "error"}``, fenced with
    ``fence``; an ``alarm`` event; an error log line), once per round end while it lasts. Returns how many records
    were trimmed; never raises (an alarm that cannot be written is logged). A coordinator that no longer holds
    the lease (``fence`` refused: paused, deposed) trims nothing and raises no alarm (it could not write one): a
    warning is logged, and the leader's next round end exports and trims."""
    path = cfg.audit_export_path
    try:
        trimmed = store.trim_audit(cfg.audit_keep, path, audit_dir, fence=fence)
    except FenceError as err:
        log.warning("audit not trimmed", round=rec.round, error=str(err))
        return 0
    except (InputError, OSError) as err:
        alarm = (f"audit not trimmed, export failed: {err}; the audit stream is kept whole (audit_keep "
                 f"{cfg.audit_keep}) until an export succeeds")[:2000]
        log.error("alarm", round=rec.round, alarm=alarm)
        try:
            store.emit_event("alarm", round=rec.round, message=alarm)
            store.append_alarm(rec, actor=actor, reason=alarm, fence=fence, detail={"export": path, "error": str(err)})
        except Exception as err2:  # noqa: BLE001 - retention is housekeeping
            log.error("alarm not recorded", error=str(err2))
        return 0
    except Exception as err:  # noqa: BLE001 - retention is housekeeping
        log.error("audit trim failed", error=str(err))
        return 0
    if trimmed:
        store.emit_event("audit_trimmed", round=rec.round, records=trimmed, export=path)
    return trimmed


class WeightsWatchdog:
    """Nothing waits forever on one rank: a weight clear / update whose switch step is not fixed
    ``deadlines.weights_ms`` after this coordinator first saw it pending is **cancelled**
    (:meth:`fdeplb.store.Store.cancel_weights`, refused atomically if the switch step got fixed meanwhile), with an
    audited reason naming the ranks whose workers never armed for it at a safe point (a worker that stopped calling
    ``at_safe_point``, or never calls it; :func:`~fdeplb.rounds.reasons.weights_cancelled`). No rank has
    applied it, so every rank returns to the weight state it came from through the WEIGHTS table's ``cancel``
    transitions: the rank agents fire theirs when they see the withdrawal, and this fires those left (a rank whose
    agent is gone), so a new request can be made at once.

    A request some rank carried out without a switch step (threaded agents apply at once) cannot be cancelled: it
    then raises an audited alarm naming the ranks (once per request), as before. Timed on the local monotonic
    clock; its memory is this coordinator's (a new leader starts timing afresh)."""

    def __init__(self, store: Store, holder: str, log: Any) -> None:
        self.store = store
        self.holder = holder
        self.log = log
        self._seen: tuple[int, float, bool] | None = None  # (request, monotonic first seen, alarm raised)

    def watch(self, rec: ClusterRecord, cfg: ClusterConfig, fence: str) -> None:
        """Look at the cluster record ``rec`` (read in FREE); cancel (or raise the alarm) with ``fence`` once due."""
        n = rec.weights_request
        if n > 0 and rec.weights_cancelled == n:  # withdrawn: ranks left busy for it go back (idempotent)
            self._seen = None
            self.revert(n)
            return
        if n <= 0 or rec.weights_switch_step:  # no request, or every rank armed: the switch step is fixed
            self._seen = None
            return
        now = time.monotonic()
        if self._seen is None or self._seen[0] != n:
            self._seen = (n, now, False)
            return
        _, since, alarmed = self._seen
        if alarmed or now - since < cfg.deadlines.weights_ms / 1000:
            return
        weights, ranks = self.store.read_each(WEIGHTS), self.store.read_each(RANK)
        members = set(self.store.restored_view().active())  # a rank that is not a member is not waited for
        pending = [r for r, w in enumerate(weights) if isinstance(w, WeightRecord) and r in members
                   and (w.request < n or w.state in _BUSY)]
        unarmed = [r for r in pending if not (isinstance(ranks[r], RankRecord) and ranks[r].armed == f"weights:{n}")]
        if not pending:  # carried out without a switch step (agents without safe points)
            self._seen = (n, since, True)
            return
        if not unarmed:
            return  # the last one armed just now: the switch step is being fixed
        why = reasons.weights_cancelled(rec.weights_action, n, unarmed, cfg.deadlines.weights_ms)
        outcome, info = self.store.cancel_weights(n, held_by=unarmed, reason=why.text, actor=self.holder,
                                                  fence=fence, detail=why.detail)
        if outcome == "cancelled":
            self.log.warning("weights cancelled", weights_request=n, ranks=unarmed, reason=why.text)
            self._seen = None
            self.revert(n)
            return
        if outcome != "applied":  # switched meanwhile (the last rank armed), superseded, or withdrawn already
            return
        reason = (f"weight {rec.weights_action} {n} not switched {cfg.deadlines.weights_ms} ms after it was "
                  f"requested: the workers of ranks {unarmed} never reached a safe point armed for it (they must "
                  f"call at_safe_point); ranks {pending} wait for them; not cancelled: {info}")
        self.log.error("alarm", weights_request=n, ranks=unarmed, alarm=reason)
        self.store.emit_event("alarm", message=reason)
        self.store.append_alarm(rec, actor=self.holder, reason=reason, fence=fence,
                                detail={"ranks": unarmed, "request": n})
        self._seen = (n, since, True)

    def revert(self, n: int) -> None:
        """Fire the ``cancel`` transition of every rank still CLEARING / UPDATING for withdrawn request ``n``
        (unfenced, like every weight-status commit; the ``withdrawn`` guard admits it only once the fenced
        withdrawal committed). A rank whose agent fires it first wins the race (the version check); this one's
        commit is then refused and skipped."""
        for r, w in enumerate(self.store.read_each(WEIGHTS)):
            if not (isinstance(w, WeightRecord) and w.request == n and w.state in _BUSY):
                continue
            trigger = WEIGHT_CANCELS.get(w.prior) if w.prior is not None else None
            if trigger is None:
                self.log.error("cannot cancel", ep_rank=r, state=w.state, prior=w.prior)
                continue
            try:
                why = reasons.request_cancelled(n)
                RecordHandle(self.store, WEIGHTS, r, actor=self.holder).fire(
                    trigger, record=w, reason=why.text, detail=why.detail, changes={"reason": ""})
            except StateError as err:  # the rank's agent fired it first, or the record moved on
                self.log.info("cancel skipped", ep_rank=r, error=str(err))


_BUSY = (WeightState.CLEARING, WeightState.UPDATING)
