"""Which ranks are there and alive: the rank registry (the only peers ever named in requests), heartbeats read at
one server time and the staleness rule of a heartbeat TTL (:func:`stale_of`), the placement a rank reports holding
live once the cluster's records are gone (:meth:`Liveness.report_live`, what ``init-cluster`` adopts), and an armed
rank's safe point (``lua/switch.lua``: the step at which every embedded rank applies a change).

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_switch`` (the registered script),
``read_all``, ``ep_size``, ``now_ms``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, NamedTuple

import numpy as np
import redis

from fdeplb.errors import CorruptRecordError, InputError
from fdeplb.machines.tables import MEMBERSHIP, RANK, MemberState, StateEnum
from fdeplb.store import arrays
from fdeplb.store.connection import as_str as _s, hgetall as _hgetall, typed as _typed
from fdeplb.store.plan_entry import json_text
from fdeplb.store.records import ClusterRecord, MemberRecord
from fdeplb.store.scripts import switch_call
from fdeplb.store.txn import transaction

#: default margin of a switch step (:meth:`Store.arm_switch`): steps past the largest armed step (>= 1 is safe)
SWITCH_MARGIN_STEPS = 2

#: the cluster record's field names (what :meth:`Store.arm_switch` may name)
_CLUSTER_FIELDS = frozenset(f.name for f in dataclasses.fields(ClusterRecord))


class SwitchStep(NamedTuple):
    """What one armed safe point learned (:meth:`Liveness.arm_switch`)."""

    step: int
    """The change's switch step (0 = not fixed)."""
    status: str
    """``fixed`` / ``set`` / ``waiting`` / ``gone`` / ``cancelled`` (``lua/switch.lua``)."""
    chunks: tuple[int, ...] = ()
    """The fixed chunk layout (first layer of each chunk, ascending; chunk k applies at ``step + k``); () until
    fixed, or for a change without chunks."""


def parse_chunks(text: str) -> tuple[int, ...]:
    """A stored chunk layout (``switch_chunks`` / ``armed_chunks``: a JSON array of layers; "" or "{}" = none)
    as a tuple; :class:`CorruptRecordError` when it is not one."""
    try:
        value = json.loads(text) if text else []
    except ValueError:
        value = None
    if value == {}:
        value = []
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and float(v).is_integer() for v in value):
        raise CorruptRecordError(f"a chunk layout must be a JSON array of layers, got {text[:80]!r}")
    return tuple(int(v) for v in value)


#: the age :func:`stale_of` gives a rank that ``heartbeats`` does not hold (not registered, or never beat)
NOT_REGISTERED = -1


def stale_of(heartbeats: dict[int, tuple[int, int]], ep_size: int | None = None, *,
             safe_points: Mapping[int, int] | None = None, waited_on: Collection[int] = (),
             hang_ms: int = 0) -> dict[int, int]:
    """The stale ranks of :meth:`Store.heartbeats`' answer: ``ep_rank -> ms since the heartbeat`` for every rank
    whose TTL is set (> 0) and has passed. With ``ep_size``, every rank of ``range(ep_size)`` that ``heartbeats``
    does not hold (not registered: e.g. after Redis lost its data) is stale too, with age :data:`NOT_REGISTERED`
    (the start guard and ``/health`` count every rank, registered or not). Without it a rank that is not
    registered is never stale: the membership watch suspects only a rank it saw heartbeat and lapse
    (:class:`~fdeplb.orchestration.membership.MembershipWatch`), and :meth:`Liveness.stale_ranks` names only
    registered ranks.

    A hung engine (its heartbeat thread beats on, its forward loop is stuck): with ``safe_points`` (``ep_rank ->
    ms without a safe point at its last heartbeat``, engines only: :attr:`MemberView.safe_points`) and ``hang_ms`` > 0,
    a rank of ``waited_on`` (the ranks a round waits on, and those already suspected) whose heartbeat is fresh
    but whose last safe point is more than ``hang_ms`` old is stale too, with that age (:func:`hung_of` names
    them). The one staleness rule of fdeplb; nothing else compares an age with a TTL or a deadline."""
    stale = {r: age for r, (age, ttl) in heartbeats.items() if 0 < ttl < age}
    stale.update(hung_of(safe_points or {}, waited_on, hang_ms, exclude=stale))
    if ep_size is not None:
        stale.update({r: NOT_REGISTERED for r in range(int(ep_size)) if r not in heartbeats})
    return dict(sorted(stale.items()))


