"""The part of the store every other part stands on (:class:`StoreBase`): the client, the cluster's keys and
registered scripts, the cached configuration, the server clock, and the reads and writes the other parts share:
machine records read and parsed (one, many in one round trip, strictly or each on its own), arrays decoded from a
hash, and the write-once hashes (plans, snapshots) with their retention index.

The parts (mixins) composed into :class:`fdeplb.store.Store` call each other only through ``self``; each one's
docstring names what it uses from here.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import redis

from fdeplb.errors import CorruptRecordError, InputError, NotFoundError, RedisUnavailableError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, MachineTable
from fdeplb.store import arrays
from fdeplb.store.cluster_config import ClusterConfig
from fdeplb.store.connection import as_str as _s, as_text as _text, connect, hgetall as _hgetall, typed as _typed, \
    wrong_type as _wrong_type
from fdeplb.store.keys import Keys
from fdeplb.store.records import parse_record, record_type
from fdeplb.store.scripts import script_text
from fdeplb.store.txn import transaction


def _raise(exc: Exception) -> Any:
    raise exc


class StoreBase:
    """The client, keys, scripts and configuration of one cluster's store, and the shared reads and writes (see
    the module doc). ``__init__`` as :class:`fdeplb.store.Store`'s."""

    def __init__(self, url: str, cluster: str, *, socket_timeout_s: float | None = None) -> None:
        self.url = url
        self._client = connect(url, socket_timeout_s)
        self._keys = Keys(cluster)
        self.cluster = cluster
        self._config: ClusterConfig | None = None
        self._commit = self._client.register_script(script_text("commit"))
        self._lease = self._client.register_script(script_text("lease"))
        self._append = self._client.register_script(script_text("audit"))
        self._audit_trim = self._client.register_script(script_text("audit_trim"))
        self._switch = self._client.register_script(script_text("switch"))
        self._weights_cancel = self._client.register_script(script_text("weights_cancel"))
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

    def now_ms(self) -> int:
        """The Redis server's clock in ms (deadlines are compared against it, never a local clock)."""
        sec, usec = self._client.time()
        return int(sec) * 1000 + int(usec) // 1000

    def uptime_ms(self) -> int:
        """How long the Redis server has run (ms, whole seconds: ``INFO server``'s ``uptime_in_seconds``); on
        Redis Cluster, the node the client asks. ``init-cluster`` waits for live reports only within its window
        after a (re)start (:func:`fdeplb.orchestration.recovery.await_live_reports`)."""
        info = self._client.info("server")
        if "uptime_in_seconds" not in info:  # Redis Cluster: one dict per node
            info = next(iter(info.values()))
        return int(info["uptime_in_seconds"]) * 1000

    def read_config(self, fresh: bool = False) -> ClusterConfig:
        """The cluster configuration; :class:`NotFoundError` if the cluster was never initialised,
        :class:`CorruptRecordError` if it does not parse. Cached: only its settings change (``fdeplb config set``,
        :meth:`~fdeplb.store.Store.change_config`, bumping its ``version``), so whoever acts on them reads it
        ``fresh`` (the coordinator between rounds; a commit checking ``cordoned``; an agent checking whether the
        cluster was created anew, another ``incarnation``, after Redis lost its data)."""
        if self._config is None or fresh:
            self._config = self._parse_config(_hgetall(self._client, self._keys.config))
        return self._config

    def _parse_config(self, raw: dict) -> ClusterConfig:
        """The configuration hash ``raw`` (as HGETALL returns it) as a :class:`ClusterConfig`; errors as
        :meth:`read_config`."""
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
            return ClusterConfig.from_json(data)
        except InputError as exc:
            why = str(exc).removeprefix("not a cluster configuration: ")
            raise CorruptRecordError(f"{self._keys.config}: not a cluster configuration: {why}",
                                     key=self._keys.config) from None

    def ep_size(self) -> int:
        """Number of EP ranks of the cluster (from its configuration)."""
        return self.read_config().ep_size

    def _record_key(self, table: MachineTable, ep_rank: int | None) -> str:
        if table is CLUSTER:
            return self._keys.rearrange
        if ep_rank is None:
            raise InputError(f"{table.name} records need an ep_rank")
        if table is MEMBERSHIP:
            return self._keys.member(ep_rank)
        return self._keys.rank(ep_rank) if table is RANK else self._keys.weights(ep_rank)

    @staticmethod
    def _record(table: MachineTable, key: str, raw: dict) -> Any:
        """``raw`` (HGETALL of ``key``) as a typed record of ``table``; errors as :meth:`read`."""
        if not raw:
            raise NotFoundError(f"no {table.name} record at {key}")
        return parse_record(record_type(table), key, _text(raw))

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

    def read_each(self, table: MachineTable) -> list[Any]:
        """Every rank's record of ``table`` (rank or weights), ep_rank order, in one round trip, each on its own: a
        missing record is None and one that does not parse is returned as its :class:`CorruptRecordError` (naming
        the key), not raised, so a reader can show the others (``fdeplb status``, the metrics)."""
        return self._read_records([(table, r) for r in range(self.ep_size())])

    def _array(self, key: str, name: str, raw: dict | None = None) -> np.ndarray | None:
        if raw is None:
            with _typed(key):
                values = self._client.hmget(key, [name, f"{name}:dtype", f"{name}:shape"])
            raw = {name: values[0], f"{name}:dtype": values[1], f"{name}:shape": values[2]}
        try:
            return arrays.decode(name, raw)
        except (InputError, ValueError, TypeError) as exc:
            raise CorruptRecordError(f"{key}: {exc}", key=key) from None

    def _put_once(self, key: str, mapping: dict[str, Any], round_: int, *, unless_supplied: bool = False) -> bool:
        """Write a write-once hash (plans, snapshots) unless it exists, indexed under ``round_`` for pruning
        (:meth:`prune`); returns whether it wrote. ``unless_supplied``: nor when an operator-supplied load for
        ``round_`` is stored (:meth:`supply_load`), checked in the same WATCHed transaction."""
        supplied = self._keys.supplied_load

        def txn(pipe: Any) -> bool:
            if pipe.exists(key):  # used again (plans are content-addressed): retained as of this round
                pipe.unwatch()  # nothing queued: EXEC is not sent
                self._client.zadd(self._keys.retained, {key: int(round_)}, gt=True)
                return False
            if unless_supplied and _s(pipe.hget(supplied, "round")) == str(int(round_)):
                pipe.unwatch()
                return False
            pipe.multi()
            pipe.hset(key, mapping=mapping)
            pipe.zadd(self._keys.retained, {key: int(round_)})
            return True

        return transaction(self._client, txn, key, *([supplied] if unless_supplied else []), value_from_callable=True)
