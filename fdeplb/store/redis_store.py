"""The Redis store: the only module of fdeplb that talks to Redis, and the boundary of its errors.

It reads and writes the typed records of :mod:`fdeplb.store.records`, commits transitions through
``lua/commit.lua`` (state + version + fence checked, guards across records checked, record written and audit
appended, all in one atomic step), and keeps the arrays (loads, snapshots, plans, placement) as dtype + shape + raw
bytes. Callers never see a key, a field name or a redis-py exception: every public method maps redis-py's errors to
fdeplb's once, here (:func:`_redis_errors`, the pattern of httpx's ``map_httpcore_exceptions``):

- connection refused / reset / timed out, authentication: :class:`~fdeplb.errors.RedisUnavailableError`;
- any other server error: :class:`~fdeplb.errors.StoreError`;
- a stored value fdeplb cannot parse: :class:`~fdeplb.errors.CorruptRecordError` naming the key and field; so is a
  key of another Redis type than fdeplb keeps there (``WRONGTYPE``: another program wrote it) where fdeplb reads a
  record, the registry, a load window, a snapshot, a plan, the placement or the audit stream.

Clients are created without retries and with a socket timeout longer than any ``XREAD BLOCK`` we issue: a commit
whose reply was lost is *not* re-sent (the caller re-reads the record and sees what happened), and blocking reads are
not cut short by redis-py's 5 s default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fdeplb.errors import (
    CorruptRecordError,
    FenceError,
    GuardError,
    InputError,
    NotFoundError,
    RedisUnavailableError,
    StaleStateError,
    StateError,
    StoreError,
)
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, ClusterState, MachineTable, RankState, StateEnum, \
    TransitionSpec, WeightState
from fdeplb.placement import MAX_LOAD, check_counts, routing_digest
from fdeplb.store import arrays
from fdeplb.store.keys import Keys
from fdeplb.store.records import (
    ClusterConfig,
    ClusterRecord,
    LeaseInfo,
    LoadWindow,
    PlacementEntry,
    PlanEntry,
    RankRecord,
    WeightRecord,
    check_request_reason,
    encode_changes,
    json_text,
    parse_record,
    record_type,
)
from fdeplb.store.scripts import SIGNAL_MAXLEN, CommitCall, audit_call, commit_call, lease_call, publish_call, \
    script_text, switch_call

#: longest XREAD BLOCK any fdeplb waiter issues (ms); the socket timeout is set well above it.
MAX_BLOCK_MS = 2_000
SOCKET_TIMEOUT_S = 30.0

#: audit fields, in the order they are written (DESIGN.md section 4); version, fence and ts_ms come from the script.
AUDIT_FIELDS = ("machine", "key", "from", "to", "trigger", "actor", "round", "plan_id", "reason")

#: default margin of a switch step (:meth:`Store.arm_switch`): steps past the largest armed step (>= 1 is safe)
SWITCH_MARGIN_STEPS = 2

#: the cluster record's field names (what :meth:`Store.arm_switch` may name)
_CLUSTER_FIELDS = frozenset(f.name for f in dataclasses.fields(ClusterRecord))

#: events kept in the capped wake-up stream
EVENTS_MAXLEN = 10_000

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def _redis_errors(url: str) -> Iterator[None]:
    """Map redis-py's exceptions to fdeplb's (see the module doc)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # AuthenticationError is a ConnectionError
        raise RedisUnavailableError(f"Redis at {url} is unavailable: {exc}") from None
    except redis.ResponseError as exc:
        raise StoreError(f"Redis at {url} refused a command: {exc}") from None
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise StoreError(f"Redis client error ({url}): {exc}") from None


def _wrong_type(key: str, exc: Exception) -> CorruptRecordError | None:
    """The :class:`CorruptRecordError` naming ``key`` when ``exc`` is Redis's WRONGTYPE (another program wrote a
    value of another type there), else None."""
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE"):
        return CorruptRecordError(f"{key}: is not of the Redis type fdeplb keeps there (WRONGTYPE)", key=key)
    return None


def _raise(exc: Exception) -> Any:
    raise exc


@contextlib.contextmanager
def _typed(key: str) -> Iterator[None]:
    """Commands on ``key`` inside: WRONGTYPE becomes :class:`CorruptRecordError` naming ``key`` (:func:`_wrong_type`);
    other Redis errors pass on to :func:`_redis_errors`."""
    try:
        yield
    except redis.ResponseError as exc:
        raise _wrong_type(key, exc) or exc from None


def _hgetall(client: Any, key: str) -> dict:
    """``HGETALL key`` on a client (or a WATCHing pipeline), as :func:`_typed`."""
    with _typed(key):
        return client.hgetall(key)


def _mapped(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: "Store", *args: Any, **kwargs: Any) -> Any:
        with _redis_errors(self.url):
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _map_public_methods(cls: type) -> type:
    """Wrap every public method of ``cls`` in :func:`_redis_errors` (the one boundary)."""
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and callable(value) and not isinstance(value, (staticmethod, classmethod, type)):
            setattr(cls, name, _mapped(value))
    return cls


def _host_ports(netloc: str, url: str) -> list[tuple[str, int]]:
    out = []
    for part in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"bad Redis URL {url!r}: expected host:port[,host:port...], got {part!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def connect(url: str) -> Any:
    """A redis-py client for ``url``, bytes replies, no retries of a sent command. Accepted forms:

    - ``redis://host:port/db``, ``rediss://...``, ``unix:///path``: one server;
    - ``redis+cluster://host:port[,host:port...]`` (or ``redis://host:port/?cluster=1``): a Redis Cluster, any of
      its nodes as the seed (redis-py's ``RedisCluster``; every fdeplb script's keys share the ``{cluster}`` slot);
    - ``redis+sentinel://host:port[,host:port...]/master_name[/db]``: the master that Sentinel names, looked up
      again after a failover (redis-py's ``Sentinel.master_for``).

    Raises :class:`InputError` for a malformed URL (nothing connects until the first command).
    """
    from urllib.parse import parse_qs, urlsplit

    forms = "redis://host:port/db, rediss://..., unix:///path, redis+cluster://host:port or " \
            "redis+sentinel://host:port/master"
    if not isinstance(url, str) or "://" not in url:
        raise InputError(f"not a Redis URL: {url!r} (expected {forms})")
    opts = dict(socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10.0, decode_responses=False)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel",
                            "rediss+sentinel"):
        raise InputError(f"bad Redis URL {url!r}: unknown scheme {parts.scheme!r} (accepted: {forms})")
    query = parse_qs(parts.query)
    try:
        if parts.scheme in ("redis+cluster", "rediss+cluster") or query.get("cluster", ["0"])[0] in ("1", "true"):
            from redis.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h, p) for h, p in _host_ports(parts.netloc, url)]
            return RedisCluster(startup_nodes=nodes, ssl=parts.scheme.startswith("rediss"),
                                password=parts.password, username=parts.username or None, **opts)
        if parts.scheme in ("redis+sentinel", "rediss+sentinel"):
            from redis.sentinel import Sentinel

            path = [x for x in parts.path.split("/") if x]
            if not path:
                raise InputError(f"bad Redis URL {url!r}: name the master, redis+sentinel://host:port/master")
            sentinel = Sentinel(_host_ports(parts.netloc, url), socket_timeout=5.0, socket_connect_timeout=5.0)
            return sentinel.master_for(path[0], db=int(path[1]) if len(path) > 1 else 0,
                                       password=parts.password, retry=Retry(NoBackoff(), 0), **opts)
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **opts)
    except ValueError as exc:  # redis-py's URL parser, a port that is not a number
        raise InputError(f"bad Redis URL {url!r}: {exc}") from None


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else ("" if value is None else str(value))


def _text(raw: dict) -> dict[str, str]:
    try:  # replies are bytes (decode_responses=False): the direct decode is the hot path of every record read
        return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
    except AttributeError:
        return {_s(k): _s(v) for k, v in raw.items()}


@dataclass(frozen=True)
class CommitResult:
    """A committed transition: the record's new version, the audit entry id and the server time (ms)."""

    version: int
    audit_id: str
    ts_ms: int


@dataclass(frozen=True)
class AuditRecord:
    """One audit (or events) stream entry; ``fields`` holds every field as text (see DESIGN.md section 4)."""

    id: str
    fields: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.fields.get(name, "")


#: an XREAD position per stream, opaque to callers: :meth:`Store.cursor` makes one, :meth:`Store.wait` moves it.
Cursor = dict


