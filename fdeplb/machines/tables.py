"""The four state-machine tables of fdeplb, declared as data (no I/O).

Each :class:`MachineTable` is one diagram in ``statecharts/``: its states, the FastDeploy integer code of each state
(both ways, in one place), and its transitions with the guards that span records. The guards are *names*; the store
turns each name into the keys and checks of the commit script (see ``fdeplb/store/lua/commit.lua``), so a guard is
always evaluated in the same atomic step as the write it protects.

FastDeploy codes (``fastdeploy/eplb``): rearrange status FREE=0, DOING=1, LOAD_SUCC=2, DONE=3; per-rank load result
0 (not yet) / 1 (success) / -1 (failed); dynamic weight status NORMAL=0, UPDATING=1, CLEARING=-1, CLEARED=-2.
FastDeploy has no membership: the codes of :data:`MEMBERSHIP` are fdeplb's own (ACTIVE 0, SUSPECT 1, DRAINING 2,
REJOINING 3, EXCLUDED -1: negative for "not a member", as FastDeploy's failed / cleared codes are).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Callable, Mapping, TypeVar

from fdeplb.errors import IllegalTransitionError, InputError


class StateEnum(str, Enum):
    """Base of the machines' state enums: a member *is* its name as stored in Redis (``str`` subclass), and
    formats as that name (``f"{ClusterState.FREE}"`` is ``FREE``)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class ClusterState(StateEnum):
    """States of the cluster rearrangement machine (FastDeploy ``rearrange_experts_status`` in :data:`CLUSTER`)."""

    FREE = "FREE"
    COLLECTING = "COLLECTING"
    PLANNING = "PLANNING"
    LOADING = "LOADING"
    LOAD_SUCC = "LOAD_SUCC"
    SWAPPING = "SWAPPING"
    DONE = "DONE"


class RankState(StateEnum):
    """States of one EP rank's machine (FastDeploy per-rank load result in :data:`RANK`)."""

    IDLE = "IDLE"
    LOADING = "LOADING"
    LOADED = "LOADED"
    LOAD_FAILED = "LOAD_FAILED"
    SWAPPING = "SWAPPING"
    SWAPPED = "SWAPPED"


class WeightState(StateEnum):
    """States of one rank's weight-status machine (FastDeploy ``dynamic_weight_status`` in :data:`WEIGHTS`)."""

    NORMAL = "NORMAL"
    UPDATING = "UPDATING"
    CLEARING = "CLEARING"
    CLEARED = "CLEARED"


class MemberState(StateEnum):
    """States of one EP rank's membership (:data:`MEMBERSHIP`; what elastic EP engines call the active-rank mask)."""

    ACTIVE = "ACTIVE"
    SUSPECT = "SUSPECT"
    DRAINING = "DRAINING"
    EXCLUDED = "EXCLUDED"
    REJOINING = "REJOINING"


class GuardKind(StateEnum):
    """Kinds of cross-record checks; ``fdeplb/store/lua/commit.lua`` implements each (same names)."""

    RANKS_IN = "ranks_in"  #: every rank record is in ``state`` (``same_plan``: and carries the caller's plan_id)
    WEIGHTS_IN = "weights_in"  #: every rank's weight-status record is in ``state``
    CLUSTER_IN = "cluster_in"  #: the cluster record is in one of ``states`` (``same_plan``: with the plan_id)
    PLAN_STORED = "plan_stored"  #: the plan named by the transition's plan_id is stored
    PLAN_NOT_CURRENT = "plan_not_current"  #: the caller's plan_id is not the current placement's
    #: the cluster record withdrew (cancelled) the weight request this weight-status record carries out
    #: (``weights_cancelled`` equals the record's ``request``) and the record came from ``state`` (its ``prior``)
    WITHDRAWN = "withdrawn"

    @property
    def per_rank(self) -> bool:
        """True for the kinds that read one record per EP rank (their keys are passed to the script)."""
        return self in (GuardKind.RANKS_IN, GuardKind.WEIGHTS_IN)


