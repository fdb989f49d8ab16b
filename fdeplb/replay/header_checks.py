"""A recording's header checked against what its chained audit records attest (issue 34 item 8).

The header is written by the exporter and is not in the audit chain: an edit of its configuration breaks no chain.
Chaining it is not possible after the fact (the chain is computed by ``commit.lua`` when a record commits, and the
configuration's creation is not an audit record), so the replay instead checks every setting the records show, and
blames the header (``line 1:``) only after the records have verified (their chain, their transitions), so the
records are the trusted side. A forger who also edits and re-chains the records is caught only against a live audit
(``--redis-url``, :mod:`fdeplb.replay.anchor`), as for any record.

The header's ``config`` is the configuration at the end of the exported range (:func:`fdeplb.recording.
export_recording` undoes the notes after it; fdeplb before issue 34 wrote the configuration at the export, the same
for a whole-audit export). :func:`configs` walks the range's ``config_changed`` notes backwards from it to the
configuration where the range starts, and forwards to the one each round ran with (:meth:`ConfigTimeline.at`).
What is checked:

- :func:`check_settings` (after the machine replay): in a whole-audit export (``range.round`` null), each setting a
  note changed is the note's new value in the header unless a later note changed it again, and the header's
  ``version`` is the last note's, or 0 (what ``init-cluster`` writes) when the range has no note and starts at the
  stream's first record (its chain verified from ``""``) (a round's export by an older fdeplb may hold later
  settings: not checked); the header's ``topology`` and ``policy`` are its configuration's (the policy at the
  range's end); every plan line whose content hash is its plan_id (a chained fact) was made with the header's
  topology and with the policy in force for its round; every gated round's ``min_gain`` (``detail.gate``, or the
  text of a schema 1 record) is the one in force; a commit requested by an operator (a cordoned cluster's) is not
  in a range the header calls uncordoned throughout;
- :func:`check_passed_gates` (after the plans were recomputed): every round the gate let through gains more than
  the ``min_gain`` in force (its stored plan's figures, over its members as the gate took them).

Facts no record shows are not checked by the self-contained replay: the settings ``retain_rounds``,
``audit_keep``, the deadlines and the checkpoint, and the configuration's ``incarnation`` (no record or note
carries it), which :mod:`fdeplb.replay.anchor` compares with the live cluster's (``--redis-url``); the header's
``cluster``, which nothing checks (an audit record's ``key`` is ``cluster`` or ``rank:<r>``, without the cluster id,
the chain does not hash it, and a copy rebuilt by ``replay --into`` holds the same chain under another id); the
policy of a range that made no plan. Every failure is a :class:`~fdeplb.errors.ReplayError` starting ``line 1:``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from fdeplb.errors import InputError, ReplayError
from fdeplb.machines.tables import CLUSTER
from fdeplb.placement import plan_digest
from fdeplb.replay.report import ReplayReport
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import configured_topology, decide
from fdeplb.rounds.reasons import RoundOutcome, detail_of
from fdeplb.store import ClusterConfig

__all__ = ["ConfigTimeline", "check_passed_gates", "check_settings", "config_before", "configs", "with_flat"]

_SCHEMA1_MIN_GAIN = re.compile(r"<= min_gain ([-+0-9.eE]+)")


def with_flat(cfg: Any, flat: dict[str, Any], version: int | None = None) -> Any:
    """``cfg`` (a :class:`~fdeplb.store.records.ClusterConfig`) with ``flat`` settings (names as a
    ``config_changed`` note gives them: ``min_gain``, ``deadlines.commit_ms``...) and ``version`` (default: its
    version + 1). :class:`InputError` for a name or value no configuration takes."""
    plain = {k: v for k, v in flat.items() if not k.startswith("deadlines.")}
    deadlines = {k.removeprefix("deadlines."): v for k, v in flat.items() if k.startswith("deadlines.")}
    new = cfg.with_settings({**plain, **({"deadlines": deadlines} if deadlines else {})})
    return new if version is None else dataclasses.replace(new, version=version)


def config_before(config, later: list) -> Any:
    """``config`` (a :class:`~fdeplb.store.records.ClusterConfig`) with the ``config_changed`` notes among
    ``later`` (audit entries after the exported range) undone, last first: the configuration at the range's end."""
    for entry in reversed(later):
        if entry["trigger"] == "config_changed":
            try:
                detail = detail_of(entry) or {}
                version = int(detail.get("version", 0))
                config = with_flat(config, {k: v[0] for k, v in detail.get("changes", {}).items()},
                                   max(version - 1, 0) if version else config.version)
            except (ValueError, TypeError, IndexError, InputError) as exc:
                raise InputError(f"audit record {entry.id}: a config_changed note that cannot be undone ({exc}); "
                                 f"export the whole audit instead") from None
    return config


