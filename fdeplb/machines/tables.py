"""The three state-machine tables of fdeplb, declared as data (no I/O).

Each :class:`MachineTable` is one diagram in ``statecharts/``: its states, the FastDeploy integer code of each state
(both ways, in one place), and its transitions with the guards that span records. The guards are *names*; the store
turns each name into the keys and checks of the commit script (see ``fdeplb/store/lua/commit.lua``), so a guard is
always evaluated in the same atomic step as the write it protects.

FastDeploy codes (``fastdeploy/eplb``): rearrange status FREE=0, DOING=1, LOAD_SUCC=2, DONE=3; per-rank load result
0 (not yet) / 1 (success) / -1 (failed); dynamic weight status NORMAL=0, UPDATING=1, CLEARING=-1, CLEARED=-2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fdeplb.errors import IllegalTransitionError, InputError


@dataclass(frozen=True)
class Guard:
    """A check across records, evaluated inside the commit script.

    ``kind`` is one of:

    - ``ranks_in``: every registered rank record is in ``state`` (``same_plan``: and carries the round's plan_id);
    - ``weights_in``: every registered rank's weight-status record is in ``state``;
    - ``cluster_in``: the cluster record is in one of ``states`` (``same_plan``: with the caller's plan_id);
    - ``plan_stored``: the plan named by the transition's plan_id is stored;
    - ``plan_not_current``: the caller's plan_id is not the cluster's current placement (before the commit point).
    """

    kind: str
    state: str = ""
    states: tuple[str, ...] = ()
    same_plan: bool = False

    def label(self) -> str:
        target = self.state or "|".join(self.states)
        plan = ", same plan" if self.same_plan else ""
        return f"{self.kind}({target}{plan})" if target else self.kind


@dataclass(frozen=True)
class TransitionSpec:
    """One row of a table: ``trigger`` moves any of ``sources`` to ``dest`` if every guard holds."""

    trigger: str
    sources: tuple[str, ...]
    dest: str
    guards: tuple[Guard, ...] = ()
    effect: str = ""  # extra write in the same atomic step (``set_placement``)
    doc: str = ""


@dataclass(frozen=True)
class MachineTable:
    """A state machine as data: states, their FastDeploy codes, transitions.

    ``code_name`` names the FastDeploy field the codes belong to. ``from_code`` maps a code back to the canonical
    (first-listed) state of that code, since several fdeplb states share one FastDeploy code.
    """

    name: str
    code_name: str
    states: tuple[str, ...]
    codes: dict[str, int]
    initial: str
    transitions: tuple[TransitionSpec, ...]
    doc: str = ""
    _by_key: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for spec in self.transitions:
            for src in spec.sources:
                key = (src, spec.trigger)
                if key in self._by_key:
                    raise ValueError(f"{self.name}: trigger {spec.trigger!r} defined twice from {src}")
                self._by_key[key] = spec
        missing = set(self.states) - set(self.codes)
        if missing:
            raise ValueError(f"{self.name}: states without a FastDeploy code: {sorted(missing)}")

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every trigger of the table, in declaration order, once each."""
        return tuple(dict.fromkeys(spec.trigger for spec in self.transitions))

    def spec(self, state: str, trigger: str) -> TransitionSpec:
        """The transition ``trigger`` takes from ``state``; :class:`IllegalTransitionError` if there is none."""
        if state not in self.states:
            raise InputError(f"{self.name}: unknown state {state!r}")
        try:
            return self._by_key[(state, trigger)]
        except KeyError:
            if trigger not in self.triggers:
                raise IllegalTransitionError(f"{self.name}: unknown trigger {trigger!r}") from None
            raise IllegalTransitionError(
                f"{self.name}: trigger {trigger!r} is not allowed from state {state}"
            ) from None

    def to_code(self, state: str) -> int:
        """FastDeploy integer code of ``state``."""
        try:
            return self.codes[state]
        except KeyError:
            raise InputError(f"{self.name}: unknown state {state!r}") from None

    def from_code(self, code: int) -> str:
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


# ---- cluster rearrangement ------------------------------------------------------------------------------------------
_PRE_COMMIT = ("COLLECTING", "PLANNING", "LOADING", "LOAD_SUCC")

CLUSTER = MachineTable(
    name="cluster",
    code_name="rearrange_experts_status",
    states=("FREE", "COLLECTING", "PLANNING", "LOADING", "LOAD_SUCC", "SWAPPING", "DONE"),
    codes={"FREE": 0, "COLLECTING": 1, "PLANNING": 1, "LOADING": 1, "LOAD_SUCC": 2, "SWAPPING": 2, "DONE": 3},
    initial="FREE",
    doc="One per cluster, driven by the coordinator that holds the lease (every commit is fenced).",
    transitions=(
        TransitionSpec(
            "start", ("FREE",), "COLLECTING",
            guards=(Guard("ranks_in", state="IDLE"), Guard("weights_in", state="NORMAL")),
            doc="open a round; freezes the load window of every rank",
        ),
        TransitionSpec("plan", ("COLLECTING",), "PLANNING", doc="the round's load snapshot is stored"),
        TransitionSpec(
            "load", ("PLANNING",), "LOADING", guards=(Guard("plan_stored"),),
            doc="the plan is stored; ranks stage the experts their new slots need",
        ),
        TransitionSpec(
            "loaded", ("LOADING",), "LOAD_SUCC", guards=(Guard("ranks_in", state="LOADED", same_plan=True),),
            doc="every rank staged this plan",
        ),
        TransitionSpec(
            "commit", ("LOAD_SUCC",), "SWAPPING", effect="set_placement",
            guards=(Guard("ranks_in", state="LOADED", same_plan=True),),
            doc="commit point: the plan becomes the cluster's current placement in the same step; every rank "
                "must still hold its staging (none failed since LOAD_SUCC)",
        ),
        TransitionSpec(
            "swapped", ("SWAPPING",), "DONE", guards=(Guard("ranks_in", state="SWAPPED", same_plan=True),),
            doc="every rank swapped its slots and routing tables",
        ),
        TransitionSpec("release", ("DONE",), "FREE", doc="round finished"),
        TransitionSpec("abort", _PRE_COMMIT, "FREE", doc="before the commit point only; old placement stays"),
    ),
)

# ---- rank (one per EP rank) -----------------------------------------------------------------------------------------
RANK = MachineTable(
    name="rank",
    code_name="load_result",
    states=("IDLE", "LOADING", "LOADED", "LOAD_FAILED", "SWAPPING", "SWAPPED"),
    codes={"IDLE": 0, "LOADING": 0, "LOADED": 1, "LOAD_FAILED": -1, "SWAPPING": 1, "SWAPPED": 1},
    initial="IDLE",
    doc="One per EP rank, driven by the rank agent inside the serving worker.",
    transitions=(
        TransitionSpec(
            "stage", ("IDLE",), "LOADING", guards=(Guard("cluster_in", states=("LOADING",), same_plan=True),),
            doc="start staging the experts of the round's plan",
        ),
        TransitionSpec("staged", ("LOADING",), "LOADED", doc="every expert the plan loads is staged and checked"),
        TransitionSpec(
            "fail", ("LOADING", "LOADED"), "LOAD_FAILED", guards=(Guard("plan_not_current"),),
            doc="staging failed; the reason is recorded. Refused once the plan is committed: then the rank "
                "rolls forward",
        ),
        TransitionSpec(
            "swap", ("LOADED",), "SWAPPING", guards=(Guard("cluster_in", states=("SWAPPING",), same_plan=True),),
            doc="the plan is committed; copy into the live slots",
        ),
        TransitionSpec("swapped", ("SWAPPING",), "SWAPPED", doc="slots and routing tables swapped and verified"),
        TransitionSpec("finish", ("SWAPPED",), "IDLE", doc="round over"),
        TransitionSpec(
            "abort", ("LOADING", "LOADED", "LOAD_FAILED"), "IDLE", guards=(Guard("plan_not_current"),),
            doc="round aborted before the commit point: staging dropped",
        ),
    ),
)

# ---- weight status (one per rank) -----------------------------------------------------------------------------------
WEIGHTS = MachineTable(
    name="weights",
    code_name="dynamic_weight_status",
    states=("NORMAL", "UPDATING", "CLEARING", "CLEARED"),
    codes={"NORMAL": 0, "UPDATING": 1, "CLEARING": -1, "CLEARED": -2},
    initial="NORMAL",
    doc="The serving engine's dynamic weight update/clear, one per rank.",
    transitions=(
        TransitionSpec("update", ("NORMAL", "CLEARED"), "UPDATING", doc="reload the model weights"),
        TransitionSpec("updated", ("UPDATING",), "NORMAL", doc="weights reloaded"),
        TransitionSpec(
            "clear", ("NORMAL",), "CLEARING", guards=(Guard("cluster_in", states=("FREE",)),),
            doc="free the weights; refused while a round is past FREE",
        ),
        TransitionSpec("cleared", ("CLEARING",), "CLEARED", doc="weights freed"),
    ),
)

TABLES: dict[str, MachineTable] = {t.name: t for t in (CLUSTER, RANK, WEIGHTS)}
