"""What a replay found: the report :func:`fdeplb.replay.replay` returns and the checks that follow fill in (the
final state of every record key, the plans and rounds seen, what the recording held), as plain dataclasses.

No I/O. A round's outcome is :func:`fdeplb.rounds.reasons.round_outcome` of its last cluster transition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np

from fdeplb.rounds.reasons import RoundOutcome, round_outcome

__all__ = ["ConfigNote", "KeyState", "LoadedPlan", "ReplayReport", "RoundSeen"]


@dataclass
class KeyState:
    """What the replay holds for one record key: its machine, state, FastDeploy code and version."""

    machine: str
    key: str
    state: str
    code: int
    version: int
    transitions: int = 0
    last_trigger: str = ""
    last_id: str = ""
    plan_id: str = ""


@dataclass(frozen=True)
class LoadedPlan:
    """A ``load`` transition seen by the replay: its plan, round, the plan committed before it, and its record."""

    where: str
    plan_id: str
    round: int
    previous_plan_id: str
    record: Mapping[str, Any] | None = None  # the load's audit record (its reason and detail: the gate's figures)


@dataclass
class RoundSeen:
    """One round as the replay saw it: its plan (if it got one), the placement it started from, and its last
    cluster transition (``last``, an audit record's fields as text, at line ``where``) so far."""

    round: int
    placement_plan: str
    members: tuple[int, ...] | None = None  # the ACTIVE members at its start, as replayed (None: rank count unknown)
    plan_id: str = ""
    committed: bool = False  # its plan became the current placement (the commit point passed)
    last: Mapping[str, Any] | None = None
    where: str = ""

    @property
    def end(self) -> RoundOutcome:
        """:func:`~fdeplb.rounds.reasons.round_outcome` of the round as far as the replay got."""
        return round_outcome(self.last)[0]

    @property
    def outcome(self) -> str:
        """``committed``, ``aborted`` or ``running``. Rearranged is committed, skipped (gated) and aborted are
        aborted; a round still running whose plan was committed (the recording, or ``--until``, stops between the
        commit and the release) is committed too: past the commit point it cannot abort, its placement is in
        force."""
        end = self.end
        if end is RoundOutcome.REARRANGED or (end is RoundOutcome.RUNNING and self.committed):
            return "committed"
        return "running" if end is RoundOutcome.RUNNING else "aborted"

    @property
    def reason(self) -> str:
        """The abort's reason as recorded (a gated round's starts ``gated: skipped:``); "" unless aborted."""
        return str(self.last.get("reason", "")) if self.outcome == "aborted" and self.last is not None else ""


class ConfigNote(NamedTuple):
    """A ``config_changed`` note as replayed: the cluster's round when it was made (the change applies from the
    next round), its ``detail.changes`` (``{name: [old, new]}``, deadlines as ``deadlines.<name>``), its line
    (``where``) and the configuration version it made (``detail.version``; 0 when it names none)."""

    round: int
    changes: dict[str, Any]
    where: str = ""
    version: int = 0


@dataclass
class ReplayReport:
    """Outcome of a replay: counts, the final state of every key, the plans to check and what the recording held."""

    records: int = 0
    transitions: int = 0
    skipped: int = 0
    config_changes: list[ConfigNote] = field(default_factory=list)
    """Every ``config_changed`` note, in order."""
    final: dict[str, KeyState] = field(default_factory=dict)
    plans: list[LoadedPlan] = field(default_factory=list)
    plans_checked: list[str] = field(default_factory=list)
    plans_unchecked: list[str] = field(default_factory=list)
    header: dict[str, Any] | None = None
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)
    source_loads: dict[int, np.ndarray] = field(default_factory=dict)
    """round -> its snapshot per source rank, int64 [L, ep_size, E], where the recording keeps it."""
    stored_plans: dict[str, Any] = field(default_factory=dict)
    rounds: list[RoundSeen] = field(default_factory=list)
    gates_checked: list[int] = field(default_factory=list)
    placement_plan: str = ""
    chained: int = 0
    chain: str = ""
    chain_id: str = ""  # stream id of the last chained record (its line in chain_where)
    chain_where: str = ""
    head: str = ""  # what check_head found against a live audit ("" when not checked)
    until: str | None = None
    audit: list[dict[str, Any]] = field(default_factory=list)
    cluster_round: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "transitions": self.transitions, "skipped": self.skipped,
                "final": {k: asdict(v) for k, v in self.final.items()},
                "plans": [p.plan_id for p in self.plans], "plans_checked": list(self.plans_checked),
                "plans_unchecked": list(self.plans_unchecked), "gates_checked": list(self.gates_checked),
                "chained": self.chained, "until": self.until, "head": self.head,
                "placement_plan": self.placement_plan}
