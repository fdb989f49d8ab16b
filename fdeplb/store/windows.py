"""Load windows and snapshots: each rank's published expert_load window (``lua/publish.lua``: the window, its
server time and its wake-up event in one call), the round's frozen snapshot (write-once, against an operator-supplied
load), the supplied load itself, and their corruption checks on read (int64 [L, E] in [0, 2**53] for the cluster's
configuration).

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_publish`` (the registered script),
``_array``, ``_put_once``, ``read_config``, ``ep_size``; from :mod:`fdeplb.store.deferred`: ``_deferred_script``.
"""

from __future__ import annotations

import numpy as np

from fdeplb.errors import CorruptRecordError, InputError
from fdeplb.placement import MAX_LOAD, check_counts
from fdeplb.store import arrays
from fdeplb.store.connection import as_str as _s, hgetall as _hgetall
from fdeplb.store.deferred import PendingCall
from fdeplb.store.records import LoadWindow
from fdeplb.store.scripts import CommitCall, publish_call
from fdeplb.store.streams import EVENTS_MAXLEN


def snapshot_fields(round_: int, expert_load: np.ndarray, source_load: np.ndarray | None = None
                    ) -> dict[str, str | bytes]:
    """The hash fields of round ``round_``'s load snapshot (``expert_load`` as int64 [L, E]; ``source_load``, its
    split per source rank as int64 [L, ep_size, E], when kept): the one layout of :meth:`Windows.save_snapshot`,
    :meth:`Windows.freeze_windows` and a rebuild (:meth:`fdeplb.store.Store.import_recording`)."""
    split = {} if source_load is None else arrays.encode("source_load", np.asarray(source_load, dtype=np.int64))
    return {**arrays.encode("expert_load", np.asarray(expert_load, dtype=np.int64)), **split,
            "round": str(int(round_))}


class Windows:
    """Load windows, snapshots and the supplied load (see the module doc)."""

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

    def save_snapshot(self, round_: int, expert_load: np.ndarray) -> bool:
        """Freeze round ``round_``'s load snapshot (int64 [L, E]); write-once (False if one is stored)."""
        return self._put_once(self._keys.snapshot(round_), snapshot_fields(round_, expert_load), round_)

    def freeze_windows(self, round_: int, expert_load: np.ndarray, source_load: np.ndarray | None = None) -> bool:
        """Freeze round ``round_``'s snapshot from the ranks' windows (``expert_load``, int64 [L, E], their sum;
        ``source_load``, int64 [L, ep_size, E] whose sum over ranks is ``expert_load``: the windows unsummed, kept
        with it when given) unless a load was supplied for the round meanwhile (:meth:`supply_load`, whose write checks the snapshot in
        a WATCHed transaction as this one checks the supplied load): of the two, the first to commit wins, so a
        load the API accepted is never passed over. False when a supplied load is there (nothing written: freeze
        that one); True otherwise (written, or a snapshot was frozen already)."""
        if self._put_once(self._keys.snapshot(round_), snapshot_fields(round_, expert_load, source_load), round_,
                          unless_supplied=True):
            return True
        return bool(self._client.exists(self._keys.snapshot(round_)))

    def read_snapshot(self, round_: int) -> np.ndarray | None:
        """Round ``round_``'s load snapshot, int64 [L, E], or None; :class:`CorruptRecordError` naming the key
        for a stored value of the wrong dtype, shape or range."""
        key = self._keys.snapshot(round_)
        arr = self._array(key, "expert_load")
        return None if arr is None else self._loads(key, arr)

    def read_source_load(self, round_: int) -> np.ndarray | None:
        """Round ``round_``'s snapshot per source rank, int64 [L, ep_size, E] (None: no snapshot, or one kept
        summed only); :class:`CorruptRecordError` naming the key for a split of the wrong dtype, shape or range, or
        whose sum over ranks is not the snapshot."""
        key = self._keys.snapshot(round_)
        split = self._array(key, "source_load")
        if split is None:
            return None
        total = self.read_snapshot(round_)
        cfg = self.read_config()
        shape = (cfg.num_layers, cfg.ep_size, cfg.num_logical_experts)
        if split.dtype != np.int64 or split.shape != shape:
            raise CorruptRecordError(f"{key}: source_load is {split.dtype} {split.shape}, expected int64 {shape}",
                                     key=key)
        if split.size and (split.min() < 0 or split.max() > MAX_LOAD or total is None
                           or not np.array_equal(split.sum(axis=1), total)):
            raise CorruptRecordError(f"{key}: source_load holds values outside [0, 2**53] or does not sum to "
                                     f"expert_load", key=key)
        return split

    def supplied_load(self, round_: int) -> np.ndarray | None:
        """The operator-supplied expert_load (int64 [L, E]) for round ``round_``, or None."""
        key = self._keys.supplied_load
        raw = {_s(k): v for k, v in _hgetall(self._client, key).items()}
        if not raw or _s(raw.get("round", b"")) != str(int(round_)):
            return None
        return self._array(key, "expert_load", raw)

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
