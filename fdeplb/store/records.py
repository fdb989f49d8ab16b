"""Typed records: every value fdeplb keeps in Redis, as frozen dataclasses parsed and written only by the store.

Each class's fields are its record's field list (the one place it is written down): :func:`parse_record` builds a
record from a Redis hash and :func:`encode_changes` turns keyword changes into hash fields, refusing names the
record does not have. A value that does not parse (a version that is not an integer, a state the machine does not
have) raises :class:`~fdeplb.errors.CorruptRecordError` naming the key and the field.

Arrays (expert_load, phy2log) are kept as dtype + shape + raw bytes (:mod:`fdeplb.store.arrays`). A stored plan
(:class:`PlanEntry`) lives in :mod:`fdeplb.store.plan_entry` and the cluster's configuration in
:mod:`fdeplb.store.cluster_config`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from fdeplb.errors import CorruptRecordError, InputError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, WEIGHTS, ClusterState, MachineTable, MemberState, \
    RankState, StateEnum, WeightState


# ---- machine records -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordHeader:
    """The fields every machine record has (cluster, rank and weight-status records alike); each record type
    narrows ``state`` to its machine's states. Records are built by keyword (:func:`parse_record`), so the field
    order is not part of the format."""

    key: str
    """Redis key of the record."""
    state: StateEnum
    """Current state of the record's machine."""
    version: int
    """Commits so far (0 = created, never transitioned); +1 per committed transition."""
    round: int = 0
    """The cluster's round the record last moved in: the cluster record's is the round in progress or last finished
    (0 = none yet); a rank's, the round it last took part in; a weight-status record's, the cluster round at its
    last transition."""
    plan_id: str = ""
    """The plan the record is at (content hash, 16 hex digits): the cluster's round's plan ("" until PLANNING stored
    it); the plan a rank is staging / staged / swapping; the placement a rank's weights were last loaded in ("" =
    before the first round / the initial placement)."""
    reason: str = ""
    """Why the last round (cluster), the rank's work or the last weight update or clear failed, was aborted or was
    skipped ("" otherwise)."""
    updated_ms: int = 0
    """Redis server time (ms) of the last commit."""