@dataclasses.dataclass(frozen=True)
class ConfigTimeline:
    """The configuration where the range starts (``start``) and the notes that changed it, in order."""

    start: Any
    notes: tuple

    def at(self, round_: int) -> Any:
        """The configuration round ``round_`` ran with: ``start`` changed by every note made before it started (a
        note carries the cluster's round when it was made; a change applies from the next round)."""
        cfg = self.start
        for note in self.notes:
            if note.round < round_:
                try:
                    cfg = with_flat(cfg, {k: v[1] for k, v in note.changes.items()})
                except InputError as exc:
                    raise ReplayError(f"{note.where}: config_changed gives no configuration: {exc}") from None
        return cfg


def configs(report: ReplayReport) -> ConfigTimeline:
    """The :class:`ConfigTimeline` of ``report`` (a replayed recording with a header): the header's configuration
    with the range's ``config_changed`` notes undone, last first. In a whole-audit export each undone setting must
    be the note's new value and the configuration's version the note's (a header that says otherwise was edited):
    :class:`ReplayError` ``line 1:`` naming the setting and the note."""
    header = report.header or {}
    cfg = ClusterConfig.from_json(header["config"])
    strict = (header.get("range") or {}).get("round") is None  # its end is the export's, for any fdeplb
    for note in reversed(report.config_changes):
        flat = cfg.flat_settings()
        for name, (old, new) in note.changes.items():
            if strict and flat.get(name) != new:
                raise ReplayError(f"line 1: the header's configuration has {name} {flat.get(name)!r}, but the "
                                  f"config_changed note at {note.where} set it to {new!r} and no later note changed "
                                  f"it (the header was edited)")
        if strict and cfg.version and note.version and cfg.version != note.version:
            raise ReplayError(f"line 1: the header's configuration is version {cfg.version}, but the config_changed "
                              f"note at {note.where} made version {note.version} and no later note changed it")
        try:
            cfg = with_flat(cfg, {k: v[0] for k, v in note.changes.items()},
                            max(note.version - 1, 0) if note.version else cfg.version)
        except InputError as exc:
            raise ReplayError(f"{note.where}: config_changed undoes to no configuration: {exc}") from None
    if strict and cfg.version and not report.config_changes and report.until is None and _from_stream_start(report):
        raise ReplayError(f"line 1: the header's configuration is version {cfg.version}, but the range starts at "
                          f"the cluster's first audit record (init-cluster writes version 0) and no config_changed "
                          f"note changed it since (the header was edited)")
    return ConfigTimeline(cfg, tuple(report.config_changes))


def _from_stream_start(report: ReplayReport) -> bool:
    """Whether the recording's records begin at the audit stream's first record: its header's start chain is ""
    and its first record carries a chain (verified from "" by the replay: a stream trimmed before it would not
    verify). A record without a chain (a stream older than the chain) cannot tell."""
    start = (report.header or {}).get("start") or {}
    return start.get("chain") == "" and bool(report.audit) and bool(report.audit[0].get("chain"))


def check_settings(report: ReplayReport) -> ConfigTimeline:
    """The header's settings against the records (see the module doc), after the machine replay; returns the
    timeline. Nothing to check without a header."""
    timeline = configs(report)
    header = report.header or {}
    topology = timeline.start.topology()
    if header.get("topology", topology) != topology:
        raise ReplayError(f"line 1: the header's topology {header['topology']} is not its configuration's "
                          f"{topology}")
    _check_plans_made_with(report, timeline)
    _check_gated_min_gain(report, timeline)
    _check_commit_requests(report, timeline)
    policy = ClusterConfig.from_json(header["config"]).policy  # at the range's end, as the exporter wrote both
    if header.get("policy", policy) != policy:
        raise ReplayError(f"line 1: the header's policy {header['policy']!r} is not its configuration's {policy!r} "
                          f"(the policy at the range's end)")
    return timeline


def _check_plans_made_with(report: ReplayReport, timeline: ConfigTimeline) -> None:
    """Every loaded plan whose content hash is its plan_id (chained in its ``load``): made with the header's
    topology (besides the round's own facts in it: its members, a re-route, a supplied placement) and the policy in
    force for its round."""
    for loaded in report.plans:
        plan = report.stored_plans.get(loaded.plan_id)
        if plan is None or not plan.policy or \
                plan_digest(plan.expert_load, plan.old_phy2log, plan.policy, plan.topology) != plan.plan_id:
            continue  # not stored, or not its own plan: check_plans names it at its load
        cfg = timeline.at(loaded.round)
        shape = configured_topology(plan.topology)
        if shape != cfg.topology():
            raise ReplayError(f"line 1: the header's topology {cfg.topology()}, but round {loaded.round}'s plan "
                              f"{plan.plan_id} (loaded at {loaded.where}) was made for {shape}")
        if plan.policy != cfg.policy:
            raise ReplayError(f"line 1: the header's configuration has policy {cfg.policy!r} for round "
                              f"{loaded.round}, but its plan {plan.plan_id} (loaded at {loaded.where}) was made "
                              f"with {plan.policy!r}")


