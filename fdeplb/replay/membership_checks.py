"""The membership side of a replay: the cluster's membership generation and the routing of every
committed placement around EXCLUDED ranks, checked on a recording with no Redis.

- **Generations.** ``commit.lua`` writes into every transition's audit record the cluster generation as the commit
  leaves it; a membership transition (effect ``bump_generation``) raises it by exactly one. So a membership
  transition's record carries the generation in force + 1, every other transition's record the generation in force
  (one that carries an older one was made under a membership that had changed, which the commit script refuses),
  every membership transition carries one, and once a record carried one every later transition does.
- **Plans.** A plan line's ``generation`` (the one it was planned under) lies between the generation at its round's
  ``start`` and the one at its ``load``.
- **Routing.** A committed placement (the cluster's ``commit``, effect ``set_placement``) gives every logical
  expert a replica on a rank that is not EXCLUDED at the commit's generation, so that log2phy / logcnt as handed to
  the engine (:func:`fdeplb.placement.live_maps`) name no slot of an excluded rank.

Plans follow the audit records in a recording, so the plan and routing checks run once the whole file is read
(:meth:`Generations.finish`). :class:`~fdeplb.errors.ReplayError` names the record's line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from fdeplb.errors import RedundancyError, ReplayError
from fdeplb.machines.tables import MEMBERSHIP, Effect, MachineTable, MemberState, TransitionSpec
from fdeplb.placement import live_maps

if TYPE_CHECKING:
    from fdeplb.replay.recording_format import AuditLine

__all__ = ["Generations"]


@dataclass(frozen=True)
class _Commit:
    where: str
    plan_id: str
    excluded: tuple[int, ...]
    generation: int | None


@dataclass
class _Round:
    round: int
    start: int | None  # the generation at its start
    load: int | None = None  # at its load
    load_where: str = ""


class Generations:
    """The generation in force while a replay goes through the records, and what is checked once plans are read.

    ``start``: the header's ``start.generation`` (None: unknown until a record carries one, e.g. a recording
    written before it was exported)."""

    def __init__(self, start: int | None = None) -> None:
        self.current = start
        self.seen = False  # a transition carried a generation: every later one must
        self.commits: list[_Commit] = []
        self.rounds: dict[int, _Round] = {}

    def check(self, line: AuditLine, table: MachineTable, spec: TransitionSpec) -> None:
        """A transition's ``generation`` against the generation in force (see the module doc); moves it on."""
        rec = line.record
        text = rec.get("generation", "")
        what = f"{rec['key']} {rec['trigger']}"
        if text == "":
            if self.seen or table is MEMBERSHIP:
                raise ReplayError(f"{line.where}: {what} carries no generation (commit.lua writes the cluster's "
                                  f"generation into every transition record)")
            return
        if not (text.isascii() and text.isdigit()):
            raise ReplayError(f"{line.where}: {what} carries generation {text!r}, not a decimal integer")
        value = int(text)
        bump = spec.effect is Effect.BUMP_GENERATION
        if self.current is not None:
            want = self.current + 1 if bump else self.current
            if value != want and bump:
                raise ReplayError(f"{line.where}: membership {what} makes generation {value}, but the generation "
                                  f"in force is {self.current}: a membership change raises it by exactly one "
                                  f"(to {want})")
            if value != want:
                older = " (made under an older membership: commit.lua refuses that)" if value < want else ""
                raise ReplayError(f"{line.where}: {what} under generation {value}, but the generation in force is "
                                  f"{self.current}{older}")
        self.current, self.seen = value, True

    def started(self, round_: int) -> None:
        """A cluster ``start`` of round ``round_`` committed (after :meth:`check`)."""
        self.rounds[round_] = _Round(round_, self.current)

    def loaded(self, line: AuditLine, round_: int) -> None:
        """The cluster's ``load`` of round ``round_`` committed (after :meth:`check`)."""
        seen = self.rounds.setdefault(round_, _Round(round_, None))
        seen.load, seen.load_where = self.current, line.where

    def committed(self, line: AuditLine, plan_id: str, members: Mapping[int, str]) -> None:
        """The cluster's commit of ``plan_id`` (its placement in force from now on), with every rank's membership
        state as replayed (``members``: ep_rank -> state)."""
        excluded = tuple(sorted(r for r, st in members.items() if st == MemberState.EXCLUDED))
        self.commits.append(_Commit(line.where, plan_id, excluded, self.current))

    def finish(self, stored_plans: Mapping[str, Any], plan_generations: Mapping[str, tuple[int, int]],
               num_logical_experts: int, ep_size: int) -> None:
        """The checks that need the plans: every committed plan routes around its excluded ranks; every plan line
        that names its generation (``plan_generations``: plan_id -> (generation, line)) was planned between its
        round's start and load. A plan the recording does not hold (pruned) is not checked."""
        for commit in self.commits:
            plan = stored_plans.get(commit.plan_id)
            if not commit.excluded or plan is None:
                continue
            live = np.ones(ep_size, dtype=bool)
            live[list(commit.excluded)] = False
            try:
                log2phy, _ = live_maps(plan.new_phy2log, num_logical_experts, ep_size, live)
            except RedundancyError as err:
                (layer, expert), n = err.orphans[0], len(err.orphans)
                raise ReplayError(f"{commit.where}: the committed plan {commit.plan_id} (generation "
                                  f"{commit.generation}) routes to excluded ranks {list(commit.excluded)}: {n} "
                                  f"logical experts have no replica on another rank (first: layer {layer} expert "
                                  f"{expert}), so log2phy / logcnt would name a slot of an excluded rank") from None
            per_rank = plan.new_phy2log.shape[1] // ep_size
            named = {int(p) // per_rank for p in np.unique(log2phy) if p >= 0}
            if named & set(commit.excluded):  # live_maps' own promise, held to it here
                raise ReplayError(f"{commit.where}: log2phy of plan {commit.plan_id} names a slot of excluded "
                                  f"ranks {sorted(named & set(commit.excluded))}")
        for plan_id, (generation, line) in plan_generations.items():
            plan = stored_plans[plan_id]
            seen = self.rounds.get(plan.round)
            if seen is None or seen.start is None or seen.load is None:
                continue
            if not seen.start <= generation <= seen.load:
                raise ReplayError(f"line {line}: plan {plan_id} of round {plan.round} was planned under generation "
                                  f"{generation}, but its round started at generation {seen.start} and loaded it "
                                  f"at {seen.load} ({seen.load_where})")
