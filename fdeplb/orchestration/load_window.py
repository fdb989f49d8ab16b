"""The rank's load recorder: where a worker's routed-token counts enter fdeplb, the window that sums them, and the
one path by which the window is published.

Host counts (numpy arrays, lists): :func:`fold_counts` is the one check of a step's counts (integer dtype, shape,
range) and the physical -> logical fold; :class:`ExpertLoadWindow` holds what it returns (int64 [L, E], every
count in [0, int64 max]) and sums it exactly. Device counts (a paddle tensor, or a torch tensor through DLPack):
:class:`DeviceCounts` checks a tensor's dtype and shape once per distinct (shape, dtype, device) and keeps a copy
of the step on its device; the window sums, folds and checks its device steps when it is published
(:mod:`fdeplb.orchestration.device_window`), so ``record()`` reads nothing back from the device.

:class:`LoadRecorder` (mixed into the rank agent) is ``record()``, the ``clear_stat`` request and the publication:
a round's collection and the periodic one both go through :meth:`LoadRecorder._defer_window`, where the store
checks the window as it lays out the write (``Store.deferred_publish``: at most ``fdeplb.placement.MAX_LOAD`` =
2**53 per count, whole numbers: a fractional window is refused, never truncated).

The two ceilings differ on purpose (a test pins the window's): the window accumulates exactly up to the int64
range (so that it never wraps, however long it runs), the store publishes only what float64 holds exactly.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np
import structlog

from fdeplb.errors import FdeplbError, InputError
from fdeplb.machines.tables import ClusterState
from fdeplb.orchestration.device_window import (INT_DTYPES, DeviceStep, StepCopies, count_device, count_dtype,
                                                device_tensor, window_sum)
from fdeplb.store import ClusterConfig, ClusterRecord

#: returns the rank's expert_load window, int64 [num_layers, num_logical_experts], for a round.
LoadSource = Callable[[int], np.ndarray]

INT64_MAX = int(np.iinfo(np.int64).max)

log = structlog.get_logger("fdeplb.agent")


def check_physical(physical: Any) -> None:
    """``physical`` is a bool (numpy's too) or None.

    Raises:
        InputError: anything else (the string ``"false"`` is not False, 0 is not False).
    """
    if physical is not None and not isinstance(physical, (bool, np.bool_)):
        raise InputError(f"physical must be True, False or None, got {physical!r} ({type(physical).__name__})")


def counts_physical(shape: tuple[int, ...], phy2log_shape: tuple[int, int], num_logical: int,
                    physical: bool | None) -> bool:
    """The one shape rule of a step's counts: True for per-slot counts ([L, P]), False for logical ones ([L, E]).
    ``physical`` None: by shape (when E == P a [L, E] array is taken as logical).

    Raises:
        InputError: neither shape (or not the one ``physical`` names); ``physical`` not a bool or None (the
            string ``"false"`` is not False).
    """
    check_physical(physical)
    num_layers, num_phy = phy2log_shape
    wanted = f"{(num_layers, num_logical)} (logical) or {(num_layers, num_phy)} (physical)"
    if physical is None:
        physical = shape == (num_layers, num_phy) and num_phy != num_logical
    else:
        physical = bool(physical)
        wanted = f"{(num_layers, num_phy) if physical else (num_layers, num_logical)} (physical={physical})"
    expected = (num_layers, num_phy) if physical else (num_layers, num_logical)
    if shape != expected:
        raise InputError(f"expert counts have shape {shape}, expected {wanted}")
    return physical


class DeviceCounts:
    """A worker's device tensors of counts, one step at a time: the dtype (an integer one) and shape
    (:func:`counts_physical`) are checked once per distinct (shape, dtype, ``physical``, device) and remembered; a
    step of a known kind costs one device copy and no read. The copies of a kind live on its device: a step is
    never copied to another device. Counts on a second device (a warm-up step's on the CPU, the rest on the GPU)
    are kept and summed on that device, each device read once per publication; a warning says so the first time
    (:func:`~fdeplb.orchestration.device_window.window_sum`). The values (negative counts, the int64 range) are
    checked when the window is published. ``window_steps``: the window's step limit, the copies reserved for a
    kind when it is first seen (:class:`~fdeplb.orchestration.device_window.StepCopies`)."""

    #: kinds remembered at most (a dtype object that is not a singleton would only cost re-checks)
    MAX_KINDS = 64

    def __init__(self, window_steps: int | None = None) -> None:
        # (*shape, id(dtype), physical, device) -> (dtype, per-slot counts, the kind's copies); the dtype kept
        # alive keeps its id unique
        self._known: dict[tuple, tuple[Any, bool, StepCopies]] = {}
        self.window_steps = window_steps
        self._copies: dict[tuple, StepCopies] = {}

    def step(self, t: Any, live_phy2log: np.ndarray, num_logical: int, physical: bool | None) -> DeviceStep:
        """The :class:`~fdeplb.orchestration.device_window.DeviceStep` of ``t`` (a paddle tensor, [L, E] or
        [L, P], any integer dtype, on one device), tagged with ``live_phy2log`` (int64 [L, P], the placement the
        step routed with; replaced, never changed in place, when the placement changes).

        Raises:
            InputError: not an integer dtype (float, bool), or a wrong shape.
        """
        key = (*t.shape, id(t.dtype), physical, count_device(t))  # host metadata only: ~1 us, no device work
        known = self._known.get(key)
        if known is None:
            known = self._check(t, key, live_phy2log, num_logical, physical, key[-1])
        copies = known[2]
        return DeviceStep(copies.copy(t), live_phy2log if known[1] else None, copies.device)

    def _check(self, t: Any, key: tuple, live_phy2log: np.ndarray, num_logical: int,
               physical: bool | None, device: Any) -> tuple[Any, bool, StepCopies]:
        """The first step of a kind: dtype and shape checked, the kind remembered."""
        name = count_dtype(t)
        if name not in INT_DTYPES:
            raise InputError(f"expert counts must be an integer array, got dtype {name}")
        per_slot = counts_physical(tuple(t.shape), live_phy2log.shape, num_logical, physical)
        if len(self._known) >= self.MAX_KINDS:
            self._known.clear()
        kind = (tuple(t.shape), name, device)  # the copies of a shape, dtype and device, whatever ``physical`` says
        copies = self._copies.get(kind)
        if copies is None:
            devices = {c.device for c in self._copies.values()}
            if devices and device not in devices:
                log.warning("expert counts on another device: kept and summed there, one more device-to-host "
                            "copy per publication; record the counts on one device", device=str(t.place))
            copies = self._copies[kind] = StepCopies(device, self.window_steps)
        known = self._known[key] = (t.dtype, per_slot, copies)
        return known


def fold_counts(counts: Any, live_phy2log: np.ndarray, num_logical: int, *, physical: bool | None = None) -> np.ndarray:
    """One forward step's routed tokens as logical-expert counts, int64 [num_layers, num_logical].

    ``counts``: tokens x top-k assignments per logical expert, [num_layers, num_logical], or per physical slot,
    [num_layers, num_physical] (summed into logical experts through ``live_phy2log``, int64 [L, P], the placement
    the step routed with); a numpy array or a paddle tensor (anything with ``.numpy()``), or a nested list, of any
    integer dtype. ``physical`` says which (None: by shape; when E == P a [L, E] array is taken as logical).

    Raises:
        InputError: not an integer array (float, NaN, bool, ragged), wrong shape, a negative count, or a count past
            the int64 range (also once summed per logical expert).
    """
    arr = counts
    if not isinstance(arr, np.ndarray):
        try:
            arr = arr.numpy() if hasattr(arr, "numpy") else np.asarray(arr)
        except ValueError as err:  # a ragged nested list
            raise InputError(f"expert counts are not an array: {err}") from None
    if arr.dtype.kind == "O" and arr.size and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                  for v in arr.flat):  # Python ints numpy could not hold
        if min(arr.flat) < 0:
            raise InputError(f"expert counts must be >= 0, found {min(arr.flat)}")
        raise InputError(f"expert count {max(arr.flat)} is past the int64 range")
    if arr.dtype.kind not in "iu":
        raise InputError(f"expert counts must be an integer array, got dtype {arr.dtype}")
    num_layers, num_phy = live_phy2log.shape
    num_log = int(num_logical)
    physical = counts_physical(arr.shape, live_phy2log.shape, num_log, physical)
    if arr.size:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise InputError(f"expert counts must be >= 0, found {int(arr.min())}")
        if arr.dtype.kind == "u" and int(arr.max()) > INT64_MAX:
            raise InputError(f"expert count {int(arr.max())} is past the int64 range")
    arr = arr.astype(np.int64)
    if not physical:
        return arr
    # a layer's row sum bounds each of its logical sums: past int64 // P, fold exactly in Python ints
    wide = arr.size and int(arr.max()) > INT64_MAX // num_phy
    logical = np.zeros((num_layers, num_log), dtype=object if wide else np.int64)
    np.add.at(logical, (np.arange(num_layers)[:, None], live_phy2log), arr.astype(logical.dtype))
    if wide and max(logical.ravel().tolist()) > INT64_MAX:
        raise InputError("expert counts per slot sum past the int64 range for a logical expert")
    return logical.astype(np.int64)


class ExpertLoadWindow:
    """The rank's sliding expert_load window: the last ``steps`` recorded steps (vLLM's ``expert_load_window``)
    and/or the steps of the last ``seconds`` seconds, summed in int64 (exact past 2**31, where FastDeploy's int32
    accumulator wraps). Thread-safe: the worker adds, the agent's background thread reads.

    Host steps (:meth:`add`) are summed as they come; device steps (:meth:`add_device`) are one bucket each, kept on
    their device and summed, folded and checked there by :meth:`total` (every step expires as today's host steps
    do: by count and by age). A device step :meth:`total` refuses (a negative count, past the int64 range) is
    dropped from the window then (counted in :attr:`refused_steps`).

    Args:
        num_layers, num_logical_experts: the shape [L, E] of one step's load.
        steps: keep at most this many steps (None: no step limit; then ``seconds`` is needed).
        seconds: drop steps older than this (None: no time limit).
        clock: monotonic seconds (tests pass their own).

    Raises:
        InputError: neither limit given, or a limit that is not positive.
    """

    def __init__(self, num_layers: int, num_logical_experts: int, *, steps: int | None = 1000,
                 seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if steps is None and seconds is None:
            raise InputError("a load window needs steps, seconds or both")
        if (steps is not None and int(steps) < 1) or (seconds is not None and not float(seconds) > 0):
            raise InputError(f"load window limits must be positive, got steps={steps!r} seconds={seconds!r}")
        self.shape = (int(num_layers), int(num_logical_experts))
        self.max_steps = None if steps is None else int(steps)
        self.seconds = None if seconds is None else float(seconds)
        self.clock = clock
        # (time, step, number): numbers count every step up; a device step's number places it in a block
        self._entries: collections.deque[tuple[float, np.ndarray | DeviceStep, int]] = collections.deque()
        self._recorded = 0
        self._total = np.zeros(self.shape, dtype=np.int64)  # of the host steps
        self._device_steps = 0
        self._blocks: dict[tuple, Any] = {}  # whole blocks' device sums (window_sum's)
        #: device steps :meth:`total` refused and dropped, ever (the publisher retries once after a drop)
        self.refused_steps = 0
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # one reader of the device steps at a time: they share the blocks

    def add(self, load: np.ndarray) -> None:
        """Add one step's load, int64 [L, E], each count >= 0 (what :func:`fold_counts` returns: not checked
        again here; the window keeps ``load`` itself).

        Raises:
            InputError: the window's sum would pass the int64 range (it would wrap to negative counts); nothing
                is added then.
        """
        now = self.clock()
        with self._lock:
            self._expire(now)  # time-based: would drop on any read as well
            full = self.max_steps is not None and len(self._entries) == self.max_steps
            oldest = self._entries[0][1] if full else None
            kept = self._total - oldest if isinstance(oldest, np.ndarray) else self._total  # >= 0: no wrap below
            # per serving step: the two maxima bound every sum; the elementwise test only when they could wrap
            if (load.size and int(load.max()) > INT64_MAX - int(np.max(kept))
                    and bool(np.any(load > INT64_MAX - kept))):
                raise InputError("expert counts would take the load window's sum past the int64 range")
            if full:
                self._drop_oldest()
            self._entries.append((now, load, self._recorded))
            self._recorded += 1
            self._total += load

    def add_device(self, step: DeviceStep) -> None:
        """Add one step kept on its device (:class:`DeviceCounts`): no device work here, no read; its values are
        checked when the window is read (:meth:`total`). It counts toward the step limit from now: a step refused
        later has pushed the oldest one out (the next step taken fills its place, no step is pushed out then)."""
        now = self.clock()
        with self._lock:
            if self.seconds is not None:
                self._expire(now)
            if len(self._entries) == self.max_steps:
                self._drop_oldest()
            self._entries.append((now, step, self._recorded))
            self._recorded += 1
            self._device_steps += 1

    def _drop_oldest(self) -> None:
        load = self._entries.popleft()[1]
        if isinstance(load, np.ndarray):
            self._total -= load
        else:
            self._device_steps -= 1

    def _expire(self, now: float) -> None:
        if self.seconds is not None:
            while self._entries and self._entries[0][0] < now - self.seconds:
                self._drop_oldest()

    def total(self) -> np.ndarray:
        """The window's sum, int64 [L, E] (a copy). With device steps: summed on their device, one device-to-host
        copy (:func:`~fdeplb.orchestration.device_window.window_sum`), outside the lock (the worker records on).

        Raises:
            InputError: a device step has a negative count, or the window's sum would pass the int64 range (the
                message is the one ``record()`` gives a host step); the steps refused are dropped from the window
                (a step with a negative count; past the range: each step that would take the sum, host steps
                first, then device steps oldest first, past it), the others kept.
        """
        with self._publish_lock:
            with self._lock:
                self._expire(self.clock())
                base = self._total.copy()
                if not self._device_steps:
                    return base
                device = [(e, n) for _, e, n in self._entries if isinstance(e, DeviceStep)]
            steps = [e for e, _ in device]
            result = window_sum(steps, [n for _, n in device], base, self._blocks)
        if result.total is not None:
            return result.total
        refused = {id(steps[i]) for i in result.bad}
        with self._lock:  # those of the refused steps still in the window (some may have expired meanwhile)
            kept = [entry for entry in self._entries if id(entry[1]) not in refused]
            self._device_steps -= len(self._entries) - len(kept)
            self._entries = collections.deque(kept)
            self.refused_steps += len(refused)
        raise InputError(result.error)

    def __len__(self) -> int:
        """Steps in the window."""
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Empty the window (FastDeploy's ``clear_stat``)."""
        with self._publish_lock, self._lock:
            self._entries.clear()
            self._total[...] = 0
            self._device_steps = 0
            self._blocks.clear()