class Effect(StateEnum):
    """Extra writes a transition makes in its commit step; ``commit.lua`` implements each (same names)."""

    NONE = ""
    SET_PLACEMENT = "set_placement"  #: the plan's new phy2log becomes the cluster's current placement
    BUMP_GENERATION = "bump_generation"  #: the cluster's membership ``generation`` goes up by one (a member change)


@dataclass(frozen=True)
class Guard:
    """A check across records, evaluated inside the commit script (see :class:`GuardKind` for each kind)."""

    kind: GuardKind
    state: StateEnum | None = None
    states: tuple[StateEnum, ...] = ()
    same_plan: bool = False

    def label(self) -> str:
        target = self.state.value if self.state else "|".join(s.value for s in self.states)
        plan = ", same plan" if self.same_plan else ""
        return f"{self.kind}({target}{plan})" if target else self.kind


@dataclass(frozen=True)
class TransitionSpec:
    """One row of a table: ``trigger`` moves any of ``sources`` to ``dest`` if every guard holds."""

    trigger: str
    sources: tuple[StateEnum, ...]
    dest: StateEnum
    guards: tuple[Guard, ...] = ()
    effect: Effect = Effect.NONE  # extra write in the same atomic step
    doc: str = ""
    #: the commit also appends to the cluster's signal stream, waking every rank agent: set on the cluster
    #: transitions into a state where a rank has work (publish its load, stage, swap, drop a staging, finish the
    #: round once it is released, carry out a weight request waiting for FREE); "plan", "loaded" and "swapped"
    #: wake no rank (a SWAPPED rank finishes at "release": one wake-up per rank per round less)
    wakes_ranks: bool = False
    #: fired by an operator's command (``fdeplb round abort``, the API's ``/v1/round/abort``), unfenced: it needs no
    #: coordinator, and the record's expected state and version (checked in the commit step) order it against the
    #: coordinator's fenced commits; its audit record names the operator as the actor
    by_operator: bool = False