def _check_gated_min_gain(report: ReplayReport, timeline: ConfigTimeline) -> None:
    """Every gated round's recorded ``min_gain`` (its abort's ``detail.gate``, or its schema 1 text) is the one
    in force for that round."""
    for seen in report.rounds:
        if seen.end is not RoundOutcome.SKIPPED:
            continue
        try:
            figures = reasons.gate_figures(seen.last or {})
        except ValueError:
            continue  # check_gates names the corrupt detail at its line
        if figures is not None:
            recorded = figures.get("min_gain")
        else:
            found = _SCHEMA1_MIN_GAIN.search(seen.reason)
            recorded = float(found[1]) if found else None
        in_force = timeline.at(seen.round).min_gain
        if recorded is not None and recorded != in_force:
            raise ReplayError(f"line 1: the header's configuration has min_gain {in_force} for round {seen.round}, "
                              f"but its gate (at {seen.where}) judged with min_gain {recorded}")


def _check_commit_requests(report: ReplayReport, timeline: ConfigTimeline) -> None:
    """A commit an operator requested needs a cordoned cluster (``Store.request_commit`` refuses otherwise): none
    while the header's configuration is uncordoned and no note of the range changed ``cordoned`` yet."""
    if timeline.start.cordoned:
        return
    for rec in report.audit:
        if rec.get("trigger") == "config_changed" and "cordoned" in (reasons.detail_of(rec) or {}).get("changes", {}):
            return
        if rec.get("machine") == CLUSTER.name and rec.get("trigger") == "commit":
            try:
                by = reasons.requested_by(rec)
            except ValueError:  # a detail that is not JSON: not an operator's request either
                continue
            if by is not None:
                raise ReplayError(f"line 1: the header's configuration is not cordoned, but the cluster commit "
                                  f"{rec.get('id', '')} of round {rec.get('round', '')} was requested by {by} (a "
                                  f"commit is requested of a cordoned cluster only)")


def check_passed_gates(report: ReplayReport, timeline: ConfigTimeline) -> None:
    """Every round the gate let through (a ``load`` that is neither a re-placement nor a membership round) goes on
    by the gate's rule under the ``min_gain`` in force (:attr:`fdeplb.rounds.gating.GateDecision.goes_on`): its
    stored plan's figures, over its members where its record names them (schema 3), else over every rank, with
    the cross-node fractions when it was planned from its load per source rank (a split the recording lacks: only
    a gain above ``min_gain`` is known to pass). Run after :func:`~fdeplb.replay.recompute.check_plans` (the plan's arrays are
    then the planner's)."""
    for loaded in report.plans:
        plan = report.stored_plans.get(loaded.plan_id)
        record = loaded.record or {}
        try:
            figures = reasons.gate_figures(record)
            if plan is None or reasons.is_replacement(record) or not _gated(report, loaded, plan, figures):
                continue
        except ValueError:
            continue  # check_gates names the corrupt detail at its line
        cfg = timeline.at(loaded.round)
        members = plan.live_ranks(cfg.ep_size) if figures is not None and "live_ranks" in figures else None
        split = report.source_loads.get(loaded.round) if "source_load" in plan.topology else None
        decision = decide(plan.expert_load, plan.old_phy2log, plan.new_phy2log, cfg, members, split)
        if decision.moved_experts and not decision.goes_on:
            if "source_load" in plan.topology and split is None:
                continue  # planned from a split the recording lacks: it may have gone on for locality
            raise ReplayError(f"line 1: the header's configuration has min_gain {cfg.min_gain} for round "
                              f"{loaded.round}, but the round went on (load at {loaded.where}) with a planned gain of "
                              f"{decision.gain:.4f} (balancedness {decision.balancedness_before:.4f} -> "
                              f"{decision.balancedness_after:.4f}), which that min_gain skips: "
                              f"{decision.why_skipped}")


def _gated(report: ReplayReport, loaded: Any, plan: Any, figures: dict | None) -> bool:
    """Whether the coordinator's gate judged this load: it carries the gate's figures (schema 3), or (before) its
    plan is routed over the same ranks as the placement it started from (not a membership round)."""
    if figures is not None:
        return True
    if int((report.header or {}).get("schema", 1)) >= 3:
        return False
    ep_size = int((report.header or {})["config"]["ep_size"])
    before = report.stored_plans.get(loaded.previous_plan_id)
    routed = before.live_ranks(ep_size) if before is not None else tuple(range(ep_size))
    return plan.live_ranks(ep_size) == routed

