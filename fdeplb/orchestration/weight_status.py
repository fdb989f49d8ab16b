"""The weight-status driver: carries the cluster's dynamic weight clear / update requests through one rank's WEIGHTS
machine (FastDeploy's ``clear_load_weight`` / ``update_weights``), switched at a safe point like a swap.

:class:`WeightStatusDriver` is mixed into :class:`~fdeplb.orchestration.agent.RankAgent`; the agent's reconcile
step calls :meth:`WeightStatusDriver._weights_step` before its rank-state entry work.
"""

from __future__ import annotations

from typing import Any

from fdeplb.errors import VerificationError
from fdeplb.machines.tables import WEIGHT_CANCELS, WEIGHTS, ClusterState, WeightState
from fdeplb.orchestration.safe_points import Arm, SafePointSwitch
from fdeplb.rounds import reasons
from fdeplb.store import ClusterRecord, WeightRecord


class WeightStatusDriver:
    """Drives the rank's weight-status record (WEIGHTS machine) from the cluster's latest weight request.

    It uses, of its host: ``store``, ``ep_rank``, ``log``, ``backend`` (``clear``, ``reload_in``), the record
    handles ``rank`` and ``weights``, and sets ``live_plan_id`` after an update; the safe-point scheduling is
    its ``switch`` (:class:`~fdeplb.orchestration.safe_points.SafePointSwitch`).
    """

    rank: Any
    weights: Any
    switch: SafePointSwitch
    live_plan_id: str | None

    def _weights_step(self, cluster: ClusterRecord, w: WeightRecord) -> bool:
        """Carry out the cluster's latest weight request through this rank's weight-status machine: the transition
        into CLEARING / UPDATING is committed first (its guards: no clear or update while a round is past FREE),
        the work runs at the safe point of the request's switch step, the outcome is committed after
        (``cleared``, ``updated``, or ``update_failed`` with the reason: never NORMAL with wrong weights). True if
        the caller should look again without waiting (then the rank-state entry work waits for the next step).

        Two phases: every rank first commits its transition (or finds nothing to do: clear while CLEARED) and arms
        for request n (``weights:<n>``); the request's switch step is fixed once all are armed, and all switch at
        it (:meth:`~fdeplb.orchestration.safe_points.SafePointSwitch.at_safe_point`). Requests are carried out one at a
        time (:meth:`fdeplb.store.Store.request_weights` refuses a new one while a rank is CLEARING or UPDATING).
        A request that still overtakes one (written between this rank's read of request n and its commit of the
        transition for n) finds this rank's pending work re-armed for the new request: the ranks still switch at
        one step, but this rank then carries out the new request on its own, past that step, which raises the
        late-switch alarm (``at_safe_point``, point 3). A request withdrawn before its switch step was fixed (the
        coordinator's cancel after ``deadlines.weights_ms``, :class:`~fdeplb.orchestration.housekeeping.WeightsWatchdog`)
        is never applied: a rank CLEARING / UPDATING for it fires its ``cancel`` transition, a rank that had not
        begun it leaves it. ``w``: this rank's weight-status record as read."""
        n = cluster.weights_request
        arm = Arm(f"weights:{n}", "weights_switch_step", {"weights_request": n}, {"weights_cancelled": n})
        busy = w.state in (WeightState.CLEARING, WeightState.UPDATING)
        if busy and cluster.weights_cancelled == w.request:
            return self._weights_cancel(cluster, w)
        if w.state is WeightState.CLEARING:
            return self._weights_clearing(cluster, w, arm)
        if w.state is WeightState.UPDATING:
            return self._weights_updating(cluster, w, arm)
        if w.request >= n:
            return False
        if cluster.weights_cancelled == n:  # withdrawn before this rank began it: nothing to undo
            self._drop_weights_op(n)
            return False
        action = cluster.weights_action
        if action not in ("clear", "update"):
            self.store.update(WEIGHTS, self.ep_rank, request=n, reason=f"unknown weight action {action!r}")
            return True
        if cluster.state is not ClusterState.FREE:
            return False  # the guards refuse while a round runs: wait for FREE (no retry storm)
        if action == "clear" and w.state is WeightState.CLEARED:  # nothing to free; arms all the same
            op = self.switch.schedule(("nothing", n), arm, lambda: None)
            if op is None:
                return False
            self.switch.op = None  # applied, or gone (superseded: nothing was to be done anyway)
            self.store.update(WEIGHTS, self.ep_rank, request=n)
            return True
        self.weights.fire(action, record=w, reason=cluster.weights_reason, detail=reasons.weight_request(n),
                          changes={"request": n, "reason": "", "prior": w.state, "at_switch": int(self.switch.safe_points)})
        return True

    def _weights_cancel(self, cluster: ClusterRecord, w: WeightRecord) -> bool:
        """The rank's request was withdrawn (:meth:`fdeplb.store.Store.cancel_weights`) before its switch step was
        fixed, so this rank never applied it: drop the pending work and fire the table's cancel transition back to
        the state the request came from (``prior``). The coordinator fires it too for a rank whose agent is gone;
        whoever commits first wins (the version check), the other's commit is refused and retried as a no-op."""
        self._drop_weights_op(w.request)
        trigger = WEIGHT_CANCELS.get(w.prior) if w.prior is not None else None
        if trigger is None:  # a record written before prior existed: leave it to the operator, say so once
            self.log.error("cannot cancel the weight request", request=w.request, state=w.state)
            return False
        self.log.warning("weight request cancelled", request=w.request, reason=cluster.weights_cancel_reason)
        why = reasons.request_cancelled(w.request)
        self.weights.fire(trigger, record=w, reason=why.text, detail=why.detail, changes={"reason": ""})
        return True

    def _drop_weights_op(self, n: int) -> None:
        """Forget the pending safe-point work of weight request ``n`` (it can never switch: withdrawn)."""
        op = self.switch.op
        if op is not None and op.key[0] in ("clear", "update", "nothing") and op.key[1] == n \
                and not op.done.is_set():
            op.gone = True
            op.done.set()
            self.switch.op = None

    def _weights_clearing(self, cluster: ClusterRecord, w: WeightRecord, arm: Arm) -> bool:
        """CLEARING: free the live slots at the switch step, then commit ``cleared``."""
        op = self.switch.schedule(("clear", w.request), arm, self.backend.clear)
        if op is None or op.gone:
            return False
        if op.error is not None:  # freeing memory does not fail; if it did, say so and stay CLEARING
            self.switch.op = None
            self.store.emit_event("alarm", rank=self.ep_rank, message=f"weight clear failed: {op.error}")
            self.store.update(WEIGHTS, self.ep_rank, reason=f"clear failed: {op.error}")
            return False
        # the rank's report first: whoever sees CLEARED sees when it was applied
        self.rank.update(**self.switch.applied_fields(op, cluster, f"weight clear {w.request}"))
        self.weights.fire("cleared", record=w, changes={"reason": ""})
        return True

    def _weights_updating(self, cluster: ClusterRecord, w: WeightRecord, arm: Arm) -> bool:
        """UPDATING: reload every slot in the cluster's current placement at the switch step and verify it, then
        commit ``updated`` or ``update_failed`` (with the reason and an alarm)."""
        placement = self.store.current_placement()  # the cluster's CURRENT placement (vLLM PR #55228)
        op = self.switch.schedule(("update", w.request), arm, lambda: self.backend.reload_in(placement.phy2log))
        if op is None or op.gone:
            return False
        applied = self.switch.applied_fields(op, cluster, f"weight update {w.request}")
        err = op.error
        if err is None and op.result.verified != op.result.total:
            err = VerificationError(f"{op.result.total - op.result.verified} of {op.result.total} slots differ "
                                    "from the checkpoint after the update")
        if err is None:
            applied["live_plan_id"] = placement.plan_id
        self.rank.update(**applied)  # the rank's report first: whoever sees the outcome sees when it applied
        if err is not None:
            reason = f"update failed: {err}"
            self.log.error("weight update failed", error=str(err))
            self.store.emit_event("alarm", rank=self.ep_rank, message=reason)
            self.weights.fire("update_failed", record=w, reason=reason, changes={"reason": reason})
        else:
            self.live_plan_id = placement.plan_id
            self.weights.fire("updated", record=w, plan_id=placement.plan_id,
                              changes={"plan_id": placement.plan_id, "reason": ""})
        return True