@dataclass(frozen=True)
class PendingCall:
    """One Redis call laid out now and sent later in a pipeline with others: before the ``XREAD`` of the next
    :meth:`Store.wait_view` (a rank agent's step's last write then costs no round trip of its own, and is in
    Redis before the agent blocks), or with the calls :meth:`Store.send` is given (a commit and a read that do not
    depend on each other: one round trip). Made by :meth:`Store.deferred_commit`, :meth:`Store.deferred_publish`
    and :meth:`Store.deferred_plan_read` (issue #9).

    Nothing is known to be done until the pipeline returns the call's outcome (the value, or the typed error the
    immediate call would raise); a round trip that fails (Redis unavailable) leaves it unknown, and the reconcile
    loop's next step does the work again (every such write is idempotent or version-checked)."""

    what: str
    """What the call is, for logs and errors (``rank stage on rank:3``, ``load window of rank 3``)."""
    queue: Callable[[Any], Any]
    """Adds the call, one command, to a redis-py pipeline."""
    outcome: Callable[[Any], Any]
    """The command's reply (a redis-py exception object where it failed) -> the call's result; raises the typed
    error of a refusal."""
    then: Callable[[Any], None] | None = None
    """Called with the result once the call succeeded (e.g. a handle remembering the record a commit left)."""


