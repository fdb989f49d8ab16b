"""The recording player's read model: the view of :mod:`fdeplb.ui.view_model` at every record of a recording
(``fdeplb audit --export``), and the replay's own verdict on each record.

Step ``s`` (0 <= s <= number of audit records) is the cluster after its first ``s`` audit records, folded from the
header's start state with :func:`fdeplb.replay.machine_replay.state_at` (the exporter's fold). The checks are the
self-contained ``fdeplb replay FILE``'s, run once when the file is opened: :func:`fdeplb.replay.replay`, then
:func:`~fdeplb.replay.check_plans` over the recording's plans and :func:`~fdeplb.replay.check_gates`. They stop at
the first failure (a :class:`~fdeplb.errors.ReplayError` naming its line), so each record is ``ok`` (checked and
consistent), ``failed`` (with the reason), or ``unchecked`` (after a failure of the machine replay, which cannot go
on past it). A failure the replay names at no audit record (the header's counts, a plan line) is the recording's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fdeplb.errors import InputError, ReplayError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, WEIGHTS
from fdeplb.recording import audit_dict
from fdeplb.replay import check_gates, check_plans, replay
from fdeplb.replay.start_state import NOT_TRANSITIONS, StartState, state_at
from fdeplb.replay.recompute import Recorded
from fdeplb.replay.recording_format import read_export
from fdeplb.rounds.reasons import detail_of
from fdeplb.store import AuditRecord, ClusterConfig
from fdeplb.ui.view_model import audit_rows, build_view, deadline_of

__all__ = ["PlayerModel"]

#: how a ReplayError names its line (:attr:`fdeplb.replay.recording_format.AuditLine.where`)
_WHERE = re.compile(r"^line (\d+)\b")


class PlayerModel:
    """One recording, opened once: its header, audit records, plans and the replay's verdict.

    Raises :class:`~fdeplb.errors.InputError` when the file cannot be read, :class:`ReplayError` when it does not
    parse as a recording or has no header (a header-less export cannot be laid out: no configuration)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        lines = list(read_export(self.path))
        headers = [ln for ln in lines if ln.type == "header"]
        if not headers:
            raise ReplayError(f"{self.path}: no header line (an export written before schema 1 cannot be played)")
        header = headers[0].value
        self.header = headers[0].record
        self.config = ClusterConfig.from_json(header.config)
        self.start = StartState(
            records={k: {"state": v.state, "version": v.version, "plan_id": v.plan_id}
                     for k, v in header.start.records.items()},
            chain=header.start.chain,
            placement_plan=header.start.placement.plan_id if header.start.placement is not None else "")
        audit = [ln for ln in lines if ln.type == "audit"]
        self.lines = [ln.line for ln in audit]
        self.records = [audit_dict(AuditRecord(str(ln.record.get("id", "")),
                                               {k: str(v) for k, v in ln.record.items() if k not in ("type", "id")}))
                        for ln in audit]
        self.plans = {ln.value.plan_id: ln.value for ln in lines if ln.type == "plan"}
        self.checks = self._check(lines)

    # ---- the replay's verdict ----------------------------------------------------------------------------------
    def _check(self, lines) -> dict[str, Any]:
        """``{"ok", "failure": None | {"step" (None: the recording's), "line", "reason"}, "unchecked_from"
        (step | None), "summary"}``: the self-contained replay's checks, as ``fdeplb replay FILE`` runs them."""
        phase = "replay"
        try:
            report = replay(lines)
            phase = "plans"
            check_plans(Recorded(report), report)
            check_gates(report)
        except ReplayError as err:
            reason = str(err)
            m = _WHERE.match(reason)
            line = int(m.group(1)) if m else None
            step = self.lines.index(line) + 1 if line in self.lines else None
            unchecked = step + 1 if phase == "replay" and step is not None else None
            return {"ok": False, "failure": {"step": step, "line": line, "reason": reason},
                    "unchecked_from": unchecked, "summary": f"replay FAILED: {reason}"}
        return {"ok": True, "failure": None, "unchecked_from": None,
                "summary": f"replay OK: {report.transitions} transitions, {report.skipped} notes, "
                           f"{len(report.plans_checked)} plans recomputed, chain verified over {report.chained} "
                           f"records"}

    def check_of(self, step: int) -> dict[str, str]:
        """The verdict on record ``step`` (1-based): ``{"check": "ok" | "failed" | "unchecked", "reason"}``."""
        failure, unchecked = self.checks["failure"], self.checks["unchecked_from"]
        if failure is not None and failure["step"] == step:
            return {"check": "failed", "reason": failure["reason"]}
        if unchecked is not None and step >= unchecked:
            return {"check": "unchecked", "reason": "not checked: the replay stops at its first failure"}
        return {"check": "ok", "reason": ""}

    # ---- views ------------------------------------------------------------------------------------------------
    def step_of(self, text: str | None) -> int:
        """A ``step`` query parameter (decimal text, 0 .. number of records; absent: the last step);
        :class:`InputError` for anything else."""
        n = len(self.records)
        if text is None or text == "":
            return n
        if not re.fullmatch(r"[0-9]{1,9}", text) or int(text) > n:
            raise InputError(f"step must be an integer in [0, {n}], got {text[:40]!r}")
        return int(text)

    def view(self, step_text: str | None = None) -> dict[str, Any]:
        """The view dict (:mod:`fdeplb.ui.view_model`) at step ``step_text`` with ``player``: ``{"file", "step",
        "steps", "record" (the record at the step, with its check, None at step 0), "checks", "failed_steps"}``."""
        step = self.step_of(step_text)
        seen = self.records[:step]
        fold = state_at(seen, self.config.ep_size, self.start)
        cluster = fold.records.get(CLUSTER.name, {"state": CLUSTER.initial.value, "version": 0, "plan_id": ""})
        last_cluster = next((r for r in reversed(seen) if r.get("machine") == CLUSTER.name), None)
        now = int(seen[-1].get("ts_ms", 0)) if seen else int(self.records[0].get("ts_ms", 0)) if self.records else 0
        since = next((int(r.get("ts_ms", 0)) for r in reversed(seen) if r.get("machine") == CLUSTER.name
                      and r.get("trigger") not in NOT_TRANSITIONS), None)
        limit = deadline_of(cluster["state"], self.config)
        summary = {"state": cluster["state"], "version": cluster["version"], "plan_id": cluster["plan_id"],
                   "round": int(last_cluster.get("round", 0)) if last_cluster else 0,
                   "deadline_left_ms": since + limit - now if limit and since is not None else None,
                   "reason": last_cluster.get("reason", "") if last_cluster else "",
                   "alarm": last_cluster.get("reason", "") if last_cluster and last_cluster.get("trigger") == "alarm"
                   else "", "generation": None, "lease_holder": last_cluster.get("actor") if last_cluster else None,
                   "placement_plan_id": fold.placement_plan, "cordoned": self._cordoned_at(step)}
        ranks = []
        for r in range(self.config.ep_size):
            def state(table, r=r):
                return fold.records.get(f"{table.key_label}:{r}", {}).get("state", table.initial.value)
            ranks.append({"ep_rank": r, "state": state(RANK), "weights": state(WEIGHTS),
                          "membership": state(MEMBERSHIP), "stale": None, "registered": None,
                          "heartbeat_age_ms": None, "heartbeat_ttl_ms": None, "step": None, "staged_bytes": None,
                          "reason": "", "routing": None})
        loads = [r for r in seen if r.get("machine") == CLUSTER.name and r.get("trigger") == "load"]
        plan_id = loads[-1].get("plan_id") if loads else fold.placement_plan
        out = build_view(mode="player", cluster=str(self.header.get("cluster", "")), summary=summary, ranks=ranks,
                         records=seen, config=self.config, now_ms=now, plan=self.plans.get(plan_id or ""))
        record = {**seen[-1], "step": step, **self.check_of(step)} if seen else None
        failed = [self.checks["failure"]["step"]] if self.checks["failure"] and self.checks["failure"]["step"] else []
        out["player"] = {"file": self.path.name, "step": step, "steps": len(self.records), "record": record,
                         "checks": self.checks, "failed_steps": failed}
        return out

    def _cordoned_at(self, step: int) -> bool:
        """Whether the cluster was cordoned after record ``step``: the header's setting (the range's end) with
        every ``config_changed`` note of ``cordoned`` after the step undone."""

        cordoned = self.config.cordoned
        for rec in reversed(self.records[step:]):
            if rec.get("trigger") == "config_changed":
                try:
                    change = (detail_of(rec) or {}).get("changes", {}).get("cordoned")
                except ValueError:  # the replay's checks name it
                    change = None
                if isinstance(change, list) and len(change) == 2:
                    cordoned = bool(change[0])
        return cordoned

    def audit(self, **filters: str | None) -> list[dict[str, Any]]:
        """Every record of the recording as an audit-table row (``step`` and its check added), filtered by
        :func:`fdeplb.ui.view_model.audit_rows`."""
        rows = [{**rec, "step": i, **self.check_of(i)} for i, rec in enumerate(self.records, start=1)]
        return audit_rows(rows, **filters)