@dataclass(frozen=True)
class ClusterRecord(RecordHeader):
    """The cluster rearrangement record, hash ``fdeplb:{c}:rearrange`` (one per cluster)."""

    state: ClusterState
    """Current state of the cluster machine (:data:`~fdeplb.machines.tables.CLUSTER`)."""
    deadline_ms: int = 0
    """Redis server time (ms since the epoch) when the current wait expires; 0 = no deadline."""
    alarm: str = ""
    """Raised after the commit point when a deadline passed (the round rolls forward); "" when none."""
    requested: int = 0
    """Highest round number asked for: the coordinator starts a round while ``requested > round``. Requests
    coalesce (:meth:`~fdeplb.store.Store.request_round`): it is at most ``round + 1``."""
    requested_reason: str = ""
    """Who or what asked for the last round (operator, api, interval, ...); see :func:`check_request_reason`."""
    requested_ms: int = 0
    """Redis server time (ms) of the request that made the pending round pending (0 = none, or a request written
    before this field existed: it never expires). Past ``deadlines.request_ttl_ms`` the leading coordinator
    withdraws it (``request_expired``)."""
    commit_requested: str = ""
    """plan_id an operator allowed to commit on a cordoned cluster ("" = none)."""
    commit_requested_by: str = ""
    """Who allowed it (``http``: the API's ``update_weight_from_tensor``; ``cli``: ``fdeplb rearrange --commit``);
    the commit's audit record names it."""
    weights_request: int = 0
    """Weight clear/update requests so far; a rank carries out request n once (its record's ``request``)."""
    weights_action: str = ""
    """What the latest weight request asks: "clear" or "update" ("" = none yet)."""
    weights_reason: str = ""
    """Who or what asked for the latest weight request."""
    weights_switch_step: int = 0
    """Step (the ranks' safe-point counters) at which every rank carries out the latest weight request; 0 = not
    fixed yet. Fixed by ``lua/switch.lua`` once every rank is armed for the request (embedded agents wait for it;
    threaded agents do not use it)."""
    weights_cancelled: int = 0
    """The last weight request withdrawn because its switch step was not fixed within ``deadlines.weights_ms``
    (0 = none): no rank applied it, every rank returns to the state it came from (``cancel`` transitions). Written
    by ``lua/weights_cancel.lua``, which refuses once the switch step is fixed; ``lua/switch.lua`` refuses an arm
    for it after."""
    weights_cancel_reason: str = ""
    """Why request ``weights_cancelled`` was withdrawn (the audited reason's text)."""
    weights_held_by: str = ""
    """The ranks whose workers held request ``weights_cancelled`` back (never armed for it), comma-separated;
    :attr:`held_by` as a list."""
    switch_step: int = 0
    """Step at which every rank applies the committed plan; 0 = not fixed yet (the commit resets it). Fixed by
    ``lua/switch.lua`` once every rank is armed for the swap (embedded agents wait for it; threaded agents do not
    use it)."""
    switch_chunks: str = ""
    """The chunk layout of the committed swap, fixed with ``switch_step`` (``lua/switch.lua``): a JSON array of the
    first layer of each chunk, the union of every rank's layout ("" = not fixed; the commit resets it). Chunk k
    (the changed layers from its first layer to the next chunk's) is applied by every rank at step
    ``switch_step + k``."""
    switch_generation: int = 0
    """The membership generation under which the last switch step (``switch_step`` / ``weights_switch_step``) was
    fixed (``lua/switch.lua``): the members it waited for."""
    clear_stat_request: int = 0
    """``clear_stat`` requests so far: each rank agent empties its load window once per request."""
    generation: int = 0
    """The cluster's membership generation: +1 at every membership transition (``commit.lua``'s
    ``bump_generation``, in the same atomic step as the member record's commit). Every cluster commit is made
    under the generation its caller read and is refused (:class:`~fdeplb.errors.GenerationError`) when the stored
    one is newer: a plan or switch decided for other members never commits."""
    members: str = ""
    """The EP ranks the round in flight counts (its ACTIVE members when it started), comma-separated; "" = every
    rank. Before the commit point the round aborts when they are no longer exactly the ACTIVE members."""
    probe_mismatch: str = ""
    """The audited ``probe_mismatch`` still in force (its reason text,
    :func:`fdeplb.rounds.reasons.probe_mismatch`): a committed swap whose output probe failed on some rank;
    "" = none. Written by every round's ``swapped``: set when a rank's probe failed, cleared by a later round's
    with no probe failing (the rollback round's). ``/health`` is 503 while it is set."""
    pruned: str = ""
    """What the coordinator pruned after the last round ended (snapshot and plan keys, comma-separated; "" =
    nothing); each pruning is also announced as a ``pruned`` event."""

    @property
    def held_by(self) -> list[int]:
        """:attr:`weights_held_by` as rank numbers (empty when none, or when the field is not a list of them)."""
        parts = self.weights_held_by.split(",") if self.weights_held_by else []
        return [int(p) for p in parts] if all(p.isdigit() for p in parts) else []


