"""The Redis store: the only module of fdeplb that talks to Redis, and the boundary of its errors.

:class:`Store` is composed the way redis-py composes its commands (one base plus one mixin per Redis structure):
each part owns one structure or one concern, in its own module, and they call each other only through ``self``:

- :mod:`~fdeplb.store.base`: the client, keys, scripts, configuration, server clock and shared record reads;
- :mod:`~fdeplb.store.machine_io`: the machine records, read and committed (``lua/commit.lua``);
- :mod:`~fdeplb.store.intents`: operator requests (round, commit, weights, clear_stat, supplied load);
- :mod:`~fdeplb.store.windows`: load windows and snapshots;
- :mod:`~fdeplb.store.placements`: plans and the current placement;
- :mod:`~fdeplb.store.lease`: the coordinator lease;
- :mod:`~fdeplb.store.streams`: the audit, events and signal streams;
- :mod:`~fdeplb.store.liveness`: the rank registry, heartbeats and switch arming;
- :mod:`~fdeplb.store.retention`: pruning, audit trimming, key counts;
- :mod:`~fdeplb.store.member_repair`: a corrupt member record rewritten from the audit;
- :mod:`~fdeplb.store.bootstrap`: creating, rebuilding and deleting a cluster;
- :mod:`~fdeplb.store.deferred`: calls sent later in one pipeline.

It reads and writes the typed records of :mod:`fdeplb.store.records` and keeps the arrays (loads, snapshots, plans,
placement) as dtype + shape + raw bytes. Callers never see a key, a field name or a redis-py exception: every public
method, whichever part defines it, maps redis-py's errors to fdeplb's once (:mod:`fdeplb.store.connection`, the
pattern of httpx's ``map_httpcore_exceptions``):

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

from fdeplb.store.base import StoreBase
from fdeplb.store.bootstrap import Bootstrap
from fdeplb.store.connection import map_public_methods
from fdeplb.store.deferred import DeferredCalls
from fdeplb.store.intents import Intents
from fdeplb.store.lease import Lease
from fdeplb.store.liveness import Liveness
from fdeplb.store.machine_io import MachineIO
from fdeplb.store.placements import Placements
from fdeplb.store.member_repair import Repair
from fdeplb.store.retention import Retention
from fdeplb.store.streams import Streams
from fdeplb.store.windows import Windows

__all__ = ["Store"]


@map_public_methods
class Store(MachineIO, Intents, Windows, Placements, Lease, Streams, Liveness, Retention, Repair, Bootstrap,
            DeferredCalls, StoreBase):
    """All Redis access of one cluster. Thread-safe as far as redis-py's connection pool is.

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix:///path``.
        cluster: cluster id, ``[A-Za-z0-9_.-]{1,64}``.
        socket_timeout_s: how long a command's reply is awaited (None: the store's default,
            :data:`fdeplb.store.connection.SOCKET_TIMEOUT_S`): a waiter bound by its own deadline passes less.

    Raises:
        InputError: a malformed URL or cluster id. Nothing connects until the first call.
    """