def hung_of(safe_points: Mapping[int, int], waited_on: Collection[int], hang_ms: int,
            exclude: Collection[int] = ()) -> dict[int, int]:
    """The part of :func:`stale_of` that judges safe points: ``ep_rank -> ms since its last safe point`` for each
    rank of ``waited_on`` (not in ``exclude``) whose last safe point is more than ``hang_ms`` old (``hang_ms``
    <= 0: none)."""
    if hang_ms <= 0:
        return {}
    return {r: age for r, age in safe_points.items() if r in waited_on and r not in exclude and age > hang_ms}


@dataclass(frozen=True)
class Tombstone:
    """An operator's ``cluster delete`` (:meth:`Liveness.tombstone`): who (``operator:<user>``), when (server
    clock, ms) and how many keys it deleted; ``ttl_ms``: how long the tombstone stays."""

    by: str
    at_ms: int
    keys: int
    ttl_ms: int

    def text(self, cluster: str) -> str:
        """One line for a log or stderr."""
        at = datetime.datetime.fromtimestamp(self.at_ms / 1000, datetime.timezone.utc).isoformat(timespec="seconds")
        return (f"cluster {cluster!r} was deleted by {self.by} at {at} ({self.keys} keys); nothing of it is "
                f"written any more (init-cluster makes it anew)")


@dataclass(frozen=True)
class LiveReport:
    """What a rank agent reported holding live after the cluster's records were lost (:meth:`Liveness.report_live`):
    its phy2log (int64 [L, P]), the plan_id it serves ("" the initial placement), its ``agent_id``, the
    report's age and TTL (ms, server clock; stale by :func:`stale_of`), and ``refused``: why the agent does not
    register with the cluster created again ("" while it waits for one; a topology it does not serve)."""

    ep_rank: int
    plan_id: str
    phy2log: np.ndarray
    agent_id: str
    age_ms: int
    ttl_ms: int
    refused: str = ""


@dataclass(frozen=True)
class MemberView:
    """What the leading coordinator observes at every loop pass (:meth:`Liveness.member_view`): the server time,
    every rank's heartbeat (``ep_rank -> (ms since it, TTL ms)``, registered ranks only, as :meth:`heartbeats`) and
    every rank's membership record (ep_rank order; None for a cluster created before membership existed)."""

    now_ms: int
    heartbeats: dict[int, tuple[int, int]]
    members: list[MemberRecord | None]
    safe_points: dict[int, int] = dataclasses.field(default_factory=dict)
    """``ep_rank -> ms from the worker's last safe point to its last heartbeat`` (``heartbeat_ms -
    safe_point_ms``, server clock: a healthy engine shows its step time, however long ago the heartbeat was), of
    every registered rank whose worker is an engine (``safe_point_ms`` > 0); see :func:`stale_of`."""

    def states(self) -> list[MemberState]:
        """Every rank's membership state (ACTIVE where no record exists)."""
        return [MemberState.ACTIVE if m is None else m.state for m in self.members]

    def active(self) -> list[int]:
        """The ACTIVE members, in order: the ranks that count in a round."""
        return [r for r, st in enumerate(self.states()) if st is MemberState.ACTIVE]