@dataclass(frozen=True)
class RankRecord(RecordHeader):
    """One EP rank's record, hash ``fdeplb:{c}:rank:<ep_rank>``: its machine state and its last reports."""

    state: RankState
    """Current state of the rank machine (:data:`~fdeplb.machines.tables.RANK`)."""
    heartbeat_ms: int = 0
    """Redis server time (ms) of the agent's last heartbeat (0 = no agent ever ran)."""
    live_plan_id: str | None = None
    """Placement the rank's live slots hold ("" = the initial placement, None = no agent has loaded yet)."""
    keep: int = 0
    """Last staging: slots whose expert stays in place."""
    local: int = 0
    """Last staging: slots filled by copying an expert the rank already holds."""
    disk: int = 0
    """Last staging: experts read from the checkpoint (each once)."""
    disk_slots: int = 0
    """Last staging: slots filled from those experts (an expert may fill several slots)."""
    disk_bytes: int = 0
    """Last staging: bytes read from the checkpoint."""
    local_bytes: int = 0
    """Last staging: bytes copied between slots of the rank."""
    peer: int = 0
    """Last staging: experts taken from a peer rank's live slot (each once, verified on arrival)."""
    peer_bytes: int = 0
    """Last staging: bytes taken from peers' live slots instead of the checkpoint."""
    stage_ms: float = 0.0
    """Last staging: wall time in ms."""
    swap_ms: float = 0.0
    """Last swap: wall time in ms (copies, routing tables and verification)."""
    snapshots: int = 0
    """Last swap: slots copied aside to break copy cycles."""
    bytes_from_staging: int = 0
    """Last swap: bytes copied from staging into live slots."""
    bytes_local: int = 0
    """Last swap: bytes copied slot to slot."""
    slots_verified: int = 0
    """Slots found to hold exactly their logical expert's checkpoint tensors after the last swap."""
    slots_total: int = 0
    """Slots of the rank (num_layers x slots per rank)."""
    verified_all: int = 0
    """1 if the last swap re-verified every slot, 0 if only the slots it wrote."""
    heartbeat_ttl_ms: int = 0
    """The heartbeat's time to live (ms): the rank is stale once ``heartbeat_ms + heartbeat_ttl_ms`` has passed
    (0 = no TTL written: never stale)."""
    step: int = 0
    """The worker's step counter (safe points passed) at the last heartbeat (0 = not embedded in a worker)."""
    steps_per_s: float = 0.0
    """The worker's step rate at the last heartbeat (safe points per second, smoothed)."""
    safe_point_ms: int = 0
    """Redis server time (ms) of the worker's last safe point (``step``), as its last heartbeat saw it (0 = not
    an engine: no ``at_safe_point`` caller). A round that waits on a rank whose safe points stopped for
    ``deadlines.exclude_ms`` suspects it (a hung engine, :func:`~fdeplb.store.liveness.stale_of`)."""
    applied_step: int = 0
    """Step at which the rank last applied a swap or a weight clear/update at a safe point."""
    late_steps: int = 0
    """How many steps past the switch step the rank applied it (0 = on time; > 0 raised an alarm)."""
    armed: str = ""
    """The change the rank's worker is armed for ("swap:<round>:<plan_id>", "weights:<request>"; "" = never
    armed): while armed it publishes its step counter and reads the switch step at every safe point."""
    armed_step: int = 0
    """The worker's step counter at its last armed safe point (written only by the worker, ``lua/switch.lua``)."""
    armed_chunks: str = ""
    """The rank's own chunk layout of the change it is armed for (JSON array of first layers; "[]" = one safe
    point), within its pause budget; the switch step fixes the union of every rank's (``switch_chunks``)."""
    chunks: int = 0
    """Last swap: safe points (chunks of layers) it was applied in."""
    pause_max_ms: float = 0.0
    """Last swap: the longest pause of one safe point (ms: the worker held for the copy, on-device check and
    routing rows of the chunks applied there, normally one)."""
    pause_sum_ms: float = 0.0
    """Last swap: the pauses of all its safe points together (ms)."""
    late_prepares: int = 0
    """Last swap: chunks whose device-buffer load was not done by their safe point (a slow or failed background
    load), so it ran in the pause."""
    clear_stat: int = 0
    """The cluster's ``clear_stat_request`` this rank last carried out."""
    routing_digest: str = ""
    """:func:`fdeplb.placement.routing_digest` of the routing tables (phy2log) the rank's live slots hold, written
    when it loads or swaps ("" = not reported yet); must equal the current placement's (``fdeplb status``)."""
    probe: str = ""
    """Last swap: its output probe (:class:`fdeplb.orchestration.probe.ProbeOutcome`): ``agree``, ``mismatch``,
    ``failed`` (the probe raised) or "" (no probe registered, or no swap)."""
    probe_layers: str = ""
    """Last swap: the MoE layers whose probe outputs disagreed, comma-separated ("" = none)."""
    probe_message: str = ""
    """Last swap: what the probe found wrong (per layer, or the probe's exception), at most 500 characters."""
    probe_before_ms: float = 0.0
    """Last swap: the probe's run before the switch (ms, in the first chunk's pause)."""
    probe_after_ms: float = 0.0
    """Last swap: the probe's run after the last chunk (ms, in its pause)."""