class LoadRecorder:
    """The rank agent's load: :meth:`record` (the worker's side), the ``clear_stat`` request and the publication
    of the window (:meth:`_load_step`, once per reconcile step). Mixed into
    :class:`~fdeplb.orchestration.agent.RankAgent`; it uses, of its host: ``store``, ``ep_rank``, ``log``, the
    rank-record handle ``rank``, ``_outbox`` (the step's deferred writes), ``backend`` and ``_live_phy2log`` (the
    placement the worker routes with). The host resets ``_published_round`` to -1 when a write's fate is unknown.
    """

    store: Any
    ep_rank: int
    log: Any
    rank: Any
    backend: Any
    _outbox: list
    _live_phy2log: np.ndarray | None

    def _init_load(self, load_source: LoadSource | None, window_steps: int | None, window_s: float | None,
                   publish_interval_s: float | None) -> None:
        """``load_source`` defaults to the window's total; ``window_steps`` / ``window_s``: the window's limits
        (:class:`ExpertLoadWindow`); ``publish_interval_s``: also publish this often (None: only to collect)."""
        self.load_source = load_source or (lambda _round: self.window.total())
        self.window_steps, self.window_s = window_steps, window_s
        self.window: ExpertLoadWindow | None = None
        self.publish_interval_s = publish_interval_s
        self._live_phy2log = None
        self._device_counts = DeviceCounts(window_steps)
        self._next_publish = 0.0
        self._published_round = -1  # the newest round this agent knows its window was published for
        self._load_failed_round = -1
        self._load_retried_round = -1  # the round whose publication was retried after the window dropped bad steps
        self._clear_stat_seen = 0

    def _open_window(self, config: ClusterConfig) -> None:
        """At start-up: the window of the cluster's shape (kept across restarts of the same agent), and the
        ``clear_stat`` request it has carried out (a fresh window is empty)."""
        if self.window is None:
            self.window = ExpertLoadWindow(config.num_layers, config.num_logical_experts,
                                           steps=self.window_steps, seconds=self.window_s)
        self._clear_stat_seen = self.store.read_cluster().clear_stat_request

    def _follow_routing(self) -> None:
        """After a change of the live experts: fold with the placement the backend holds now (its ``phy2log``)."""
        self._live_phy2log = self.backend.phy2log

    def record(self, counts: Any, *, physical: bool | None = None) -> None:
        """Add one forward step's routed tokens to the load window. Call once per step from the worker.

        ``counts``: tokens x top-k assignments per logical expert, [num_layers, num_logical_experts], or per
        physical slot, [num_layers, num_physical_experts] (summed into logical experts through the *live* phy2log,
        the one the step routed with), of any integer dtype. ``physical`` says which (None: by shape; when E == P
        a [L, E] array is taken as logical; anything but a bool or None is an ``InputError``). Accumulated in int64,
        exactly.

        - A numpy array (or a nested list): checked and folded at once, on the host
          (:func:`~fdeplb.orchestration.load_window.fold_counts`).
        - A paddle tensor (or a torch tensor, taken through DLPack without a copy), on any device: kept on that
          device, one device copy per step and nothing read back (no ``.numpy()``, no sync): dtype and shape are
          checked the first time a (shape, dtype) is seen (:class:`DeviceCounts`), the values (negative counts,
          the int64 range) when the window is published, where a bad step is refused with the same message and
          dropped, and the window is not published (an alarm says why); a round's collection retries it once,
          without the dropped steps, at the next step.

        Raises:
            InputError: not an integer array (float, NaN, bool, ragged), wrong shape, ``physical`` not a bool or
                None, a host step with a negative
                count or a count past the int64 range (also once summed per logical expert or into the window), or
                the agent is not started. Nothing is recorded then.
        """
        if self.window is None or self._live_phy2log is None:
            raise InputError("record() before start(): the agent has no load window yet")
        check_physical(physical)
        tensor = device_tensor(counts)
        if tensor is None:
            self.window.add(fold_counts(counts, self._live_phy2log, self.window.shape[1], physical=physical))
        else:
            self.window.add_device(self._device_counts.step(tensor, self._live_phy2log, self.window.shape[1],
                                                            physical))

    def _load_step(self, cluster: ClusterRecord) -> None:
        """One reconcile step's load work: carry out a new ``clear_stat`` request, publish the window when the
        round collects, and publish it every ``publish_interval_s`` (the same checked path)."""
        if cluster.clear_stat_request > self._clear_stat_seen:
            self.window.clear()
            self._clear_stat_seen = cluster.clear_stat_request
            self.rank.update(clear_stat=cluster.clear_stat_request)
        published = cluster.state is ClusterState.COLLECTING and self._publish_load(cluster)
        if self.publish_interval_s and time.monotonic() >= self._next_publish:
            self._next_publish = time.monotonic() + self.publish_interval_s
            if not published:  # just put in the outbox: once is enough
                self._defer_window(cluster.round)

    def _publish_load(self, cluster: ClusterRecord) -> bool:
        """COLLECTING: publish the window for the cluster's round once (a fresh process looks up what a previous
        one published); True if a publication went into the outbox. A load source that fails is reported once per
        round: publish nothing, the coordinator's collecting deadline aborts the round and names this rank. One
        exception: a window refused for device steps it then dropped (:attr:`ExpertLoadWindow.refused_steps`: a
        negative count, past the int64 range) is retried once, at the next step, without them."""
        round_ = cluster.round
        if self._published_round < 0:  # a fresh process: a previous one may have published for this round
            self._published_round = self.store.load_round(self.ep_rank) or 0
        if self._published_round >= round_ or self._load_failed_round == round_:
            return False
        refused = self.window.refused_steps
        if not self._defer_window(round_):
            if self.window.refused_steps > refused and self._load_retried_round != round_:
                self._load_retried_round = round_  # the bad steps are gone: the next step publishes the rest, once
                return False
            self._load_failed_round = round_  # once per round: no retry storm
            return False
        self._published_round = round_  # reset to "look it up" if the write is refused or its fate unknown
        return True

    def _defer_window(self, round_: int) -> bool:
        """The one publish path (a round's collection and the periodic ``publish_interval_s``): the load source's
        window for ``round_``, checked as the store lays out its write (:meth:`fdeplb.store.Store.deferred_publish`:
        an int64-convertible [L, E] of whole counts in [0, 2**53]; a fractional one is refused, never truncated)
        and put in the outbox, sent with the next wait. False, with an alarm, when the source failed or its window
        was refused (the agent goes on)."""
        try:
            window = self.load_source(round_)
        except Exception as err:  # noqa: BLE001 - the engine's recorder is foreign code; never kill the agent
            return self._load_source_failed(round_, err)
        try:
            call = self.store.deferred_publish(self.ep_rank, round_, window)
        except InputError as err:  # the window's check refused it
            return self._load_source_failed(round_, err)
        except FdeplbError:
            raise  # the store's own trouble (Redis away, a corrupt config): the loop retries
        except Exception as err:  # noqa: BLE001 - a foreign array-like that fails to convert
            return self._load_source_failed(round_, err)
        self._outbox.append(call)
        return True

    def _load_source_failed(self, round_: int, err: Exception) -> bool:
        self.log.error("load source failed", round=round_, error=str(err))
        self.store.emit_event("alarm", rank=self.ep_rank, message=f"load source failed: {err}")
        return False