class Liveness:
    """The rank registry, heartbeats and switch arming (see the module doc)."""

    def tombstone(self) -> Tombstone | None:
        """The tombstone an operator's ``cluster delete`` left (:meth:`Store.delete_cluster`), or None (none, or it
        expired); :class:`CorruptRecordError` for one that is not its JSON."""
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._keys.deleted)
        pipe.pttl(self._keys.deleted)
        raw, ttl = pipe.execute()
        if raw is None:
            return None
        try:
            info = json.loads(_s(raw))
            return Tombstone(str(info["by"]), int(info["at_ms"]), int(info["keys"]), max(0, int(ttl)))
        except (ValueError, KeyError, TypeError):
            raise CorruptRecordError(f"{self._keys.deleted}: not a tombstone's JSON", key=self._keys.deleted) from None

    def register_rank(self, ep_rank: int, info: dict[str, Any]) -> None:
        """Record ``ep_rank`` in the registry (the only peers ever named in requests) with its address/pid info."""
        self._client.hset(self._keys.ranks, str(int(ep_rank)), json_text(info))

    def report_live(self, ep_rank: int, phy2log: np.ndarray, plan_id: str, *, agent_id: str, ttl_ms: int,
                    refused: str = "") -> None:
        """Report the placement ``ep_rank``'s agent holds live (int [L, P], the plan_id it serves), stamped with
        the server's clock and ``ttl_ms``; the key expires after 3 TTLs (a report nobody renews goes away).
        ``refused``: why the agent refuses the cluster created again (``/health`` names it), "" while it waits."""
        key = self._keys.live(ep_rank)
        now = self.now_ms()
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)), "plan_id": str(plan_id),
                                "agent_id": str(agent_id), "reported_ms": str(now), "ttl_ms": str(int(ttl_ms)),
                                "refused": str(refused)})
        pipe.pexpire(key, 3 * int(ttl_ms))
        pipe.execute()

    def _execute_timed(self, fill: Callable[[Any], None]) -> tuple[list, int]:
        """A pipeline filled by ``fill``, executed with the Redis server's time: (its replies, now in ms). TIME goes in
        the same round trip, except on Redis Cluster, whose pipelines refuse it (then a second one)."""
        timed = not isinstance(self._client, redis.cluster.RedisCluster)
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        if timed:
            pipe.time()
        replies = pipe.execute()
        if not timed:
            return replies, self.now_ms()
        sec, usec = replies.pop()
        return replies, int(sec) * 1000 + int(usec) // 1000

    def live_report_ranks(self) -> list[int]:
        """The ranks that have a live report now, whatever the configuration's ep_size (a SCAN of the cluster's
        ``live:<r>`` keys): ``init-cluster`` refuses to adopt for fewer ranks than report."""
        ranks = []
        for key in self._client.scan_iter(match=self._keys.live_pattern):
            tail = _s(key).rsplit(":", 1)[1]
            if tail.isascii() and tail.isdigit():
                ranks.append(int(tail))
        return sorted(ranks)

    def live_reports(self, ep_size: int) -> dict[int, LiveReport]:
        """The ranks' live reports (:meth:`report_live`) of ranks ``0..ep_size-1``, read at one server time (one
        round trip; two on Redis Cluster). :class:`CorruptRecordError` naming the key of one that does not parse."""
        keys = [self._keys.live(r) for r in range(int(ep_size))]

        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.hgetall(key)

        replies, now = self._execute_timed(fill)
        out = {}
        for r, (key, raw) in enumerate(zip(keys, replies)):
            if not raw:
                continue
            fields = {_s(k): v for k, v in raw.items()}
            try:
                phy2log = arrays.decode("phy2log", fields)
                if phy2log is None:
                    raise InputError("no phy2log")
                out[r] = LiveReport(r, _s(fields.get("plan_id", b"")), phy2log, _s(fields.get("agent_id", b"")),
                                    max(0, now - int(_s(fields.get("reported_ms", b"0")))),
                                    int(_s(fields.get("ttl_ms", b"0"))), _s(fields.get("refused", b"")))
            except (InputError, ValueError) as exc:
                raise CorruptRecordError(f"{key}: not a live report: {exc}", key=key) from None
        return out

    def mark_rank_stopped(self, ep_rank: int, agent_id: str) -> bool:
        """Note in ``ep_rank``'s registry entry that its agent ``agent_id`` stopped (``stopped_ms``, server clock),
        if the entry still names it (WATCHed: an agent registered meanwhile is left alone); True if written. A
        stopped agent is not a live one: the next agent of the rank needs no ``replace``."""
        key, field_ = self._keys.ranks, str(int(ep_rank))

        def txn(pipe: Any) -> bool:
            raw = pipe.hget(key, field_)
            try:
                info = json.loads(_s(raw)) if raw is not None else None
            except ValueError:
                info = None
            if not isinstance(info, dict) or info.get("agent_id") != agent_id:
                pipe.unwatch()
                return False
            sec, _ = pipe.time()
            pipe.multi()
            pipe.hset(key, field_, json_text({**info, "stopped_ms": int(sec) * 1000}))
            return True

        return bool(transaction(self._client, txn, key, value_from_callable=True))

    def rank_agent(self, ep_rank: int) -> str | None:
        """The ``agent_id`` the registry names for ``ep_rank`` (the agent that registered last), or None;
        :class:`CorruptRecordError` for an entry that is not a rank's JSON."""
        raw = self._client.hget(self._keys.ranks, str(int(ep_rank)))
        if raw is None:
            return None
        try:
            info = json.loads(_s(raw))
        except ValueError:
            raise CorruptRecordError(f"{self._keys.ranks}: entry {int(ep_rank)} is not a rank's JSON") from None
        agent = info.get("agent_id") if isinstance(info, dict) else None
        return None if agent is None else str(agent)

    def rank_info(self) -> dict[int, dict[str, Any]]:
        """Registered ranks and their info; :class:`CorruptRecordError` for an entry that is not a JSON object
        under a rank number."""
        out = {}
        for k, v in _hgetall(self._client, self._keys.ranks).items():
            try:
                out[int(_s(k))] = info = json.loads(_s(v))
                if not isinstance(info, dict):
                    raise ValueError(type(info).__name__)
            except ValueError:
                raise CorruptRecordError(f"{self._keys.ranks}: entry {_s(k)!r} is not a rank's JSON",
                                         key=self._keys.ranks) from None
        return out

    def heartbeats(self) -> dict[int, tuple[int, int]]:
        """Registered ranks' heartbeats, read at one server time: ``ep_rank -> (ms since the heartbeat, its TTL in
        ms)`` (TTL 0: the agent wrote none, never stale). Unregistered ranks are left out."""
        registered = self.rank_info()
        if not registered:
            return {}
        now = self.now_ms()
        return {r: (max(0, now - rec.heartbeat_ms), rec.heartbeat_ttl_ms)
                for r, rec in enumerate(self.read_all(RANK)) if r in registered}

    def member_view(self) -> MemberView:
        """The registry, the server time, every rank's heartbeat fields and membership record in one round trip
        (two on Redis Cluster, whose pipelines refuse TIME). :class:`CorruptRecordError` for a registry field or
        a member record that does not parse; a rank whose heartbeat fields do not parse is left out of the
        heartbeats (not observed: its rank record's readers report it)."""
        n = self.ep_size()
        members = [self._keys.member(r) for r in range(n)]

        def fill(pipe: Any) -> None:
            pipe.hkeys(self._keys.ranks)
            for r in range(n):
                pipe.hmget(self._keys.rank(r), "heartbeat_ms", "heartbeat_ttl_ms", "safe_point_ms")
            for key in members:
                pipe.hgetall(key)

        with _typed(self._keys.ranks):
            replies, now = self._execute_timed(fill)
        try:
            registered = {int(_s(k)) for k in replies[0]}
        except ValueError:
            raise CorruptRecordError(f"{self._keys.ranks}: a field is not a rank number", key=self._keys.ranks) from None
        beats, safe_points = {}, {}
        for r, (hb, ttl, safe_point) in enumerate(replies[1:1 + n]):
            if r not in registered:
                continue
            try:
                beats[r] = (max(0, now - int(_s(hb) or 0)), int(_s(ttl) or 0))
                if int(_s(safe_point) or 0) > 0:  # as the heartbeat saw it: a healthy engine is never behind
                    safe_points[r] = max(0, int(_s(hb) or 0) - int(_s(safe_point)))
            except ValueError:  # not observed: the rank record's own readers report it corrupt
                continue
        parsed = self._parse_records([(MEMBERSHIP, r) for r in range(n)], members, replies[1 + n:])
        for rec in parsed:
            if isinstance(rec, CorruptRecordError):
                raise rec
        return MemberView(now, beats, parsed, safe_points)

    def stale_ranks(self) -> dict[int, int]:
        """Registered ranks whose heartbeat expired: ``ep_rank -> ms since the heartbeat``. A rank is stale once
        ``heartbeat_ms + heartbeat_ttl_ms`` lies in the past (server clock); a rank that never wrote a TTL, or
        is not registered, is never stale (:meth:`heartbeats`)."""
        return stale_of(self.heartbeats())

    def arm_switch(self, ep_rank: int, armed: str, step: int, field: str, current: dict[str, Any],
                   margin: int = SWITCH_MARGIN_STEPS, withdrawn: dict[str, Any] | None = None, *,
                   chunks: tuple[int, ...] = (), chunks_field: str = "") -> SwitchStep:
        """One safe point of an armed rank (``lua/switch.lua``, atomic): publish ``ep_rank``'s step counter
        (``armed_step``) armed for the change ``armed`` (e.g. ``"swap:<round>:<plan_id>"``), then return the
        change's switch step, kept in the cluster-record ``field`` (``switch_step`` / ``weights_switch_step``).

        The first call that finds every rank armed for ``armed`` fixes it: ``max(armed_step) + margin``. Since an
        armed rank calls this at every safe point, a rank whose last call published step s calls again at step
        s + 1 <= switch step: no armed rank passes the switch step without having read it (``margin`` >= 1).
        ``current``: cluster-record fields (name -> value) that identify the change while it is the cluster's
        current one (e.g. ``{"state": "SWAPPING", "round": 3, "plan_id": ...}``).

        ``withdrawn``: cluster-record fields (name -> value) that hold these values once the change was withdrawn
        (a cancelled weight request: ``{"weights_cancelled": n}``, see :meth:`Store.cancel_weights`).

        ``chunks``: this rank's chunk layout of the change (the first layer of each chunk, ascending, see
        :func:`fdeplb.weights.plan.chunk_starts`), published as the rank record's ``armed_chunks``;
        ``chunks_field``: the cluster-record field (``switch_chunks``) in which the call that fixes the switch step
        also fixes the layout every rank applies: the union of the armed ranks' layouts.

        Returns a :class:`SwitchStep` (switch step, status, fixed layout): ``"fixed"`` (by this call), ``"set"``
        (before), ``"waiting"`` (a rank is not armed yet; 0), ``"gone"`` (``current`` no longer holds; 0, nothing
        fixed), ``"cancelled"`` (``withdrawn`` holds; 0, nothing written). :class:`InputError` for a margin < 1,
        a negative step or an unknown field."""
        if int(margin) < 1 or int(step) < 0:
            raise InputError(f"arm_switch needs margin >= 1 and step >= 0, got margin={margin} step={step}")
        withdrawn = withdrawn or {}
        unknown = [name for name in (field, *current, *withdrawn, *([chunks_field] if chunks_field else []))
                   if name not in _CLUSTER_FIELDS]
        if unknown:
            raise InputError(f"ClusterRecord has no field(s) {unknown}")
        current = {k: v.value if isinstance(v, StateEnum) else str(v) for k, v in current.items()}
        call = switch_call(self._keys, ep_rank=ep_rank, ep_size=self.ep_size(), armed=armed, step=step,
                           field=field, current=current, margin=margin,
                           withdrawn={k: str(v) for k, v in withdrawn.items()}, chunks=tuple(chunks),
                           chunks_field=chunks_field)
        switch, status, layout = self._switch(keys=call.keys, args=call.args)
        return SwitchStep(int(switch), _s(status), parse_chunks(_s(layout)))