@_map_public_methods
class Store:
    """All Redis access of one cluster. Thread-safe as far as redis-py's connection pool is.

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix:///path``.
        cluster: cluster id, ``[A-Za-z0-9_.-]{1,64}``.

    Raises:
        InputError: a malformed URL or cluster id. Nothing connects until the first call.
    """

    def __init__(self, url: str, cluster: str) -> None:
        self.url = url
        self._client = connect(url)
        self._keys = Keys(cluster)
        self.cluster = cluster
        self._config: ClusterConfig | None = None
        self._commit = self._client.register_script(script_text("commit"))
        self._lease = self._client.register_script(script_text("lease"))
        self._append = self._client.register_script(script_text("audit"))
        self._switch = self._client.register_script(script_text("switch"))
        self._publish = self._client.register_script(script_text("publish"))
        self._loaded: set[str] = set()  # scripts this store loaded for calls sent in pipelines (EVALSHA)

    def ping(self) -> None:
        """Check the server answers; :class:`RedisUnavailableError` (refused, unknown host, timeout, auth) if not."""
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"cannot reach Redis at {self.url}: {exc}") from None

    def close(self) -> None:
        """Close the client's connections (the store can still be used: they reopen on demand)."""
        self._client.close()

    # ---- machine records ------------------------------------------------------------------------------------------
    def _record_key(self, table: MachineTable, ep_rank: int | None) -> str:
        if table is CLUSTER:
            return self._keys.rearrange
        if ep_rank is None:
            raise InputError(f"{table.name} records need an ep_rank")
        return self._keys.rank(ep_rank) if table is RANK else self._keys.weights(ep_rank)

    def read(self, table: MachineTable, ep_rank: int | None = None) -> Any:
        """The record of ``table`` (of ``ep_rank`` for rank and weights records), typed
        (:class:`ClusterRecord` / :class:`RankRecord` / :class:`WeightRecord`). :class:`NotFoundError` if it does
        not exist, :class:`CorruptRecordError` if it does not parse."""
        key = self._record_key(table, ep_rank)
        return self._record(table, key, _hgetall(self._client, key))

    @staticmethod
    def _record(table: MachineTable, key: str, raw: dict) -> Any:
        """``raw`` (HGETALL of ``key``) as a typed record of ``table``; errors as :meth:`read`."""
        if not raw:
            raise NotFoundError(f"no {table.name} record at {key}")
        return parse_record(record_type(table), key, _text(raw))

    def read_cluster(self) -> ClusterRecord:
        """The cluster rearrangement record."""
        return self.read(CLUSTER)

    def read_cluster_at(self) -> tuple[ClusterRecord, int]:
        """The cluster record and the server's clock (ms) when it was read, in one round trip (the coordinator
        compares the round's deadline with that time; two round trips on Redis Cluster, whose pipelines refuse
        keyless commands such as TIME). Errors as :meth:`read`."""
        if isinstance(self._client, redis.cluster.RedisCluster):
            return self.read(CLUSTER), self.now_ms()
        key = self._record_key(CLUSTER, None)
        pipe = self._client.pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.time()
        with _typed(key):
            raw, (sec, usec) = pipe.execute()
        return self._record(CLUSTER, key, raw), int(sec) * 1000 + int(usec) // 1000

    def read_rank(self, ep_rank: int) -> RankRecord:
        """The rank record of ``ep_rank``."""
        return self.read(RANK, ep_rank)

    def read_weights(self, ep_rank: int) -> WeightRecord:
        """The weight-status record of ``ep_rank``."""
        return self.read(WEIGHTS, ep_rank)

    def _read_records(self, which: list[tuple[MachineTable, int | None]]) -> list[Any]:
        """The records ``which`` names ((table, ep_rank) pairs), in one round trip, each typed, or None where it does
        not exist, or its :class:`CorruptRecordError` where it does not parse (returned, not raised)."""
        keys = [self._record_key(table, r) for table, r in which]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        return self._parse_records(which, keys, pipe.execute(raise_on_error=False))

    @staticmethod
    def _parse_records(which: list[tuple[MachineTable, int | None]], keys: list[str], raws: list[Any]) -> list[Any]:
        out: list[Any] = []
        for (table, _), key, raw in zip(which, keys, raws):
            if isinstance(raw, Exception):  # WRONGTYPE: the record's error; anything else: raised as before
                out.append(_wrong_type(key, raw) or _raise(raw))
                continue
            try:
                out.append(parse_record(record_type(table), key, _text(raw)) if raw else None)
            except CorruptRecordError as err:
                out.append(err)
        return out

    def _strict(self, which: list[tuple[MachineTable, int | None]], out: list[Any] | None = None) -> list[Any]:
        """:meth:`_read_records` (or ``out``, records already read), raising for the first record (in ``which``'s
        order) that is missing (:class:`NotFoundError`) or does not parse (its :class:`CorruptRecordError`)."""
        out = self._read_records(which) if out is None else out
        for (table, r), rec in zip(which, out):
            if rec is None:
                raise NotFoundError(f"no {table.name} record at {self._record_key(table, r)}")
            if isinstance(rec, CorruptRecordError):
                raise rec
        return out

    def read_all(self, table: MachineTable) -> list[Any]:
        """Every rank's record of ``table`` (rank or weights), ep_rank order, in one round trip; a missing one is
        :class:`NotFoundError`."""
        return self._strict([(table, r) for r in range(self.ep_size())])

    def rank_states(self) -> list[tuple[RankState, str]]:
        """Every rank's (state, plan_id), ep_rank order, in one round trip of two fields per rank: what the
        coordinator checks at each wake-up while the ranks load or swap (a whole record is parsed only when it
        needs more). :class:`NotFoundError` for a missing record, :class:`CorruptRecordError` naming the key for a
        state that is not a :class:`RankState` or a record without one."""
        keys = [self._keys.rank(r) for r in range(self.ep_size())]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "state", "plan_id")
        out = []
        for r, (key, (state, plan_id)) in enumerate(zip(keys, pipe.execute())):
            if state is None:  # no record (NotFoundError), or one without a state (its CorruptRecordError)
                rec = self._strict([(RANK, r)])[0]
                out.append((rec.state, rec.plan_id))  # written meanwhile
                continue
            try:
                out.append((RankState(_s(state)), _s(plan_id)))
            except ValueError:
                raise CorruptRecordError(f"{key}: field 'state' holds {_s(state)[:40]!r}, not a valid RankState",
                                         key=key) from None
        return out

    def read_each(self, table: MachineTable) -> list[Any]:
        """Every rank's record of ``table`` (rank or weights), ep_rank order, in one round trip, each on its own: a
        missing record is None and one that does not parse is returned as its :class:`CorruptRecordError` (naming
        the key), not raised, so a reader can show the others (``fdeplb status``, the metrics)."""
        return self._read_records([(table, r) for r in range(self.ep_size())])

    def read_view(self, ep_rank: int) -> tuple[ClusterRecord, RankRecord, WeightRecord]:
        """What a rank agent's reconcile step reads: the cluster record and ``ep_rank``'s rank and weight-status
        records, in one round trip. :class:`NotFoundError` / :class:`CorruptRecordError` as :meth:`read`."""
        cluster, rank, weights = self._strict(self._view_of(ep_rank))
        return cluster, rank, weights

    @staticmethod
    def _view_of(ep_rank: int) -> list[tuple[MachineTable, int | None]]:
        """The records of a rank agent's view, in order: cluster, ``ep_rank``'s rank and weight-status records."""
        return [(CLUSTER, None), (RANK, ep_rank), (WEIGHTS, ep_rank)]

    def ensure(self, table: MachineTable, ep_rank: int | None = None) -> bool:
        """Create the record in the table's initial state at version 0 unless it exists (both fields in one MULTI,
        so a crash cannot leave a record without a version); True if created."""
        key = self._record_key(table, ep_rank)
        pipe = self._client.pipeline(transaction=True)
        pipe.hsetnx(key, "state", table.initial.value)
        pipe.hsetnx(key, "version", "0")
        created, _ = pipe.execute()
        return bool(created)

    def update(self, table: MachineTable, ep_rank: int | None = None, **changes: Any) -> None:
        """Write fields of a record that are not its state (heartbeat, alarm, reports); names are checked against
        the record type (:class:`InputError` for an unknown one, or for state / version)."""
        fields = encode_changes(record_type(table), changes)
        if fields:
            self._client.hset(self._record_key(table, ep_rank), mapping=fields)

    def heartbeat(self, ep_rank: int, **changes: Any) -> int:
        """Stamp ``ep_rank``'s heartbeat with the server's clock (plus any other rank-record ``changes``);
        returns the time written (ms)."""
        now = self.now_ms()
        self.update(RANK, ep_rank, heartbeat_ms=now, **changes)
        return now

    def commit(
        self,
        table: MachineTable,
        spec: TransitionSpec,
        record: Any,
        *,
        actor: str,
        label: str,
        fence: str = "",
        plan_id: str = "",
        round_: int | None = None,
        reason: str = "",
        changes: dict[str, Any] | None = None,
    ) -> CommitResult:
        """Commit ``spec`` (a transition of ``table``) on ``record`` atomically with its audit record.

        ``label`` names the record in the audit (``cluster``, ``rank:3``); ``plan_id`` is the plan the transition
        concerns (guards with ``same_plan`` compare against it); ``changes`` are other record fields written in the
        same step (checked against the record type). Raises :class:`FenceError` (lease not held),
        :class:`StaleStateError` (record changed since read) or :class:`GuardError` (a guard refused); Redis is
        unchanged then.
        """
        call, what = self._commit_call(table, spec, record, actor=actor, label=label, fence=fence, plan_id=plan_id,
                                       round_=round_, reason=reason, changes=changes)
        return self._commit_outcome(self._commit(keys=call.keys, args=call.args), what)

    def deferred_commit(self, table: MachineTable, spec: TransitionSpec, record: Any, *, actor: str, label: str,
                        fence: str = "", plan_id: str = "", round_: int | None = None, reason: str = "",
                        changes: dict[str, Any] | None = None) -> "PendingCall":
        """:meth:`commit`, laid out now and sent with the next :meth:`wait_view` (see :class:`PendingCall`);
        its outcome is a :class:`CommitResult` or the error :meth:`commit` would raise."""
        call, what = self._commit_call(table, spec, record, actor=actor, label=label, fence=fence, plan_id=plan_id,
                                       round_=round_, reason=reason, changes=changes)
        return self._deferred_script(what, self._commit, call, lambda reply: self._commit_outcome(reply, what))

    def _commit_call(self, table: MachineTable, spec: TransitionSpec, record: Any, *, actor: str, label: str,
                     fence: str, plan_id: str, round_: int | None, reason: str,
                     changes: dict[str, Any] | None) -> tuple[CommitCall, str]:
        """The ``commit.lua`` call of a transition, and what it is (for error messages)."""
        round_ = record.round if round_ is None else round_
        audit = {
            "machine": table.name, "key": label, "from": record.state.value, "to": spec.dest.value,
            "trigger": spec.trigger, "actor": actor, "round": str(round_), "plan_id": plan_id, "reason": reason,
        }
        per_rank = any(g.kind.per_rank for g in spec.guards)
        call = commit_call(
            self._keys, record_key=record.key, expected_state=record.state, expected_version=record.version,
            fence=fence, new_state=spec.dest, fields=encode_changes(record_type(table), changes or {}),
            audit={k: audit[k] for k in AUDIT_FIELDS}, guards=spec.guards, effect=spec.effect, plan_id=plan_id,
            plan_key=self._keys.plan(plan_id or "_none"), ep_size=self.ep_size() if per_rank else 0,
            signal=spec.wakes_ranks,
        )
        return call, f"{table.name} {spec.trigger} on {label}"

    @staticmethod
    def _commit_outcome(reply: Any, what: str) -> CommitResult:
        """``commit.lua``'s reply as a :class:`CommitResult`, or its refusal as the typed error."""
        status = _s(reply[0])
        if status == "OK":
            return CommitResult(version=int(_s(reply[1])), audit_id=_s(reply[2]), ts_ms=int(_s(reply[3])))
        detail = f"{what}: {_s(reply[1])}"
        if status == "ERR_FENCE":
            raise FenceError(detail)
        if status == "ERR_GUARD":
            raise GuardError(detail)
        raise StaleStateError(detail)

    # ---- cluster set-up, configuration, ranks ---------------------------------------------------------------------
    def create_cluster(self, config: ClusterConfig, phy2log: np.ndarray) -> bool:
        """Write a new cluster in one MULTI/EXEC: its configuration, the initial placement (plan_id "") and one
        record per machine at version 0 in its initial state. Returns False, writing nothing, if the cluster's
        configuration exists already (WATCHed, so two creators cannot both win)."""
        records = [(self._keys.rearrange, CLUSTER.initial)]
        for r in range(config.ep_size):
            records += [(self._keys.rank(r), RANK.initial), (self._keys.weights(r), WEIGHTS.initial)]
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self._keys.config)
                    if pipe.exists(self._keys.config):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.delete(self._keys.placement, *(key for key, _ in records))  # leftovers of a stray write
                    pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log,
                                                                                                   np.int64)),
                                                             "plan_id": "", "version": "0"})
                    for key, initial in records:
                        pipe.hset(key, mapping={"state": initial.value, "version": "0"})
                    pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})
                    pipe.execute()
                    self._config = config
                    return True
                except redis.WatchError:
                    continue

    def read_config(self) -> ClusterConfig:
        """The cluster configuration; :class:`NotFoundError` if the cluster was never initialised,
        :class:`CorruptRecordError` if it does not parse. Cached: a cluster's configuration never changes."""
        if self._config is None:
            raw = _hgetall(self._client, self._keys.config)
            if not raw:
                raise NotFoundError(f"cluster {self.cluster!r} is not initialised (no {self._keys.config})")
            data = {}
            for k, v in raw.items():
                try:
                    data[_s(k)] = json.loads(_s(v))
                except json.JSONDecodeError:
                    raise CorruptRecordError(f"{self._keys.config}: field {_s(k)!r} holds {_s(v)[:60]!r}, which is "
                                             f"not JSON", key=self._keys.config) from None
            try:
                self._config = ClusterConfig.from_json(data)
            except InputError as exc:
                why = str(exc).removeprefix("not a cluster configuration: ")
                raise CorruptRecordError(f"{self._keys.config}: not a cluster configuration: {why}",
                                         key=self._keys.config) from None
        return self._config

    def ep_size(self) -> int:
        """Number of EP ranks of the cluster (from its configuration)."""
        return self.read_config().ep_size

    def register_rank(self, ep_rank: int, info: dict[str, Any]) -> None:
        """Record ``ep_rank`` in the registry (the only peers ever named in requests) with its address/pid info."""
        self._client.hset(self._keys.ranks, str(int(ep_rank)), json_text(info))

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

    def request_round(self, reason: str = "operator") -> int:
        """Ask the coordinator for a round; returns the number of the round that will serve the request.

        Requests coalesce (one WATCHed transaction on the cluster record): while a round is in flight the request
        is served by it; while the cluster is FREE with a round already pending, by the pending one; otherwise
        it asks for round ``round + 1`` (``requested``). Any number of requests therefore yield exactly one round.
        The start itself stays a guarded, audited transition; a request is only a wish.

        ``reason`` (kept as ``requested_reason`` and in the ``round_requested`` event): at most
        :data:`MAX_REQUEST_REASON` characters, none of them a control character; :class:`InputError` otherwise
        (nothing is written)."""
        check_request_reason(reason)
        key = self._keys.rearrange
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    rec = parse_record(ClusterRecord, key, _text(_hgetall(pipe, key)))
                    if rec.state is not ClusterState.FREE:
                        serving, write = rec.round, False
                    elif rec.requested > rec.round:
                        serving, write = rec.round + 1, False
                    else:
                        serving, write = rec.round + 1, True
                    pipe.multi()
                    if write:
                        pipe.hset(key, mapping={"requested": str(serving), "requested_reason": reason})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.emit_event("round_requested", reason=reason, requested=serving, new=int(write))
        return serving

    def request_commit(self, plan_id: str, by: str = "operator") -> None:
        """Allow a cordoned cluster's LOAD_SUCC round with ``plan_id`` to commit (FastDeploy's
        ``update_weight_from_tensor`` step). Checked and written in one WATCHed transaction. ``by`` (who asked:
        ``http``, ``cli``, ...) is kept in ``commit_requested_by`` and named in the commit's audit record.

        Raises :class:`StateError` unless the cluster is cordoned and in LOAD_SUCC with exactly this plan (nothing
        is written then). The coordinator still commits only a LOAD_SUCC round whose plan_id matches."""
        if not self.read_config().cordoned:
            raise StateError(f"cluster {self.cluster!r} is not cordoned: its rounds commit on their own")
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self._keys.rearrange)
                    rec = parse_record(ClusterRecord, self._keys.rearrange, _text(_hgetall(pipe, self._keys.rearrange)))
                    if rec.state is not ClusterState.LOAD_SUCC or rec.plan_id != plan_id:
                        pipe.unwatch()
                        raise StateError(
                            f"cluster {self.cluster!r} is {rec.state} with plan {rec.plan_id or '-'}; a commit is "
                            f"only accepted in LOAD_SUCC for the staged plan (asked: {plan_id!r})")
                    pipe.multi()
                    pipe.hset(self._keys.rearrange, mapping={"commit_requested": plan_id,
                                                             "commit_requested_by": by})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.emit_event("commit_requested", plan_id=plan_id, by=by)

    def request_weights(self, action: str, reason: str = "operator", *, when_idle: bool = False) -> int:
        """Ask every rank to ``"clear"`` or ``"update"`` its expert weights (FastDeploy's ``clear_load_weight`` /
        ``update_model_weight``); returns the request number. Each rank agent carries out request n once, at a
        safe point, through its weight-status machine; embedded agents all at the same step, fixed once every rank
        is armed for the request (``weights_switch_step``, reset to 0 = not fixed here; :meth:`arm_switch`).

        Raises :class:`InputError` for another action, :class:`StateError` while a rank is still CLEARING or
        UPDATING for an earlier request, and with ``when_idle`` also while the cluster is not FREE or has a round
        pending (the API's clear: a round accepted meanwhile would wait for the weights to be loaded again). Checked
        and written in one WATCHed transaction; nothing is written when refused."""
        if action not in ("clear", "update"):
            raise InputError(f"weight request must be 'clear' or 'update', got {action!r}")
        busy_states = {WeightState.CLEARING.value.encode(), WeightState.UPDATING.value.encode()}
        wkeys = [self._keys.weights(r) for r in range(self.ep_size())]
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self._keys.rearrange, *wkeys)
                    busy = [r for r, key in enumerate(wkeys) if pipe.hget(key, "state") in busy_states]
                    if when_idle and not busy:
                        rec = parse_record(ClusterRecord, self._keys.rearrange,
                                           _text(_hgetall(pipe, self._keys.rearrange)))
                        if rec.state is not ClusterState.FREE or rec.requested > rec.round:
                            pipe.unwatch()
                            raise StateError(f"cannot {action} weights while rearrangement round "
                                             f"{max(rec.round, rec.requested)} is "
                                             f"{'pending' if rec.state is ClusterState.FREE else rec.state}")
                    if busy:
                        pipe.unwatch()
                        raise StateError(f"ranks {busy} are still carrying out the previous weight request "
                                         f"(CLEARING or UPDATING); ask again when they finish")
                    pipe.multi()
                    pipe.hincrby(self._keys.rearrange, "weights_request", 1)
                    pipe.hset(self._keys.rearrange, mapping={"weights_action": action, "weights_reason": reason,
                                                             "weights_switch_step": "0"})
                    self._signal(pipe, "weights")
                    n, _, _ = pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.emit_event("weights_requested", action=action, request=n, reason=reason)
        return int(n)

    def delete_cluster(self) -> int:
        """Delete every key of this cluster (tests and demo clean-up); returns how many."""
        pattern = f"{self._keys.prefix.replace('{', '[{]').replace('}', '[}]')}:*"
        keys = list(self._client.scan_iter(match=pattern))
        self._config = None
        return int(self._client.delete(*keys)) if keys else 0

    # ---- arrays: load windows, snapshots, plans, placement ------------------------------------------------------
    def _put_once(self, key: str, mapping: dict[str, Any], round_: int, *, unless_supplied: bool = False) -> bool:
        """Write a write-once hash (plans, snapshots) unless it exists, indexed under ``round_`` for pruning
        (:meth:`prune`); returns whether it wrote. ``unless_supplied``: nor when an operator-supplied load for
        ``round_`` is stored (:meth:`supply_load`), checked in the same WATCHed transaction."""
        supplied = self._keys.supplied_load
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key, *([supplied] if unless_supplied else []))
                    if pipe.exists(key):  # used again (plans are content-addressed): retained as of this round
                        pipe.unwatch()
                        self._client.zadd(self._keys.retained, {key: int(round_)}, gt=True)
                        return False
                    if unless_supplied and _s(pipe.hget(supplied, "round")) == str(int(round_)):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.hset(key, mapping=mapping)
                    pipe.zadd(self._keys.retained, {key: int(round_)})
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def _array(self, key: str, name: str, raw: dict | None = None) -> np.ndarray | None:
        if raw is None:
            with _typed(key):
                values = self._client.hmget(key, [name, f"{name}:dtype", f"{name}:shape"])
            raw = {name: values[0], f"{name}:dtype": values[1], f"{name}:shape": values[2]}
        try:
            return arrays.decode(name, raw)
        except (InputError, ValueError, TypeError) as exc:
            raise CorruptRecordError(f"{key}: {exc}", key=key) from None

    def _loads(self, key: str, arr: np.ndarray | None) -> np.ndarray | None:
        """A stored load array checked against the configuration: int64 [L, E], in [0, 2**53]."""
        if arr is None:
            return None
        cfg = self.read_config()
        shape = (cfg.num_layers, cfg.num_logical_experts)
        if arr.dtype != np.int64 or arr.shape != shape:
            raise CorruptRecordError(f"{key}: expert_load is {arr.dtype} {arr.shape}, expected int64 {shape}", key=key)
        if arr.size and (arr.min() < 0 or arr.max() > MAX_LOAD):
            raise CorruptRecordError(f"{key}: expert_load holds values outside [0, 2**53] "
                                     f"(min {arr.min()}, max {arr.max()})", key=key)
        return arr

    def _table(self, key: str, arr: np.ndarray, name: str) -> np.ndarray:
        """A stored placement table checked against the configuration: int64 [L, P], ids in [0, E)."""
        cfg = self.read_config()
        shape = (cfg.num_layers, cfg.num_physical_experts)
        if arr.dtype != np.int64 or arr.shape != shape:
            raise CorruptRecordError(f"{key}: {name} is {arr.dtype} {arr.shape}, expected int64 {shape}", key=key)
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.num_logical_experts):
            raise CorruptRecordError(f"{key}: {name} holds expert ids outside [0, {cfg.num_logical_experts})", key=key)
        return arr

    def publish_load(self, ep_rank: int, round_: int, expert_load: np.ndarray) -> None:
        """Publish ``ep_rank``'s expert_load window (int64 [L, E]) for round ``round_`` (overwrites the last).
        :class:`InputError` (nothing written) for a window :func:`fdeplb.placement.check_counts` refuses: wrong
        shape, negative, above 2**53, NaN, or fractional (never truncated)."""
        call = self._publish_call(ep_rank, round_, expert_load)
        self._publish(keys=call.keys, args=call.args)

    def deferred_publish(self, ep_rank: int, round_: int, expert_load: np.ndarray) -> PendingCall:
        """:meth:`publish_load`, checked now and sent with the next :meth:`wait_view` (:class:`PendingCall`;
        its outcome is the window's ``published_ms``). :class:`InputError` at once, as :meth:`publish_load`."""
        call = self._publish_call(ep_rank, round_, expert_load)
        return self._deferred_script(f"load window of rank {int(ep_rank)}", self._publish, call, int)

    def deferred_plan_read(self, plan_id: str) -> PendingCall:
        """:meth:`plan_phy2log` as a :class:`PendingCall` (for :meth:`send`, next to a commit)."""
        key = self._keys.plan(plan_id)
        names = ["new_phy2log", "new_phy2log:dtype", "new_phy2log:shape"]

        def outcome(reply: Any) -> np.ndarray | None:
            if isinstance(reply, Exception):
                raise reply
            arr = self._array(key, names[0], dict(zip(names, reply)))
            return None if arr is None else self._table(key, arr, names[0])

        return PendingCall(f"plan {plan_id}", lambda pipe: pipe.hmget(key, names), outcome)

    def _deferred_script(self, what: str, script: Any, call: CommitCall, parse: Callable[[Any], Any]) -> PendingCall:
        """A script call as a :class:`PendingCall`: sent as ``EVALSHA`` (on a pipeline redis-py's ``Script`` would
        first ask ``SCRIPT EXISTS``, a round trip of its own), the script loaded once per store beforehand; a
        server that lost it since (restarted) gets it loaded and the call run again, after the pipeline."""
        if script.sha not in self._loaded:
            self._client.script_load(script.script)
            self._loaded.add(script.sha)

        def outcome(reply: Any) -> Any:
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = script(keys=call.keys, args=call.args)
            elif isinstance(reply, Exception):
                raise reply
            return parse(reply)

        # execute_command, not pipe.evalsha: redis-py's cluster pipeline refuses the named script methods
        return PendingCall(what, lambda pipe: pipe.execute_command("EVALSHA", script.sha, len(call.keys), *call.keys,
                                                                   *call.args), outcome)

    def _publish_call(self, ep_rank: int, round_: int, expert_load: np.ndarray) -> CommitCall:
        counts = check_counts(expert_load, f"load window of rank {ep_rank}")
        cfg = self.read_config()
        if counts.shape != (cfg.num_layers, cfg.num_logical_experts):
            raise InputError(f"load window of rank {ep_rank} has shape {counts.shape}, expected "
                             f"{(cfg.num_layers, cfg.num_logical_experts)}")
        # the window, its server time and its wake-up event: one atomic script call, one round trip
        return publish_call(self._keys, ep_rank=ep_rank, round_=round_, window=arrays.encode("expert_load", counts),
                            events_maxlen=EVENTS_MAXLEN)

    def load_round(self, ep_rank: int) -> int | None:
        """Round of ``ep_rank``'s last published window (None if it never published)."""
        value = self._client.hget(self._keys.load(ep_rank), "round")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            key = self._keys.load(ep_rank)
            raise CorruptRecordError(f"{key}: round {_s(value)!r} is not an integer", key=key) from None

    def load_rounds(self) -> list[int | CorruptRecordError | None]:
        """Round of every rank's last published window (None: never published), ep_rank order, one round trip;
        a round that is not an integer is returned as a :class:`CorruptRecordError` naming the key, not raised."""
        keys = [self._keys.load(r) for r in range(self.ep_size())]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "round")
        out: list[int | CorruptRecordError | None] = []
        for key, value in zip(keys, pipe.execute()):
            try:
                out.append(None if value is None else int(value))
            except ValueError:
                out.append(CorruptRecordError(f"{key}: round {_s(value)!r} is not an integer", key=key))
        return out

    def read_load(self, ep_rank: int) -> LoadWindow | None:
        """``ep_rank``'s last published window (None if it never published); :class:`CorruptRecordError` naming
        the key for a window of the wrong dtype, shape or range."""
        return self._load_window(ep_rank, _hgetall(self._client, self._keys.load(ep_rank)))

    def read_loads(self) -> list[LoadWindow | CorruptRecordError | None]:
        """Every rank's last published window, ep_rank order, one round trip; a window that does not parse is
        returned as its :class:`CorruptRecordError` (the caller names the rank), not raised."""
        pipe = self._client.pipeline(transaction=False)
        for r in range(self.ep_size()):
            pipe.hgetall(self._keys.load(r))
        out: list[LoadWindow | CorruptRecordError | None] = []
        for r, raw in enumerate(pipe.execute()):
            try:
                out.append(self._load_window(r, raw))
            except CorruptRecordError as err:
                out.append(err)
        return out

    def _load_window(self, ep_rank: int, raw: dict) -> LoadWindow | None:
        key = self._keys.load(ep_rank)
        raw = {_s(k): v for k, v in raw.items()}
        if not raw:
            return None
        load = self._loads(key, self._array(key, "expert_load", raw))
        try:
            return LoadWindow(ep_rank=int(ep_rank), round=int(raw.get("round", b"")), expert_load=load,
                              published_ms=int(raw.get("published_ms", b"0") or 0))
        except ValueError:
            raise CorruptRecordError(f"{key}: round or published_ms is not an integer", key=key) from None

    def save_snapshot(self, round_: int, expert_load: np.ndarray) -> bool:
        """Freeze round ``round_``'s load snapshot (int64 [L, E]); write-once (False if one is stored)."""
        mapping = {**arrays.encode("expert_load", np.asarray(expert_load, dtype=np.int64)), "round": str(round_)}
        return self._put_once(self._keys.snapshot(round_), mapping, round_)

    def freeze_windows(self, round_: int, expert_load: np.ndarray) -> bool:
        """Freeze round ``round_``'s snapshot from the ranks' windows (``expert_load``, int64 [L, E], their sum)
        unless a load was supplied for the round meanwhile (:meth:`supply_load`, whose write checks the snapshot in
        a WATCHed transaction as this one checks the supplied load): of the two, the first to commit wins, so a
        load the API accepted is never passed over. False when a supplied load is there (nothing written: freeze
        that one); True otherwise (written, or a snapshot was frozen already)."""
        mapping = {**arrays.encode("expert_load", np.asarray(expert_load, dtype=np.int64)), "round": str(round_)}
        if self._put_once(self._keys.snapshot(round_), mapping, round_, unless_supplied=True):
            return True
        return bool(self._client.exists(self._keys.snapshot(round_)))

    def read_snapshot(self, round_: int) -> np.ndarray | None:
        """Round ``round_``'s load snapshot, int64 [L, E], or None; :class:`CorruptRecordError` naming the key
        for a stored value of the wrong dtype, shape or range."""
        key = self._keys.snapshot(round_)
        arr = self._array(key, "expert_load")
        return None if arr is None else self._loads(key, arr)

    def save_plan(self, plan: PlanEntry) -> bool:
        """Store ``plan``; write-once (plans are content-addressed: False if this plan_id is stored)."""
        return self._put_once(self._keys.plan(plan.plan_id), plan.to_fields(), plan.round)

    def read_plan(self, plan_id: str) -> PlanEntry | None:
        """The stored plan ``plan_id`` or None; :class:`CorruptRecordError` if a field does not parse, or an array is
        of the wrong dtype, shape or range for the cluster."""
        if not plan_id:
            return None
        key = self._keys.plan(plan_id)
        raw = {_s(k): v for k, v in _hgetall(self._client, key).items()}
        if not raw:
            return None
        plan = PlanEntry.from_fields(key, raw, plan_id)
        self._loads(key, plan.expert_load)
        for name in ("old_phy2log", "new_phy2log"):
            self._table(key, getattr(plan, name), name)
        return plan

    def plan_phy2log(self, plan_id: str) -> np.ndarray | None:
        """Only the new phy2log (int64 [L, P]) of plan ``plan_id``, or None if no such plan is stored;
        :class:`CorruptRecordError` naming the key for a table of the wrong dtype, shape or expert ids."""
        if not plan_id:
            return None
        key = self._keys.plan(plan_id)
        arr = self._array(key, "new_phy2log")
        return None if arr is None else self._table(key, arr, "new_phy2log")

    def has_plan(self, plan_id: str) -> bool:
        """Whether plan ``plan_id`` is stored (one EXISTS; its content is checked by :meth:`plan_phy2log`)."""
        return bool(plan_id) and bool(self._client.exists(self._keys.plan(plan_id)))

    def current_placement(self) -> PlacementEntry:
        """The cluster's current placement; :class:`NotFoundError` if the cluster has none."""
        raw = {_s(k): v for k, v in _hgetall(self._client, self._keys.placement).items()}
        phy2log = self._array(self._keys.placement, "phy2log", raw)
        if phy2log is None:
            raise NotFoundError(f"cluster {self.cluster!r} has no current placement")
        phy2log = self._table(self._keys.placement, phy2log, "phy2log")
        try:
            version = int(raw.get("version", b"0") or 0)
        except ValueError:
            key = self._keys.placement
            raise CorruptRecordError(f"{key}: version is not an integer", key=key) from None
        return PlacementEntry(plan_id=_s(raw.get("plan_id", b"")), phy2log=phy2log, version=version)

    # ---- lease ---------------------------------------------------------------------------------------------------
    def _lease_op(self, op: str, value: str, ttl_ms: int) -> Any:
        call = lease_call(self._keys, op, value, ttl_ms)
        return self._lease(keys=call.keys, args=call.args)

    def acquire_lease(self, holder: str, ttl_ms: int) -> str | None:
        """Take the coordinator lease if free; returns the lease value ``<fence>:<holder>`` (the fencing token).
        :class:`CorruptRecordError` naming the fence key when the fence counter holds something else than a
        non-negative integer (nothing is changed then)."""
        try:
            value = self._lease_op("acquire", holder, ttl_ms)
        except redis.ResponseError as exc:
            if "corrupt fence counter" in str(exc):
                raise CorruptRecordError(str(exc).split("lease.lua: ", 1)[-1], key=self._keys.fence) from None
            raise
        return _s(value) if value else None

    def renew_lease(self, value: str, ttl_ms: int) -> bool:
        """Extend the lease if ``value`` still holds it; False means the lease was lost."""
        return bool(self._lease_op("renew", value, ttl_ms))

    def release_lease(self, value: str) -> bool:
        """Give the lease back if ``value`` still holds it."""
        return bool(self._lease_op("release", value, 0))

    def lease_info(self) -> LeaseInfo:
        """Who holds the coordinator lease and for how long still."""
        pipe = self._client.pipeline(transaction=True)
        pipe.get(self._keys.lease)
        pipe.pttl(self._keys.lease)
        value, ttl = pipe.execute()
        if not value:
            return LeaseInfo(holder=None, ttl_ms=None)
        return LeaseInfo(holder=_s(value), ttl_ms=int(ttl) if ttl is not None and int(ttl) >= 0 else None)

    # ---- time, audit and events ---------------------------------------------------------------------------------
    def now_ms(self) -> int:
        """The Redis server's clock in ms (deadlines are compared against it, never a local clock)."""
        sec, usec = self._client.time()
        return int(sec) * 1000 + int(usec) // 1000

    def append_alarm(self, record: ClusterRecord, *, actor: str, reason: str, fence: str = "") -> str:
        """Append an alarm to the audit stream: ``trigger`` = ``alarm``, ``from`` = ``to`` = the record's state and
        its current ``version`` (not a transition: replays skip it; the record is unchanged). With ``fence``,
        refused (:class:`FenceError`) unless that lease is held. Returns the audit id."""
        return self.append_note(record, trigger="alarm", actor=actor, reason=reason, fence=fence)

    def append_note(self, record: ClusterRecord, *, trigger: str, actor: str, reason: str, fence: str = "") -> str:
        """Append a cluster outcome that is not a transition (``alarm``, ``skip``, ``start_refused``) to the audit
        stream: ``from`` = ``to`` = the record's state, its current ``version``; the record is unchanged and
        replays skip it (:data:`fdeplb.replay.NOT_TRANSITIONS`). Appended by ``lua/audit.lua``, so it joins the
        audit chain like a transition; with ``fence``, refused (:class:`FenceError`) unless that lease is held.
        Returns the stream id."""
        fields = {"machine": CLUSTER.name, "key": CLUSTER.name, "from": record.state.value,
                  "to": record.state.value, "trigger": trigger, "actor": actor, "round": str(record.round),
                  "plan_id": record.plan_id, "reason": reason, "version": str(record.version)}
        call = audit_call(self._keys, fence=fence, audit=fields)
        reply = self._append(keys=call.keys, args=call.args)
        if _s(reply[0]) != "OK":
            raise FenceError(f"{trigger} on {CLUSTER.name}: {_s(reply[1])}")
        return _s(reply[1])

    def emit_event(self, kind: str, **fields: Any) -> str:
        """Append a wake-up event (not a transition) to the capped events stream."""
        body = {"kind": kind, **{k: str(v) for k, v in fields.items()}}
        return _s(self._client.xadd(self._keys.events, body, maxlen=EVENTS_MAXLEN, approximate=True))

    def _signal(self, pipe: Any, what: str) -> None:
        """Queue a signal-stream entry on ``pipe`` (in the same transaction as the cluster-record write it
        announces): rank agents blocked in :meth:`wait` on a :meth:`signal_cursor` wake up."""
        pipe.xadd(self._keys.signal, {"what": what}, maxlen=SIGNAL_MAXLEN, approximate=True)

    def signal_cursor(self) -> Cursor:
        """A position after the latest signal entry: what a rank agent waits on with :meth:`wait`. The signal
        stream gets an entry per cluster transition (commit.lua) and per weight or clear-stat request, so an agent
        wakes once per change of the cluster record, not once per audit record of every rank."""
        last = self._client.xrevrange(self._keys.signal, count=1)
        return {self._keys.signal: _s(last[0][0]) if last else "0-0"}

    def cursor(self, *, events_from: str | None = None) -> Cursor:
        """A position after the latest audit and events entries: where a new waiter starts reading.
        ``events_from`` starts the events stream at that id instead (e.g. "0-0": from its beginning)."""
        out = {}
        for key in (self._keys.audit, self._keys.events):
            with _typed(key):
                last = self._client.xrevrange(key, count=1)
            out[key] = _s(last[0][0]) if last else "0-0"
        if events_from is not None:
            out[self._keys.events] = events_from
        return out

    def wait(self, cursor: Cursor, block_ms: int) -> list[AuditRecord]:
        """Block until a new entry appears in a stream of ``cursor`` (updated in place) or ``block_ms`` passed;
        returns the new entries (audit records have a ``machine`` field, events a ``kind``, signals a ``state`` or a
        ``what``). ``cursor`` comes from :meth:`cursor` (audit + events) or :meth:`signal_cursor`.

        ``XREAD BLOCK`` from the last seen id, so nothing is lost across reconnects (unlike pub/sub).
        """
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        return self._advance(cursor, self._client.xread(cursor, block=block, count=1000))

    @staticmethod
    def _advance(cursor: Cursor, reply: Any) -> list[AuditRecord]:
        """An ``XREAD`` reply as entries, with ``cursor`` moved past them."""
        out = []
        for stream, entries in reply or []:
            stream = _s(stream)
            for entry_id, raw in entries:
                cursor[stream] = _s(entry_id)
                out.append(AuditRecord(_s(entry_id), _text(raw)))
        return out

    def wait_view(self, cursor: Cursor, ep_rank: int, block_ms: int, writes: list[PendingCall] = ()
                  ) -> tuple[list[AuditRecord], tuple[ClusterRecord, RankRecord, WeightRecord], list[Any]]:
        """A rank agent's wait, in one round trip: ``writes`` (sent first, in order), then :meth:`wait` on
        ``cursor`` (a :meth:`signal_cursor`), then :meth:`read_view` of ``ep_rank``, all in one pipeline (Redis
        runs a client's pipelined commands in order, the reads as soon as the blocking ``XREAD`` returns).

        Returns (the new signal entries, the view as read after the wait, each write's outcome as :meth:`send`).
        Raises as :meth:`read_view` for the view, :class:`RedisUnavailableError` when the round trip fails (then
        the writes' fate is unknown)."""
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        which = self._view_of(ep_rank)
        keys = [self._record_key(table, r) for table, r in which]
        pipe = self._client.pipeline(transaction=False)
        for w in writes:
            w.queue(pipe)
        pipe.xread(cursor, block=block, count=1000)
        for key in keys:
            pipe.hgetall(key)
        replies = pipe.execute(raise_on_error=False)
        outcomes = self._write_outcomes(writes, replies)
        replies = replies[len(writes):]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        signals = self._advance(cursor, replies[0])
        view = self._strict(which, self._parse_records(which, keys, replies[1:]))
        return signals, tuple(view), outcomes

    def send(self, writes: list[PendingCall]) -> list[Any]:
        """Send ``writes`` now, in order, in one round trip (no wait). Returns each write's outcome: its result, or
        the typed :class:`~fdeplb.errors.StateError` / :class:`~fdeplb.errors.StoreError` it met (returned, not
        raised; one write's refusal does not stop the next). :class:`RedisUnavailableError` when the round trip
        fails (then their fate is unknown)."""
        if not writes:
            return []
        pipe = self._client.pipeline(transaction=False)
        for w in writes:
            w.queue(pipe)
        return self._write_outcomes(writes, pipe.execute(raise_on_error=False))

    def _write_outcomes(self, calls: list[PendingCall], replies: list[Any]) -> list[Any]:
        outcomes: list[Any] = []
        for c, reply in zip(calls, replies):
            try:
                with _redis_errors(self.url):
                    result = c.outcome(reply)
            except (StateError, StoreError) as err:
                outcomes.append(err)
                continue
            outcomes.append(result)
            if c.then is not None:
                c.then(result)
        return outcomes

    def audit(self, start: str = "-", end: str = "+", count: int | None = None) -> list[AuditRecord]:
        """Audit records between stream ids ``start`` and ``end``, oldest first."""
        with _typed(self._keys.audit):
            entries = self._client.xrange(self._keys.audit, start, end, count=count)
        return [AuditRecord(_s(i), _text(raw)) for i, raw in entries]

    # ---- section: embedding in a serving worker (issue 11) -------------------------------------------------------
    def heartbeats(self) -> dict[int, tuple[int, int]]:
        """Registered ranks' heartbeats, read at one server time: ``ep_rank -> (ms since the heartbeat, its TTL in
        ms)`` (TTL 0: the agent wrote none, never stale). Unregistered ranks are left out."""
        registered = self.rank_info()
        if not registered:
            return {}
        now = self.now_ms()
        return {r: (max(0, now - rec.heartbeat_ms), rec.heartbeat_ttl_ms)
                for r, rec in enumerate(self.read_all(RANK)) if r in registered}

    def stale_ranks(self) -> dict[int, int]:
        """Registered ranks whose heartbeat expired: ``ep_rank -> ms since the heartbeat``. A rank is stale once
        ``heartbeat_ms + heartbeat_ttl_ms`` lies in the past (server clock); a rank that never wrote a TTL, or
        is not registered, is never stale (:meth:`heartbeats`)."""
        return stale_of(self.heartbeats())

    def arm_switch(self, ep_rank: int, armed: str, step: int, field: str, current: dict[str, Any],
                   margin: int = SWITCH_MARGIN_STEPS) -> tuple[int, str]:
        """One safe point of an armed rank (``lua/switch.lua``, atomic): publish ``ep_rank``'s step counter
        (``armed_step``) armed for the change ``armed`` (e.g. ``"swap:<round>:<plan_id>"``), then return the
        change's switch step, kept in the cluster-record ``field`` (``switch_step`` / ``weights_switch_step``).

        The first call that finds every rank armed for ``armed`` fixes it: ``max(armed_step) + margin``. Since an
        armed rank calls this at every safe point, a rank whose last call published step s calls again at step
        s + 1 <= switch step: no armed rank passes the switch step without having read it (``margin`` >= 1).
        ``current``: cluster-record fields (name -> value) that identify the change while it is the cluster's
        current one (e.g. ``{"state": "SWAPPING", "round": 3, "plan_id": ...}``).

        Returns (switch step, status): ``"fixed"`` (by this call), ``"set"`` (before), ``"waiting"`` (a rank is not
        armed yet; 0), ``"gone"`` (``current`` no longer holds; 0, nothing fixed). :class:`InputError` for a
        margin < 1 or a negative step."""
        if int(margin) < 1 or int(step) < 0:
            raise InputError(f"arm_switch needs margin >= 1 and step >= 0, got margin={margin} step={step}")
        unknown = [name for name in (field, *current) if name not in _CLUSTER_FIELDS]
        if unknown:
            raise InputError(f"ClusterRecord has no field(s) {unknown}")
        current = {k: v.value if isinstance(v, StateEnum) else str(v) for k, v in current.items()}
        call = switch_call(self._keys, ep_rank=ep_rank, ep_size=self.ep_size(), armed=armed, step=step,
                           field=field, current=current, margin=margin)
        switch, status = self._switch(keys=call.keys, args=call.args)
        return int(switch), _s(status)

    def request_clear_stat(self, reason: str = "operator") -> int:
        """Ask every rank agent to empty its expert_load window (FastDeploy's ``clear_stat`` of
        ``get_per_expert_tokens_stats``); returns the request number (``clear_stat_request``)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hincrby(self._keys.rearrange, "clear_stat_request", 1)
        self._signal(pipe, "clear_stat")
        n = pipe.execute()[0]
        self.emit_event("clear_stat_requested", request=n, reason=reason)
        return int(n)

    # ---- section: retention, pruning and integrity (issue 14) -----------------------------------------------------
    def prune(self, keep_rounds: int, keep_plan_ids: tuple[str, ...] = ()) -> list[str]:
        """Delete the load snapshots and plans written by rounds older than the last ``keep_rounds`` (counted from
        the newest indexed round), except the plans named in ``keep_plan_ids`` (the current placement's, the round
        in flight's) and the snapshot of a kept plan's round. Returns the deleted keys (sorted).

        Only keys in the retention index (written by :meth:`save_snapshot` / :meth:`save_plan`) are considered."""
        newest = self._client.zrevrange(self._keys.retained, 0, 0, withscores=True)
        if not newest:
            return []
        cutoff = int(newest[0][1]) - int(keep_rounds)  # rounds <= cutoff are pruned
        keep = {self._keys.plan(p) for p in keep_plan_ids if p}
        keep_rounds_of_plans = set()
        for key in keep:
            score = self._client.zscore(self._keys.retained, key)
            if score is not None:
                keep_rounds_of_plans.add(self._keys.snapshot(int(score)))
        old = [_s(k) for k in self._client.zrangebyscore(self._keys.retained, "-inf", cutoff)]
        drop = sorted(k for k in old if k not in keep and k not in keep_rounds_of_plans)
        if drop:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(*drop)
            pipe.zrem(self._keys.retained, *drop)
            pipe.execute()
        return drop

    def retained_keys(self) -> dict[str, int]:
        """Snapshot and plan keys in the retention index -> the round that wrote them."""
        return {_s(k): int(v) for k, v in self._client.zrange(self._keys.retained, 0, -1, withscores=True)}

    def drop_load(self, ep_rank: int) -> None:
        """Delete ``ep_rank``'s published window (a corrupt one: the agent publishes a fresh one next round)."""
        self._client.delete(self._keys.load(ep_rank))

    def drop_snapshot(self, round_: int) -> None:
        """Delete round ``round_``'s load snapshot (a corrupt one)."""
        key = self._keys.snapshot(round_)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.zrem(self._keys.retained, key)
        pipe.execute()

    def drop_plan(self, plan_id: str) -> bool:
        """Delete stored plan ``plan_id`` (a corrupt one: the next round computes it again) unless the current
        placement refers to it; returns whether it deleted."""
        key = self._keys.plan(plan_id)
        if _s(self._client.hget(self._keys.placement, "plan_id")) == plan_id:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.zrem(self._keys.retained, key)
        pipe.execute()
        return True

    def trim_audit(self, keep: int, export_path: str) -> int:
        """Opt-in audit retention: append every audit record but the newest ``keep`` to ``export_path`` (JSONL,
        one ``{"id": ..., **fields}`` object per line, flushed and fsynced) and only then trim them from the
        stream (``XTRIM MINID``). Returns how many were trimmed (0 when the stream holds ``keep`` or fewer).
        Raises OSError when the file cannot be written (nothing is trimmed then)."""
        import os

        length = self.audit_length()
        if keep < 1 or length <= keep:
            return 0
        old = self.audit("-", "+", count=length - keep)
        if not old:
            return 0
        with open(export_path, "a", encoding="utf-8") as fh:
            for entry in old:
                fh.write(json.dumps({"id": entry.id, **entry.fields}, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        last = old[-1].id
        ms, seq = last.split("-")
        self._client.xtrim(self._keys.audit, minid=f"{ms}-{int(seq) + 1}", approximate=False)
        return len(old)

    def routing_mismatches(self) -> list[tuple[int, str, str]]:
        """Ranks whose reported routing-table digest (:attr:`RankRecord.routing_digest`) differs from the current
        placement's (:func:`fdeplb.placement.routing_digest`): a list of (ep_rank, reported, expected); ranks that
        have not reported one yet are listed with "" as reported."""
        expected = routing_digest(self.current_placement().phy2log)
        return [(r, x.routing_digest, expected) for r, x in enumerate(self.read_all(RANK))
                if x.routing_digest != expected]

    def key_count(self) -> int:
        """Keys of this cluster now (SCAN; used to check that nothing leaks)."""
        pattern = f"{self._keys.prefix.replace('{', '[{]').replace('}', '[}]')}:*"
        return sum(1 for _ in self._client.scan_iter(match=pattern))

    def memory_used(self) -> int:
        """The server's ``used_memory`` in bytes (the sum over the nodes of a Redis Cluster)."""
        info = self._client.info("memory")
        if isinstance(info, dict) and "used_memory" in info:
            return int(info["used_memory"])
        return sum(int(v["used_memory"]) for v in info.values())  # RedisCluster: one dict per node

    def wait_available(self, timeout_s: float, on_wait: Callable[[str], None] | None = None,
                       interval_s: float = 0.5) -> None:
        """Block until the server answers PING (at most ``timeout_s`` seconds); ``on_wait(error)`` is called once
        when the first attempt fails (a log line). :class:`RedisUnavailableError` when the bound passes."""
        import time

        end = time.monotonic() + float(timeout_s)
        told = False
        while True:
            try:
                self._client.ping()
                return
            except redis.RedisError as exc:
                if not told and on_wait is not None:
                    on_wait(str(exc))
                    told = True
                if time.monotonic() >= end:
                    raise RedisUnavailableError(f"Redis at {self.url} did not answer within {timeout_s:g} s: "
                                                f"{exc}") from None
                time.sleep(interval_s)


    # ---- section: HTTP API support (issue 12) ---------------------------------------------------------------------
    def request_round_if_free(self, reason: str = "api") -> tuple[bool, ClusterRecord]:
        """Ask for one round only if the cluster is FREE with no round pending (``requested <= round``) and every
        rank's weights are NORMAL with no clear pending, checked and written in one WATCHed transaction: of many
        concurrent callers, exactly one is accepted, and a clear requested meanwhile
        (:meth:`request_weights`) refuses the start instead of leaving the round waiting for an update.

        Returns (accepted, the cluster record as read); :class:`StateError` when the weights refuse it,
        :class:`CorruptRecordError` for a weight-status record that does not parse (:class:`NotFoundError` for a
        missing one). Nothing is written when
        refused. ``reason`` as for :meth:`request_round`."""
        check_request_reason(reason)
        key = self._keys.rearrange
        wkeys = [self._keys.weights(r) for r in range(self.ep_size())]
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key, *wkeys)
                    raw = _hgetall(pipe, key)
                    if not raw:
                        pipe.unwatch()
                        raise NotFoundError(f"no cluster record at {key}")
                    rec = parse_record(ClusterRecord, key, _text(raw))
                    if rec.state is not ClusterState.FREE or rec.requested > rec.round:
                        pipe.unwatch()
                        return False, rec
                    # read in one round trip (another connection): WATCH, issued before, still sees any change
                    weights = self._strict([(WEIGHTS, r) for r in range(len(wkeys))])
                    unloaded = [r for r, w in enumerate(weights) if w.state is not WeightState.NORMAL]
                    clearing = [r for r, w in enumerate(weights) if rec.weights_action == "clear"
                                and w.request < rec.weights_request]
                    if unloaded or clearing:
                        pipe.unwatch()
                        raise StateError(
                            f"weights of ranks {unloaded} are not NORMAL ({weights[unloaded[0]].state})" if unloaded
                            else f"weight clear {rec.weights_request} is pending on ranks {clearing}")
                    pipe.multi()
                    pipe.hincrby(key, "requested", 1)
                    pipe.hset(key, "requested_reason", reason)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.emit_event("round_requested", reason=reason, requested=rec.round + 1)
        return True, rec

    def supply_load(self, round_: int, expert_load: np.ndarray) -> None:
        """Store an operator-supplied expert_load (int64 [L, E]) to be round ``round_``'s snapshot instead of the
        ranks' windows (FastDeploy's ``recv_expert_weight``); replaces an earlier one. The caller checks the shape.

        Raises :class:`StateError` when round ``round_``'s snapshot is frozen already (the load could no longer be
        used; nothing is written): checked and written in one WATCHed transaction against
        :meth:`freeze_windows`."""
        mapping = {**arrays.encode("expert_load", np.asarray(expert_load, dtype=np.int64)),
                   "round": str(int(round_)), "supplied_ms": str(self.now_ms())}
        snapshot, key = self._keys.snapshot(round_), self._keys.supplied_load
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(snapshot, key)
                    if pipe.exists(snapshot):
                        pipe.unwatch()
                        raise StateError(f"round {round_}'s load snapshot is frozen already: a load supplied now "
                                         "would not be used")
                    pipe.multi()
                    pipe.delete(key)
                    pipe.hset(key, mapping=mapping)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.emit_event("load_supplied", round=round_)

    def supplied_load(self, round_: int) -> np.ndarray | None:
        """The operator-supplied expert_load (int64 [L, E]) for round ``round_``, or None."""
        key = self._keys.supplied_load
        raw = {_s(k): v for k, v in _hgetall(self._client, key).items()}
        if not raw or _s(raw.get("round", b"")) != str(int(round_)):
            return None
        return self._array(key, "expert_load", raw)


    # ---- section: self-contained recordings (issue 13) ------------------------------------------------------------
    def audit_head(self) -> str:
        """The ``chain`` of the newest audit record ("" before the first): the anchor a recording's last chain
        is compared with (see :func:`fdeplb.replay.chain_of`)."""
        return _s(self._client.get(self._keys.audit_head))

    def follow_audit(self, after_id: str, block_ms: int) -> list[AuditRecord]:
        """Audit records after stream id ``after_id`` ("0-0": from the first), blocking up to ``block_ms`` (capped
        at :data:`MAX_BLOCK_MS`) until there is one; [] when none came."""
        block = max(1, min(int(block_ms), MAX_BLOCK_MS))
        reply = self._client.xread({self._keys.audit: after_id}, block=block, count=1000) or []
        return [AuditRecord(_s(i), _text(raw)) for _stream, entries in reply for i, raw in entries]

    def import_recording(self, config: ClusterConfig, *, plan_id: str, phy2log: np.ndarray, placement_version: int,
                         records: dict[str, dict[str, str]], audit: list[tuple[str, dict[str, str]]],
                         audit_head: str, snapshots: dict[int, np.ndarray], plans: list[PlanEntry]) -> None:
        """Rebuild a replayed cluster (``fdeplb replay --into``): ``records`` maps ``cluster`` / ``rank:<r>`` /
        ``weights:<r>`` to the record fields to write; ``audit`` holds (stream id, fields) in order, written with
        their ids; ``audit_head`` is the last chain. Snapshots and plans are written once each, then the rest in one
        WATCHed MULTI/EXEC. Raises :class:`StateError` if the cluster exists (nothing written), :class:`InputError`
        for a record label that is not one of the cluster's."""
        def key_of(label: str) -> str:
            name, _, idx = label.partition(":")
            if label == CLUSTER.name:
                return self._keys.rearrange
            if name in (RANK.name, WEIGHTS.name) and idx.isdigit() and int(idx) < config.ep_size:
                return self._keys.rank(int(idx)) if name == RANK.name else self._keys.weights(int(idx))
            raise InputError(f"not a record of the cluster: {label!r}")

        keyed = {key_of(label): fields for label, fields in records.items()}
        refusal = StateError(f"cluster {self.cluster!r} exists at {self.url}; replay --into rebuilds only into a "
                             f"cluster id that is not in use")
        if self._client.exists(self._keys.config, self._keys.audit, self._keys.rearrange):
            raise refusal
        for round_, load in snapshots.items():
            self.save_snapshot(round_, load)
        for plan in plans:
            self.save_plan(plan)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(self._keys.config, self._keys.audit)
            if pipe.exists(self._keys.config, self._keys.audit):
                pipe.unwatch()
                raise refusal
            pipe.multi()
            pipe.hset(self._keys.placement, mapping={**arrays.encode("phy2log", np.asarray(phy2log, np.int64)),
                                                     "plan_id": plan_id, "version": str(int(placement_version))})
            for key, fields in keyed.items():
                pipe.hset(key, mapping=fields)
            for entry_id, fields in audit:
                pipe.xadd(self._keys.audit, fields, id=entry_id)
            pipe.set(self._keys.audit_head, audit_head)
            pipe.hset(self._keys.config, mapping={k: json.dumps(v) for k, v in config.to_json().items()})
            try:
                pipe.execute()
            except redis.WatchError:
                raise refusal from None
        self._config = config


    def last_audit_id(self) -> str:
        """Id of the newest audit record ("0-0" when there is none)."""
        last = self._client.xrevrange(self._keys.audit, count=1)
        return _s(last[0][0]) if last else "0-0"

    def audit_length(self) -> int:
        """Number of records in the audit stream."""
        return int(self._client.xlen(self._keys.audit))

    def iter_audit(self, batch: int = 1000) -> Iterator[AuditRecord]:
        """Every audit record, oldest first, in batches."""
        start = "-"
        while True:
            chunk = self.audit(start, "+", count=batch)
            yield from chunk
            if len(chunk) < batch:
                return
            start = "(" + chunk[-1].id


def stale_of(heartbeats: dict[int, tuple[int, int]]) -> dict[int, int]:
    """The stale ranks of :meth:`Store.heartbeats`' answer: ``ep_rank -> ms since the heartbeat`` for every rank
    whose TTL is set (> 0) and has passed."""
    return {r: age for r, (age, ttl) in heartbeats.items() if 0 < ttl < age}
