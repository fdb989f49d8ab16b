"""The rank's swap in SWAPPING: a committed plan swapped into the live experts at the safe point the ranks fix
together (whole, or one chunk of layers per safe point within the pause budget), restored from the checkpoint when
it fails, reported in the rank record (with the pause and the probe); or, when the round ended without this rank,
the catch-up to the cluster's current placement.

:class:`SwapDriver` is mixed into :class:`~fdeplb.orchestration.agent.RankAgent`, whose entry-work table runs
:meth:`SwapDriver._on_swapping` in SWAPPING and :meth:`SwapDriver._on_swapped` in SWAPPED. It uses, of its host:
``store``, ``ep_rank``, ``log``, ``config``, ``backend``, ``rank`` (record handle), ``switch``
(:class:`~fdeplb.orchestration.safe_points.SafePointSwitch`), ``live_ranks`` / ``live_plan_id`` (set here),
``verify_all``, ``staged``, ``_swap_attempts``, ``_outbox``, and its ``_stage``, ``_drop_staging``,
``_new_phy2log``, ``_probe_run``, ``_probe_report``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdeplb.errors import VerificationError, WeightError
from fdeplb.machines.tables import ClusterState
from fdeplb.orchestration.probe import ProbeResult
from fdeplb.orchestration.safe_points import Arm, Chunked
from fdeplb.placement import routing_digest
from fdeplb.rounds.members import participants
from fdeplb.store import ClusterRecord, RankRecord
from fdeplb.weights.backend import Staged
from fdeplb.weights.plan import changed_layers
from fdeplb.weights.reports import SwapReport


class SwapDriver:
    """A committed swap at the safe point, its restore on failure, its report; the catch-up of a rank the round
    ended without; the wait for the round's release once swapped."""

    def _on_swapping(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        plan_id = me.plan_id
        if not (cluster.state is ClusterState.SWAPPING and cluster.plan_id == plan_id):
            # the round is over without this rank (lost mid-swap, excluded, back): hold the current placement,
            # routed over the ranks it names. Never the cluster record's members then: they are another round's
            # (an aborted membership round's, say), and routing over them can leave a replica-less expert
            return self._catch_up(me, self.store.current_placement())
        new = self._new_phy2log(plan_id)
        report: dict[str, Any] = ProbeResult().fields()  # no swap here: no probe (none reported from an older one)
        pending = self.switch.op is not None and self.switch.op.key[:2] == ("swap", plan_id)  # applied, not yet reported
        members = tuple(participants(cluster.members, self.config.ep_size))
        # a plan that moves nothing still switches the routing when the members changed (a rank left or rejoined)
        if pending or not np.array_equal(self.backend.phy2log, new) or members != self.live_ranks:
            attempt = self._swap_attempts.get(plan_id, 1)
            try:
                info = self._stage(plan_id)
            except WeightError as err:  # past the commit point: report and retry on the next wake-up
                self.log.error("staging failed after the commit point", error=str(err))
                self.rank.update(reason=f"staging failed after commit: {err}")
                self.store.emit_event("alarm", rank=self.ep_rank, message=f"staging failed: {err}")
                return False
            staged = self.staged.staged
            when: Arm | int = 0  # a retry after a failed verification: at the next safe point
            if attempt == 1 and cluster.state is ClusterState.SWAPPING and cluster.plan_id == plan_id:
                when = Arm(f"swap:{cluster.round}:{plan_id}", "switch_step",
                            {"state": ClusterState.SWAPPING, "round": cluster.round, "plan_id": plan_id})
            chunked = None
            if self.switch.safe_points and members == tuple(self.live_ranks):  # a change of members switches at once
                chunked = Chunked(getattr(staged, "starts", ()), changed_layers(self.backend.phy2log, new),
                                  lambda layers: self.backend.prepare(staged, new, layers),
                                  lambda layers: self._swap_or_restore(staged, new, None, layers))
            op = self.switch.schedule(("swap", plan_id, attempt), when,
                                     lambda: self._swap_or_restore(staged, new, members), chunked, self._probe_run())
            if op is None or op.gone:
                return False  # waits for the worker's safe point (a gone op is re-armed on the next wake-up)
            report.update(self.switch.applied_fields(op, cluster, f"plan {plan_id}"))
            if isinstance(op.error, VerificationError):
                # past the commit point: no abort. The swap restored the old placement from the checkpoint; stage
                # again from disk and retry once; then stay SWAPPING and let the deadline raise the alarm.
                self.log.error("swap verification failed", attempt=attempt, error=str(op.error))
                self.store.emit_event("alarm", rank=self.ep_rank, message=f"swap verification failed: {op.error}")
                self._drop_staging()
                self._swap_attempts[plan_id] = attempt + 1
                if attempt >= 2:
                    self.rank.update(reason=f"swap verification failed twice: {op.error}", **report)
                    return False
                return True
            if op.error is not None:
                self._drop_staging()
                raise op.error
            report.update(self._probe_report(op.probe))
            swaps: list[SwapReport] = op.result if isinstance(op.result, list) else [op.result]
            report.update(info)  # the staging's counts: the swap carried out the same transfer
            report.update(snapshots=sum(r.snapshots for r in swaps),
                          bytes_from_staging=sum(r.bytes_from_staging for r in swaps),
                          bytes_local=sum(r.bytes_local for r in swaps), **self.switch.pause_fields(op))
            self._drop_staging()
        total = self.backend.slots_total
        if self.verify_all:
            verified, total = self.backend.verify()
        else:  # swap() verified every changed slot; the kept ones were verified when they were written
            verified = total
        self.live_plan_id = plan_id
        self._swap_attempts.pop(plan_id, None)
        report.update({"slots_verified": verified, "slots_total": total, "live_plan_id": plan_id,
                       "verified_all": int(self.verify_all), "routing_digest": routing_digest(self.backend.phy2log)})
        if verified != total:
            self.log.error("verification failed", verified=verified, total=total)
            report["reason"] = f"{total - verified} of {total} slots do not match the checkpoint"
            self.rank.update(**report)
            self.store.emit_event("alarm", rank=self.ep_rank, message=report["reason"])
            return False
        self.rank.fire("swapped", record=me, changes=report, defer=self._outbox)  # next: the round's release
        return False

    def _catch_up(self, me: RankRecord, current: Any) -> bool:
        """The round this rank was SWAPPING in is over without it (the rank was lost mid-swap, the round
        completed among the members, the rank was excluded and came back; its experts re-placed in a later
        placement, or not when that failed closed): hold the current placement, its plan or a later one (reloaded
        from the checkpoint at a safe point when the live slots hold another one, routed over the placement's
        members) and leave SWAPPING; never swap to the old round's plan."""
        members = current.live_ranks(self.config.ep_size)
        if not np.array_equal(self.backend.phy2log, current.phy2log) or members != self.live_ranks:
            def reload() -> None:
                self.backend.reload_in(current.phy2log)
                self.backend.set_live_ranks(members)
                self.live_ranks = members

            op = self.switch.schedule(("catch_up", current.plan_id), 0, reload)
            if op is None:
                return False  # at the worker's next safe point
            self.switch.op = None
            if op.error is not None:
                raise op.error
        self.log.warning("round over without this rank: holds the current placement", stale_plan=me.plan_id,
                         plan_id=current.plan_id)
        self.live_plan_id = current.plan_id
        self.rank.fire("swapped", record=me, defer=self._outbox,
                       changes={"live_plan_id": current.plan_id, "routing_digest": routing_digest(self.backend.phy2log),
                                "reason": f"round of plan {me.plan_id} ended without this rank; holds {current.plan_id or 'initial'}"})
        return False

    def _swap_or_restore(self, staged: Staged, new: np.ndarray, members: tuple[int, ...] | None = None,
                         layers: tuple[int, ...] | None = None) -> SwapReport:
        """Swap in place (at the safe point; only the chunk ``layers`` when given) and take the round's
        ``members`` as :attr:`live_ranks`. When the swap raises (a failed verification, or anything else once
        writing may have begun: a device error, out of memory in a snapshot, a copy thread), rewrite the live
        placement (the old one, for the layers of the failed chunk) from the source of truth before re-raising,
        so the rank keeps serving it (and its members) consistently; a reload that fails too is logged and the
        swap's own error raised."""
        try:
            if layers is None:  # the whole swap, the routing over the round's members
                report = self.backend.swap(staged, new, members)
            else:  # a chunk: its layers' rows, over the members routed to already (a change of members is whole)
                report = self.backend.swap_layers(staged, new, layers)
            if members is not None:
                self.live_ranks = members
            return report
        except Exception as err:
            try:
                self.backend.reload()
            except Exception as reload_err:  # noqa: BLE001 - the swap's error is the one reported
                self.log.error("reload after a failed swap failed", error=str(reload_err), swap_error=str(err))
            raise

    def _on_swapped(self, me: RankRecord, cluster: ClusterRecord) -> bool:
        if cluster.state is ClusterState.SWAPPING and cluster.plan_id == me.plan_id:
            return False  # the other ranks are still swapping (the round's release wakes this rank)
        self.rank.fire("finish", record=me, defer=self._outbox)  # next work: the next round's LOADING
        return False