@dataclass(frozen=True, eq=False)  # one object per machine: compared and hashed by identity
class MachineTable:
    """A state machine as data: states, their FastDeploy codes, transitions.

    ``code_name`` names the FastDeploy field the codes belong to. ``from_code`` maps a code back to the canonical
    (first-listed) state of that code, since several fdeplb states share one FastDeploy code.
    """

    name: str
    code_name: str
    state_type: type[StateEnum]
    codes: dict[StateEnum, int]
    initial: StateEnum
    transitions: tuple[TransitionSpec, ...]
    doc: str = ""
    #: the prefix of a per-rank record's audit key (``<label>:<ep_rank>``); "" = the table's name
    label: str = ""
    _by_key: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for spec in self.transitions:
            for src in spec.sources:
                key = (src, spec.trigger)
                if key in self._by_key:
                    raise ValueError(f"{self.name}: trigger {spec.trigger!r} defined twice from {src}")
                self._by_key[key] = spec
        missing = set(self.states) - set(self.codes)
        strays = [s for spec in self.transitions for s in (*spec.sources, spec.dest) if s not in self.states]
        if strays:
            raise ValueError(f"{self.name}: transitions name states of another machine: {strays}")
        if missing:
            raise ValueError(f"{self.name}: states without a FastDeploy code: {sorted(missing)}")

    @property
    def key_label(self) -> str:
        """The prefix of this table's per-rank audit keys (``rank:3``, ``member:3``)."""
        return self.label or self.name

    @property
    def states(self) -> tuple[StateEnum, ...]:
        """Every state, in declaration order."""
        return tuple(self.state_type)

    def state(self, name: object) -> StateEnum:
        """The state called ``name`` (a stored value); :class:`InputError` if this machine has no such state."""
        try:
            return self.state_type(name)
        except ValueError:
            raise InputError(f"{self.name}: unknown state {name!r}") from None

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every trigger of the table, in declaration order, once each."""
        return tuple(dict.fromkeys(spec.trigger for spec in self.transitions))

    def spec(self, state: object, trigger: str) -> TransitionSpec:
        """The transition ``trigger`` takes from ``state``; :class:`IllegalTransitionError` if there is none."""
        state = self.state(state)
        try:
            return self._by_key[(state, trigger)]
        except KeyError:
            if trigger not in self.triggers:
                raise IllegalTransitionError(f"{self.name}: unknown trigger {trigger!r}") from None
            raise IllegalTransitionError(
                f"{self.name}: trigger {trigger!r} is not allowed from state {state}"
            ) from None

    def to_code(self, state: object) -> int:
        """FastDeploy integer code of ``state``."""
        return self.codes[self.state(state)]

    def from_code(self, code: int) -> StateEnum:
        """Canonical fdeplb state for a FastDeploy code (the first state listed with that code)."""
        for state in self.states:
            if self.codes[state] == code:
                return state
        raise InputError(f"{self.name}: unknown {self.code_name} code {code!r}")

    def transition_dicts(self) -> list[dict]:
        """The table in the form ``transitions.Machine(transitions=...)`` takes."""
        return [
            {"trigger": spec.trigger, "source": list(spec.sources), "dest": spec.dest} for spec in self.transitions
        ]


Handler = TypeVar("Handler", bound=Callable)


def entry_work(table: MachineTable, handlers: Mapping[StateEnum, Handler]) -> Mapping[StateEnum, Handler]:
    """Check that ``handlers`` maps every state of ``table`` (and nothing else) to its entry work; returns it
    read-only. Called at import by each driver (coordinator, rank agent), so a state added to a table without
    its handler fails at import, not in production (the pattern of vLLM's ``EPLB_POLICIES`` registry).

    Raises ``TypeError`` naming the missing or stray states.
    """
    missing = [s.value for s in table.states if s not in handlers]
    stray = [str(s) for s in handlers if s not in table.states]
    if missing or stray:
        raise TypeError(f"{table.name} entry work: no handler for {missing}; handlers for unknown states {stray}")
    return MappingProxyType(dict(handlers))


# ---- cluster rearrangement ------------------------------------------------------------------------------------------
C, R, W = ClusterState, RankState, WeightState
_PRE_COMMIT = (C.COLLECTING, C.PLANNING, C.LOADING, C.LOAD_SUCC)

CLUSTER = MachineTable(
    name="cluster",
    code_name="rearrange_experts_status",
    state_type=ClusterState,
    codes={C.FREE: 0, C.COLLECTING: 1, C.PLANNING: 1, C.LOADING: 1, C.LOAD_SUCC: 2, C.SWAPPING: 2, C.DONE: 3},
    initial=C.FREE,
    doc="One per cluster, driven by the coordinator that holds the lease (every commit is fenced).",
    transitions=(
        TransitionSpec(
            "start", (C.FREE,), C.COLLECTING, wakes_ranks=True,
            guards=(Guard(GuardKind.RANKS_IN, state=R.IDLE), Guard(GuardKind.WEIGHTS_IN, state=W.NORMAL)),
            doc="open a round; freezes the load window of every rank",
        ),
        TransitionSpec("plan", (C.COLLECTING,), C.PLANNING, doc="the round's load snapshot is stored"),
        TransitionSpec(
            "load", (C.PLANNING,), C.LOADING, guards=(Guard(GuardKind.PLAN_STORED),), wakes_ranks=True,
            doc="the plan is stored; ranks stage the experts their new slots need",
        ),
        TransitionSpec(
            "loaded", (C.LOADING,), C.LOAD_SUCC,
            guards=(Guard(GuardKind.RANKS_IN, state=R.LOADED, same_plan=True),),
            doc="every rank staged this plan",
        ),
        TransitionSpec(
            "commit", (C.LOAD_SUCC,), C.SWAPPING, effect=Effect.SET_PLACEMENT, wakes_ranks=True,
            guards=(Guard(GuardKind.RANKS_IN, state=R.LOADED, same_plan=True),),
            doc="commit point: the plan becomes the cluster's current placement in the same step; every rank "
                "must still hold its staging (none failed since LOAD_SUCC)",
        ),
        TransitionSpec(
            "swapped", (C.SWAPPING,), C.DONE,
            guards=(Guard(GuardKind.RANKS_IN, state=R.SWAPPED, same_plan=True),),
            doc="every rank swapped its slots and routing tables",
        ),
        TransitionSpec("release", (C.DONE,), C.FREE, wakes_ranks=True, doc="round finished"),
        TransitionSpec("abort", _PRE_COMMIT, C.FREE, wakes_ranks=True,
                       doc="before the commit point only; old placement stays"),
        TransitionSpec("operator_abort", _PRE_COMMIT, C.FREE, wakes_ranks=True, by_operator=True,
                       doc="an operator ends the round in flight (who and why audited); before the commit point "
                           "only, so it loses to a commit that came first; old placement stays"),
    ),
)

# ---- rank (one per EP rank) -----------------------------------------------------------------------------------------
RANK = MachineTable(
    name="rank",
    code_name="load_result",
    state_type=RankState,
    codes={R.IDLE: 0, R.LOADING: 0, R.LOADED: 1, R.LOAD_FAILED: -1, R.SWAPPING: 1, R.SWAPPED: 1},
    initial=R.IDLE,
    doc="One per EP rank, driven by the rank agent inside the serving worker.",
    transitions=(
        TransitionSpec(
            "stage", (R.IDLE,), R.LOADING,
            guards=(Guard(GuardKind.CLUSTER_IN, states=(C.LOADING,), same_plan=True),),
            doc="start staging the experts of the round's plan",
        ),
        TransitionSpec("staged", (R.LOADING,), R.LOADED, doc="every expert the plan loads is staged and checked"),
        TransitionSpec(
            "fail", (R.LOADING, R.LOADED), R.LOAD_FAILED, guards=(Guard(GuardKind.PLAN_NOT_CURRENT),),
            doc="staging failed; the reason is recorded. Refused once the plan is committed: then the rank "
                "rolls forward",
        ),
        TransitionSpec(
            "swap", (R.LOADED,), R.SWAPPING,
            guards=(Guard(GuardKind.CLUSTER_IN, states=(C.SWAPPING,), same_plan=True),),
            doc="the plan is committed; copy into the live slots",
        ),
        TransitionSpec("swapped", (R.SWAPPING,), R.SWAPPED, doc="slots and routing tables swapped and verified"),
        TransitionSpec("finish", (R.SWAPPED,), R.IDLE, doc="round over"),
        TransitionSpec(
            "abort", (R.LOADING, R.LOADED, R.LOAD_FAILED), R.IDLE, guards=(Guard(GuardKind.PLAN_NOT_CURRENT),),
            doc="round aborted before the commit point: staging dropped",
        ),
    ),
)

# ---- weight status (one per rank) -----------------------------------------------------------------------------------
WEIGHTS = MachineTable(
    name="weights",
    code_name="dynamic_weight_status",
    state_type=WeightState,
    codes={W.NORMAL: 0, W.UPDATING: 1, W.CLEARING: -1, W.CLEARED: -2},
    initial=W.NORMAL,
    doc="The serving engine's dynamic weight update/clear, one per rank.",
    transitions=(
        TransitionSpec(
            "update", (W.NORMAL, W.CLEARED), W.UPDATING, guards=(Guard(GuardKind.CLUSTER_IN, states=(C.FREE,)),),
            doc="reload the experts from the checkpoint in the cluster's current placement; refused while a round "
                "is past FREE (the placement could change under the reload)",
        ),
        TransitionSpec("updated", (W.UPDATING,), W.NORMAL, doc="every slot reloaded and verified by checksum"),
        TransitionSpec(
            "update_failed", (W.UPDATING,), W.CLEARED,
            doc="the reload failed (unreadable checkpoint, a checksum mismatch); the reason is recorded and the "
                "rank does not serve until a new update succeeds (never NORMAL with wrong weights)",
        ),
        TransitionSpec(
            "clear", (W.NORMAL,), W.CLEARING, guards=(Guard(GuardKind.CLUSTER_IN, states=(C.FREE,)),),
            doc="free the weights; refused while a round is past FREE",
        ),
        TransitionSpec("cleared", (W.CLEARING,), W.CLEARED, doc="weights freed"),
        TransitionSpec(
            "cancel", (W.CLEARING, W.UPDATING), W.NORMAL, guards=(Guard(GuardKind.WITHDRAWN, state=W.NORMAL),),
            doc="the request was cancelled before its switch step was fixed (a rank never armed for it within "
                "deadlines.weights_ms), so no rank applied it: back to NORMAL, the state the clear or update came "
                "from",
        ),
        TransitionSpec(
            "cancel_to_cleared", (W.UPDATING,), W.CLEARED, guards=(Guard(GuardKind.WITHDRAWN, state=W.CLEARED),),
            doc="an update from CLEARED was cancelled before its switch step was fixed: back to CLEARED",
        ),
    ),
)

# ---- membership (one per rank) --------------------------------------------------------------------------------------
M = MemberState
MEMBERSHIP = MachineTable(
    name="membership",
    label="member",
    code_name="member_code",
    state_type=MemberState,
    codes={M.ACTIVE: 0, M.SUSPECT: 1, M.DRAINING: 2, M.EXCLUDED: -1, M.REJOINING: 3},
    initial=M.ACTIVE,
    doc="One per EP rank, driven by the leading coordinator (fenced) and the operator; every transition raises the "
        "cluster's membership generation in the same atomic step. Only ACTIVE ranks count in a round.",
    transitions=(
        TransitionSpec("suspect", (M.ACTIVE,), M.SUSPECT, effect=Effect.BUMP_GENERATION,
                       doc="the rank's heartbeat is past its TTL, or its engine passed no safe point for "
                           "deadlines.exclude_ms while a round waits on it, as the leading coordinator observes it"),
        TransitionSpec("recover", (M.SUSPECT,), M.ACTIVE, effect=Effect.BUMP_GENERATION,
                       doc="the heartbeat is fresh again (and an engine's safe points go on) before the exclusion "
                           "deadline"),
        TransitionSpec("exclude", (M.SUSPECT,), M.EXCLUDED, effect=Effect.BUMP_GENERATION,
                       doc="still stale after deadlines.exclude_ms (the coordinator, fenced), or the operator's "
                           "exclude of a suspect rank; its experts are re-placed on live ranks"),
        TransitionSpec("drain", (M.ACTIVE,), M.DRAINING, effect=Effect.BUMP_GENERATION,
                       doc="planned removal by the operator"),
        TransitionSpec("drained", (M.DRAINING,), M.EXCLUDED, effect=Effect.BUMP_GENERATION,
                       doc="the draining rank leaves the members"),
        TransitionSpec("rejoin", (M.EXCLUDED,), M.REJOINING, effect=Effect.BUMP_GENERATION,
                       doc="an agent of the rank registers again, or one that lived on through the exclusion is "
                           "back (a hung engine steps again); it holds the current placement for its slots"),
        TransitionSpec("admit", (M.REJOINING,), M.ACTIVE, effect=Effect.BUMP_GENERATION,
                       guards=(Guard(GuardKind.CLUSTER_IN, states=(C.FREE,)),),
                       doc="the rejoining rank loaded the current placement for its slots; admitted between rounds "
                           "(a round in flight keeps its members)"),
        TransitionSpec("readmit", (M.EXCLUDED, M.DRAINING), M.ACTIVE, effect=Effect.BUMP_GENERATION,
                       guards=(Guard(GuardKind.CLUSTER_IN, states=(C.FREE,)),),
                       doc="the operator takes the rank back as a member, between rounds"),
    ),
)

#: the cancel trigger of a withdrawn weight request, by the state the record came from (``WeightRecord.prior``)
WEIGHT_CANCELS: Mapping[WeightState, str] = MappingProxyType({W.NORMAL: "cancel", W.CLEARED: "cancel_to_cleared"})

TABLES: dict[str, MachineTable] = {t.name: t for t in (CLUSTER, RANK, WEIGHTS, MEMBERSHIP)}
#: audit key prefix (``cluster``, ``rank``, ``weights``, ``member``) -> its table
TABLE_OF_LABEL: dict[str, MachineTable] = {t.key_label: t for t in TABLES.values()}

#: FastDeploy's names of the cluster codes (its ``RearrangeExpertStatus``); ``CLUSTER.to_code`` gives the code
FASTDEPLOY_STATUS_NAMES: dict[int, str] = {0: "FREE", 1: "DOING", 2: "LOAD_SUCC", 3: "DONE"}