@dataclass(frozen=True)
class WeightRecord(RecordHeader):
    """One EP rank's weight-status record, hash ``fdeplb:{c}:weights:<ep_rank>`` (dynamic weight update/clear)."""

    state: WeightState
    """Current state of the weight-status machine (:data:`~fdeplb.machines.tables.WEIGHTS`)."""
    request: int = 0
    """The cluster's weight request (``ClusterRecord.weights_request``) this rank last carried out."""
    prior: WeightState | None = None
    """The state the rank's last clear or update came from (written with the ``clear`` / ``update``
    transition): where a cancel of that request returns it (:data:`~fdeplb.machines.tables.WEIGHT_CANCELS`)."""
    at_switch: int = 0
    """1 when the rank applies its current request only at the request's switch step (an agent with safe points),
    0 when it applies it at once (a threaded agent): a request some rank may be applying is never cancelled."""


@dataclass(frozen=True)
class MemberRecord(RecordHeader):
    """One EP rank's membership record, hash ``fdeplb:{c}:member:<ep_rank>`` (:data:`~fdeplb.machines.tables.MEMBERSHIP`)."""

    state: MemberState
    """Current membership state; only ACTIVE ranks count in a round."""
    generation: int = 0
    """The cluster generation this record's last transition produced (0 = never transitioned)."""
    deadline_ms: int = 0
    """While SUSPECT: Redis server time (ms) after which a still stale rank is excluded (0 = none)."""
    actor: str = ""
    """Who made the last transition (the coordinator's holder id, ``operator:<user>``)."""


MachineRecord = typing.Union[ClusterRecord, RankRecord, WeightRecord, MemberRecord]

#: machine table name -> its record class
RECORD_TYPES: dict[str, type] = {CLUSTER.name: ClusterRecord, RANK.name: RankRecord, WEIGHTS.name: WeightRecord,
                                 MEMBERSHIP.name: MemberRecord}

#: fields written only by the commit script
_COMMIT_FIELDS = frozenset({"key", "state", "version", "updated_ms"})


def record_type(table: MachineTable) -> type:
    """The record class of ``table``'s records."""
    return RECORD_TYPES[table.name]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # cached: resolving the string annotations costs ~1 ms per call


#: the largest integer a record field may hold: the Lua scripts compute with doubles, exact up to 2**53
MAX_RECORD_INT = 2**53


def _int_or_zero(text: str) -> int:
    """A machine record's integer field ("" = 0): a version, round, counter, step or server time, so in
    [0, :data:`MAX_RECORD_INT`]; anything else is a ValueError (the record is corrupt). Its input is always the
    text Redis holds, so this is a parse, not :func:`fdeplb.checks.check_int` (which vets Python values); it runs
    for every field of every record an agent reads at each wake-up."""
    value = int(text) if text != "" else 0
    if not 0 <= value <= MAX_RECORD_INT:
        raise ValueError("out of range")
    return value


def _finite_float(text: str) -> float:
    value = float(text) if text != "" else 0.0
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


@functools.cache
def _parsers(cls: type) -> tuple[tuple[str, Callable[[str], Any] | None, Any], ...]:
    """Per field of ``cls`` (but ``key``): its name, the function that parses its stored text (None: kept as text)
    and its type (for error messages); built once per record type (parsing runs at every agent wake-up)."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "key":
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
        if isinstance(hint, type) and issubclass(hint, StateEnum):
            parse: Callable[[str], Any] | None = hint
        else:
            parse = {int: _int_or_zero, float: _finite_float}.get(hint)
        out.append((f.name, parse, hint))
    return tuple(out)


def parse_record(cls: type, key: str, raw: Mapping[str, str]) -> Any:
    """Build a record of type ``cls`` from a hash's text fields (unknown fields are ignored: a newer writer's).

    Raises :class:`CorruptRecordError` when ``state`` or ``version`` is missing or a field does not parse.
    """
    if "state" not in raw or "version" not in raw:
        raise CorruptRecordError(f"{key}: record without state or version", key=key)
    values: dict[str, Any] = {"key": key}
    for name, parse, hint in _parsers(cls):
        text = raw.get(name)
        if text is None:
            continue
        if parse is None:
            values[name] = text
            continue
        try:
            values[name] = parse(text)
        except ValueError:
            raise CorruptRecordError(f"{key}: field {name!r} holds {text[:40]!r}, not a valid "
                                     f"{getattr(hint, '__name__', hint)} ({cls.__name__})", key=key) from None
    return cls(**values)


@functools.cache
def field_names(cls: type) -> frozenset[str]:
    """The field names of record type ``cls`` (computed once per type)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def encode_changes(cls: type, changes: Mapping[str, Any]) -> dict[str, str]:
    """Hash fields for ``changes`` to a record of type ``cls``: values as text, None as "".

    Raises :class:`InputError` for a name the record does not have, or for ``key``, ``state``, ``version`` and
    ``updated_ms`` (written only by the commit script).
    """
    names = field_names(cls)
    out: dict[str, str] = {}
    for name, value in changes.items():
        if name not in names:
            raise InputError(f"{cls.__name__} has no field {name!r}")
        if name in _COMMIT_FIELDS:
            raise InputError(f"{cls.__name__}.{name} is written only by a commit")
        if isinstance(value, bool):
            value = int(value)
        out[name] = "" if value is None else (value.value if isinstance(value, StateEnum) else str(value))
    return out


