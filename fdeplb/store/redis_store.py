"""The Redis store: the only module of fdeplb that imports ``redis``.

It reads records, commits transitions through ``lua/commit.lua`` (state + version + fence checked, guards across
records checked, record written and audit appended, all in one atomic step), and keeps the arrays (loads, plans,
placement) as dtype + shape + raw bytes.

Clients are created without retries and with a socket timeout longer than any ``XREAD BLOCK`` we issue: a commit
whose reply was lost is *not* re-sent (the caller re-reads the record and sees what happened), and blocking reads are
not cut short by redis-py's 5 s default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Iterator

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fdeplb.errors import (
    FenceError,
    GuardError,
    InputError,
    NotFoundError,
    RedisUnavailableError,
    StaleStateError,
)
from fdeplb.machines.tables import MachineTable, TransitionSpec
from fdeplb.store import arrays
from fdeplb.store.keys import Keys

#: longest XREAD BLOCK any fdeplb waiter issues (ms); the socket timeout is set well above it.
MAX_BLOCK_MS = 2_000
SOCKET_TIMEOUT_S = 30.0

#: audit fields, in the order they are written (DESIGN.md section 4); version, fence and ts_ms come from the script.
AUDIT_FIELDS = ("machine", "key", "from", "to", "trigger", "actor", "round", "plan_id", "reason")


def connect(url: str) -> redis.Redis:
    """A redis-py client for ``url`` (``redis://``, ``rediss://`` or ``unix://``), bytes replies, no retries."""
    if not isinstance(url, str) or "://" not in url:
        raise InputError(f"not a Redis URL: {url!r} (expected redis://host:port/db or unix:///path)")
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=10.0,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
    except ValueError as exc:  # redis-py's URL parser
        raise InputError(f"bad Redis URL {url!r}: {exc}") from None


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else ("" if value is None else str(value))


@dataclass(frozen=True)
class Record:
    """One machine record as read from Redis: ``state``, ``version`` and every other field as text."""

    key: str
    state: str
    version: int
    fields: dict[str, str] = field(default_factory=dict)

    def get(self, name: str, default: str = "") -> str:
        return self.fields.get(name, default)

    def get_int(self, name: str, default: int = 0) -> int:
        v = self.fields.get(name, "")
        return int(v) if v not in ("", None) else default


@dataclass(frozen=True)
class CommitResult:
    """A committed transition: the record's new version, the audit entry id and the server time (ms)."""

    version: int
    audit_id: str
    ts_ms: int


@dataclass(frozen=True)
class AuditRecord:
    """One audit stream entry; ``fields`` holds every field as text (see DESIGN.md section 4)."""

    id: str
    fields: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.fields.get(name, "")


class Store:
    """All Redis access of one cluster. Thread-safe as far as redis-py's connection pool is."""

    #: errors meaning "Redis did not answer" (for retry loops outside this module, which never import redis)
    connection_errors: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)

    def __init__(self, client: redis.Redis | str, cluster: str) -> None:
        self.url = client if isinstance(client, str) else repr(client)
        self.client = connect(client) if isinstance(client, str) else client
        self.keys = Keys(cluster)
        self.cluster = cluster
        self._ep_size: int | None = None
        lua = resources.files("fdeplb.store") / "lua"
        self._commit = self.client.register_script((lua / "commit.lua").read_text())
        self._lease = self.client.register_script((lua / "lease.lua").read_text())

    def ping(self) -> None:
        """Check the server answers; :class:`RedisUnavailableError` (refused, unknown host, timeout, auth) if not."""
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"cannot reach Redis at {self.url}: {exc}") from None

    # ---- records ------------------------------------------------------------------------------------------------
    def record_key(self, table: MachineTable, index: int | None = None) -> str:
        """Key of ``table``'s record (``index`` = ep_rank for rank and weights records)."""
        if table.name == "cluster":
            return self.keys.rearrange
        if index is None:
            raise InputError(f"{table.name} records need an ep_rank")
        return self.keys.rank(index) if table.name == "rank" else self.keys.weights(index)

    def ensure_record(self, key: str, initial: str) -> bool:
        """Create the record in ``initial`` state at version 0 unless it exists (both fields in one MULTI, so a
        crash cannot leave a record without a version); True if created."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, "state", initial)
        pipe.hsetnx(key, "version", "0")
        created, _ = pipe.execute()
        return bool(created)

    def read_record(self, key: str) -> Record:
        """The record at ``key``; :class:`NotFoundError` if it does not exist."""
        raw = self.client.hgetall(key)
        if not raw:
            raise NotFoundError(f"no record at {key}")
        fields = {_s(k): _s(v) for k, v in raw.items()}
        return Record(key=key, state=fields.pop("state", ""), version=int(fields.pop("version", "0")), fields=fields)

    def commit(
        self,
        table: MachineTable,
        spec: TransitionSpec,
        record: Record,
        *,
        actor: str,
        fence: str = "",
        plan_id: str = "",
        round_: int | None = None,
        reason: str = "",
        fields: dict[str, Any] | None = None,
        label: str | None = None,
    ) -> CommitResult:
        """Commit ``spec`` (a transition of ``table``) on ``record`` atomically with its audit record.

        ``plan_id`` is the plan the transition concerns (guards with ``same_plan`` compare against it); ``fields``
        are extra record fields written in the same step. Raises :class:`FenceError` (lease not held),
        :class:`StaleStateError` (record changed since read) or :class:`GuardError` (a guard refused); Redis is
        unchanged then.
        """
        round_ = record.get_int("round") if round_ is None else round_
        guard_keys: list[str] = []
        guards: list[dict[str, Any]] = []
        ranks = range(self.ep_size()) if any(g.kind in ("ranks_in", "weights_in") for g in spec.guards) else []
        for g in spec.guards:
            entry: dict[str, Any] = {"kind": g.kind, "state": g.state, "states": list(g.states),
                                     "plan_id": plan_id if g.same_plan or g.kind == "plan_not_current" else "",
                                     "first": 0, "count": 0}
            if g.kind in ("ranks_in", "weights_in"):
                entry["first"] = 7 + len(guard_keys)
                entry["count"] = len(ranks)
                make = self.keys.rank if g.kind == "ranks_in" else self.keys.weights
                guard_keys.extend(make(r) for r in ranks)
            guards.append(entry)
        audit = {
            "machine": table.name, "key": label or record.key, "from": record.state, "to": spec.dest,
            "trigger": spec.trigger, "actor": actor, "round": str(round_), "plan_id": plan_id, "reason": reason,
        }
        extra = {k: _s(v) if not isinstance(v, (int, float)) else str(v) for k, v in (fields or {}).items()}
        keys = [record.key, self.keys.audit, self.keys.lease, self.keys.rearrange, self.keys.placement,
                self.keys.plan(plan_id or "_none"), *guard_keys]
        args = [
            record.state, str(record.version), fence, spec.dest,
            json.dumps([x for kv in extra.items() for x in kv]),
            json.dumps([x for k in AUDIT_FIELDS for x in (k, audit[k])]),
            json.dumps(guards), spec.effect,
        ]
        reply = self._commit(keys=keys, args=args)
        status = _s(reply[0])
        if status == "OK":
            return CommitResult(version=int(_s(reply[1])), audit_id=_s(reply[2]), ts_ms=int(_s(reply[3])))
        detail = f"{table.name} {spec.trigger} on {label or record.key}: {_s(reply[1])}"
        if status == "ERR_FENCE":
            raise FenceError(detail)
        if status == "ERR_GUARD":
            raise GuardError(detail)
        raise StaleStateError(detail)

    # ---- cluster setup and ranks --------------------------------------------------------------------------------
    def create_cluster(self, config: dict[str, Any], phy2log: np.ndarray, records: list[tuple[str, str]]) -> bool:
        """Write a new cluster in one MULTI/EXEC: its configuration, the initial placement (plan_id "") and each
        ``(key, initial state)`` record at version 0. Returns False, writing nothing, if the cluster's
        configuration exists already (WATCHed, so two creators cannot both win)."""
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    if pipe.exists(self.keys.config):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.delete(self.keys.placement, *(key for key, _ in records))  # leftovers of a stray write
                    pipe.hset(self.keys.placement,
                              mapping={**arrays.encode("phy2log", phy2log), "plan_id": "", "version": "0"})
                    for key, initial in records:
                        pipe.hset(key, mapping={"state": initial, "version": "0"})
                    pipe.hset(self.keys.config, mapping={k: json.dumps(v) for k, v in config.items()})
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def read_config(self) -> dict[str, Any]:
        """The cluster configuration; :class:`NotFoundError` if the cluster was never initialised."""
        raw = self.client.hgetall(self.keys.config)
        if not raw:
            raise NotFoundError(f"cluster {self.cluster!r} is not initialised (no {self.keys.config})")
        try:
            return {_s(k): json.loads(_s(v)) for k, v in raw.items()}
        except json.JSONDecodeError as exc:
            raise InputError(f"cluster {self.cluster!r}: corrupt configuration at {self.keys.config}: {exc}") from None

    def ep_size(self) -> int:
        """Number of EP ranks of the cluster (from its configuration; cached, it never changes)."""
        if self._ep_size is None:
            self._ep_size = int(self.read_config()["ep_size"])
        return self._ep_size

    def register_rank(self, ep_rank: int, info: dict[str, Any]) -> None:
        """Record ``ep_rank`` in the registry (the only peers ever contacted) with its address/pid info."""
        self.client.hset(self.keys.ranks, str(int(ep_rank)), json.dumps(info, sort_keys=True))

    def rank_info(self) -> dict[int, dict[str, Any]]:
        """Registered ranks and their info."""
        return {int(_s(k)): json.loads(_s(v)) for k, v in self.client.hgetall(self.keys.ranks).items()}

    def set_fields(self, key: str, fields: dict[str, Any]) -> None:
        """Write non-state fields of a record (heartbeat, diagnostics). Never used for state or version."""
        if {"state", "version"} & set(fields):
            raise InputError("state and version are written only by commits")
        self.client.hset(key, mapping={k: _s(v) if not isinstance(v, (int, float)) else str(v)
                                       for k, v in fields.items()})

    # ---- arrays: loads, snapshots, plans, placement -------------------------------------------------------------
    def put_arrays(self, key: str, named: dict[str, np.ndarray], extra: dict[str, Any] | None = None,
                   *, only_if_absent: bool = False) -> bool:
        """Write arrays (and text fields) into the hash ``key`` in one MULTI. With ``only_if_absent`` nothing is
        written if the key exists (write-once objects such as plans and snapshots); returns whether it wrote."""
        mapping: dict[str, Any] = {}
        for name, arr in named.items():
            mapping.update(arrays.encode(name, arr))
        for k, v in (extra or {}).items():
            mapping[k] = v if isinstance(v, bytes) else str(v)
        if only_if_absent:
            with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(key)
                        if pipe.exists(key):
                            pipe.unwatch()
                            return False
                        pipe.multi()
                        pipe.hset(key, mapping=mapping)
                        pipe.execute()
                        return True
                    except redis.WatchError:
                        continue
        self.client.hset(key, mapping=mapping)
        return True

    def get_hash(self, key: str) -> dict[str, bytes]:
        """Every field of a hash, keys as text, values as bytes (empty dict if absent)."""
        return {_s(k): v for k, v in self.client.hgetall(key).items()}

    def get_array(self, key: str, name: str) -> np.ndarray | None:
        """One array stored in hash ``key``, or None."""
        fields = self.client.hmget(key, [name, f"{name}:dtype", f"{name}:shape"])
        if fields[0] is None:
            return None
        return arrays.decode(name, {name: fields[0], f"{name}:dtype": fields[1], f"{name}:shape": fields[2]})

    def current_placement(self) -> tuple[str, np.ndarray]:
        """(plan_id, phy2log int64 [L, P]) of the cluster's current placement ('' = initial placement)."""
        raw = self.get_hash(self.keys.placement)
        phy2log = arrays.decode("phy2log", raw)
        if phy2log is None:
            raise NotFoundError(f"cluster {self.cluster!r} has no current placement")
        return _s(raw.get("plan_id", b"")), phy2log

    # ---- lease ---------------------------------------------------------------------------------------------------
    def acquire_lease(self, holder: str, ttl_ms: int) -> str | None:
        """Take the coordinator lease if free; returns the lease value ``<fence>:<holder>`` (the fencing token)."""
        value = self._lease(keys=[self.keys.lease, self.keys.fence], args=["acquire", holder, int(ttl_ms)])
        return _s(value) if value else None

    def renew_lease(self, value: str, ttl_ms: int) -> bool:
        """Extend the lease if ``value`` still holds it; False means the lease was lost."""
        return bool(self._lease(keys=[self.keys.lease, self.keys.fence], args=["renew", value, int(ttl_ms)]))

    def release_lease(self, value: str) -> bool:
        """Give the lease back if ``value`` still holds it."""
        return bool(self._lease(keys=[self.keys.lease, self.keys.fence], args=["release", value, 0]))

    def lease_holder(self) -> str | None:
        v = self.client.get(self.keys.lease)
        return _s(v) if v else None

    # ---- time, audit and events ---------------------------------------------------------------------------------
    def now_ms(self) -> int:
        """The Redis server's clock in ms (deadlines are compared against it, never a local clock)."""
        sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    def append_alarm(self, record: Record, *, actor: str, reason: str) -> str:
        """Append an alarm to the audit stream: ``trigger`` = ``alarm``, ``from`` = ``to`` = the record's state and
        its current ``version`` (not a transition: replays skip it; the record is unchanged)."""
        fields = {"machine": "cluster", "key": "cluster", "from": record.state, "to": record.state,
                  "trigger": "alarm", "actor": actor, "round": record.get("round"),
                  "plan_id": record.get("plan_id"), "reason": reason, "version": str(record.version),
                  "fence": "", "ts_ms": str(self.now_ms())}
        return _s(self.client.xadd(self.keys.audit, fields))

    def emit_event(self, kind: str, **fields: Any) -> str:
        """Append a wake-up event (not a transition) to the capped events stream."""
        body = {"kind": kind, **{k: str(v) for k, v in fields.items()}}
        return _s(self.client.xadd(self.keys.events, body, maxlen=10_000, approximate=True))

    def last_ids(self) -> dict[str, str]:
        """Latest ids of the audit and events streams ('0-0' when empty): where a new waiter starts reading."""
        out = {}
        for key in (self.keys.audit, self.keys.events):
            last = self.client.xrevrange(key, count=1)
            out[key] = _s(last[0][0]) if last else "0-0"
        return out

    def wait(self, cursor: dict[str, str], block_ms: int) -> list[tuple[str, AuditRecord]]:
        """Block until a new audit or event entry appears after ``cursor`` (updated in place) or ``block_ms``.

        Returns ``(stream_key, entry)`` pairs. ``XREAD BLOCK`` from the last seen id, so nothing is lost across
        reconnects (unlike pub/sub).
        """
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        reply = self.client.xread(cursor, block=block, count=1000) or []
        out = []
        for stream, entries in reply:
            stream = _s(stream)
            for entry_id, raw in entries:
                cursor[stream] = _s(entry_id)
                out.append((stream, AuditRecord(_s(entry_id), {_s(k): _s(v) for k, v in raw.items()})))
        return out

    def audit(self, start: str = "-", end: str = "+", count: int | None = None) -> list[AuditRecord]:
        """Audit records between stream ids ``start`` and ``end``, oldest first."""
        return [AuditRecord(_s(i), {_s(k): _s(v) for k, v in raw.items()})
                for i, raw in self.client.xrange(self.keys.audit, start, end, count=count)]

    def iter_audit(self, batch: int = 1000) -> Iterator[AuditRecord]:
        """Every audit record, oldest first, in batches."""
        start = "-"
        while True:
            chunk = self.audit(start, "+", count=batch)
            yield from chunk
            if len(chunk) < batch:
                return
            start = "(" + chunk[-1].id

    def delete_cluster(self) -> int:
        """Delete every key of this cluster (tests and demo clean-up)."""
        keys = list(self.client.scan_iter(match=f"{self.keys.prefix.replace('{', '[{]').replace('}', '[}]')}:*"))
        return int(self.client.delete(*keys)) if keys else 0