# ---- arrays and documents -------------------------------------------------------------------------------------------
def member_ranks(members: str, ep_size: int) -> tuple[int, ...]:
    """The ep_ranks of a ``members`` field (``ClusterRecord.members``, ``PlacementEntry.members``): comma-separated
    ints, "" = every rank of ``ep_size``."""
    if members == "":
        return tuple(range(ep_size))
    return tuple(int(x) for x in members.split(",") if x != "")


@dataclass(frozen=True)
class PlacementEntry:
    """The cluster's current placement, hash ``fdeplb:{c}:placement``."""

    plan_id: str
    """Plan that produced it ("" = the initial placement written by init-cluster)."""
    phy2log: np.ndarray
    """int64 [num_layers, num_physical_experts]: logical expert held by every slot."""
    version: int = 0
    """Times the placement changed (0 = initial); +1 per committed plan."""
    members: str = ""
    """The EP ranks it is routed over: the members of the round that committed it (``ClusterRecord.members``,
    comma-separated; "" = every rank). log2phy / logcnt name only their slots (:meth:`live_ranks`)."""

    def live_ranks(self, ep_size: int) -> tuple[int, ...]:
        """The ranks of :attr:`members` as ints (every rank of ``ep_size`` for "")."""
        return member_ranks(self.members, ep_size)


@dataclass(frozen=True)
class LoadWindow:
    """A rank's published expert_load window, hash ``fdeplb:{c}:load:<ep_rank>``."""

    ep_rank: int
    """The rank that published it."""
    round: int
    """Round the window was published for."""
    expert_load: np.ndarray
    """int64 [num_layers, num_logical_experts]: tokens routed per logical expert (token x top-k assignments)."""
    published_ms: int = 0
    """Redis server time (ms) of the publication."""


@dataclass(frozen=True)
class LeaseInfo:
    """The coordinator lease as it stands."""

    holder: str | None
    """Lease value ``<fence>:<holder id>``, None when no coordinator leads."""
    ttl_ms: int | None
    """Milliseconds until the lease expires (None when not held)."""


#: longest ``reason`` of a round request (``fdeplb rearrange --reason``)
MAX_REQUEST_REASON = 500


def has_control_character(text: str) -> bool:
    """True when ``text`` holds a C0 or C1 control character (a newline, an escape sequence's ESC...): the rule for
    texts an operator's command keeps and terminals show."""
    return any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in text)


def check_request_reason(reason: str) -> str:
    """``reason`` if it may be kept as a round request's ``requested_reason``: a str of at most
    :data:`MAX_REQUEST_REASON` characters with no control character (it is shown on terminals); else
    :class:`InputError`."""
    if not isinstance(reason, str) or len(reason) > MAX_REQUEST_REASON or has_control_character(reason):
        shown = repr(reason[:60]) + ("..." if isinstance(reason, str) and len(reason) > 60 else "")
        raise InputError(f"reason must be at most {MAX_REQUEST_REASON} characters without control characters, "
                         f"got {shown} ({len(reason) if isinstance(reason, str) else type(reason).__name__}"
                         f"{' characters' if isinstance(reason, str) else ''})")
    return reason
