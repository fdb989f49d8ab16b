"""Per-rank transfer plan between two placements: keep, local copy or load from disk. Pure numpy.

For each MoE layer and each slot of one EP rank (slots ``[ep_rank*S, (ep_rank+1)*S)`` with ``S = P / ep_size``):

- **keep**: the slot already holds the expert it needs; nothing moves.
- **local**: the expert is already on this rank (in another slot, in the old placement); copy slot to slot.
- **disk**: the expert is new to the rank; it is read from the checkpoint **once** per (layer, expert) even when
  several slots of the rank need it.

Local copies can read a slot that the same swap overwrites (two slots exchanging experts, or a chain). The plan
orders them so every slot is read before it is written; a cycle is broken by snapshotting one slot (one expert of
extra device memory, freed after the layer). Disk writes run after all local copies of their layer.

A swap is applied in **chunks** of whole layers, one chunk per safe point (:func:`chunk_starts`,
:func:`chunk_layers`): every write of a layer stays within its layer, so a layer is the unit that switches with
its routing rows.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fdeplb.checks import check_int
from fdeplb.errors import InputError, TopologyError
from fdeplb.placement.core import derive_maps

KEEP, LOCAL, DISK = 0, 1, 2
ACTION_NAMES = ("keep", "local", "disk")


class Step(NamedTuple):
    """One write of a swap, in execution order.

    ``kind``: ``"snapshot"`` (copy ``slot``'s current contents aside), ``"local"`` (copy slot ``source`` into
    ``slot``), ``"from_snapshot"`` (copy the snapshot of slot ``source`` into ``slot``) or ``"disk"`` (copy staged
    expert number ``source``, an index into :attr:`TransferPlan.disk`, into ``slot``). Slots are rank-local indices.
    """

    kind: str
    layer: int
    slot: int
    source: int


def _as_placement(name: str, phy2log: np.ndarray) -> np.ndarray:
    arr = np.asarray(phy2log)
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(f"{name} must be a non-empty int array [num_layers, num_physical_experts], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def rank_slots(num_physical_experts: int, ep_rank: int, ep_size: int) -> slice:
    """Slice of the physical slots owned by ``ep_rank``: ``[ep_rank*P/ep_size, (ep_rank+1)*P/ep_size)``.

    Raises:
        TopologyError: ``ep_size`` < 1, ``ep_rank`` outside ``[0, ep_size)``, or P not a multiple of ``ep_size``.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise TopologyError(f"ep_rank {ep_rank} is not in [0, ep_size={ep_size})")
    if num_physical_experts % ep_size:
        raise TopologyError(f"num_physical_experts {num_physical_experts} is not a multiple of ep_size {ep_size}")
    per_rank = num_physical_experts // ep_size
    return slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """What one EP rank must do to go from ``old`` to ``new``; built by :func:`plan_transfer`.

    Attributes:
        ep_rank, ep_size: the rank and the EP world size.
        old, new: int64 [L, S], the rank's slots in the old / new placement (``old`` may hold -1: empty slot).
        action: int8 [L, S], :data:`KEEP` / :data:`LOCAL` / :data:`DISK` per slot.
        disk: ``(layer, logical expert)`` pairs read from the checkpoint, each once, in (layer, slot) order.
        steps: every write of the swap, in a safe execution order (see :class:`Step`).
    """

    ep_rank: int
    ep_size: int
    old: np.ndarray
    new: np.ndarray
    action: np.ndarray
    disk: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]

    @property
    def num_layers(self) -> int:
        return int(self.new.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self.new.shape[1])

    @property
    def counts(self) -> dict[str, int]:
        """``keep`` and ``local``: slots; ``disk``: experts read from the checkpoint (a duplicate counts once)."""
        return {
            "keep": int(np.count_nonzero(self.action == KEEP)),
            "local": int(np.count_nonzero(self.action == LOCAL)),
            "disk": len(self.disk),
        }

    @property
    def disk_slots(self) -> int:
        """Slots written from staging (>= ``counts["disk"]`` when a rank needs one new expert in two slots)."""
        return int(np.count_nonzero(self.action == DISK))

    @property
    def changed(self) -> np.ndarray:
        """bool [L, S]: slots the swap writes (every one of them is verified)."""
        return self.action != KEEP

    @property
    def num_snapshots(self) -> int:
        """Slots copied aside to break local-copy cycles (each costs one expert of device memory, per layer)."""
        return sum(1 for s in self.steps if s.kind == "snapshot")

    def layer_nbytes(self, expert_nbytes: int) -> np.ndarray:
        """int64 [L]: bytes the swap writes into this rank's slots per layer (changed slots and snapshots, each
        ``expert_nbytes``); 0 for a layer that does not change on this rank."""
        per_layer = np.count_nonzero(self.changed, axis=1).astype(np.int64)
        for s in self.steps:
            if s.kind == "snapshot":
                per_layer[s.layer] += 1
        return per_layer * int(expert_nbytes)

    def nbytes(self, expert_nbytes: int) -> dict[str, int]:
        """Bytes per kind for experts of ``expert_nbytes`` bytes: ``keep`` (not moved), ``local`` (copied on the
        device), ``disk`` (read from the checkpoint and staged in host memory)."""
        return {k: v * int(expert_nbytes) for k, v in self.counts.items()}

    @property
    def key(self) -> str:
        """Content hash of (ep_rank, ep_size, old, new): ties staging and swap to one plan."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.array([self.ep_rank, self.ep_size, *self.new.shape], dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.old).tobytes())
        h.update(np.ascontiguousarray(self.new).tobytes())
        return h.hexdigest()

    def summary(self) -> dict:
        """JSON-ready summary: rank, counts, disk slots, snapshots."""
        return {
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
            "num_layers": self.num_layers,
            "slots_per_rank": self.slots_per_rank,
            **self.counts,
            "disk_slots": self.disk_slots,
            "snapshots": self.num_snapshots,
        }


def _order_local_copies(layer: int, local: dict[int, int], new_row: list[int]) -> list[Step]:
    """Order ``dst <- src`` copies of one layer so each slot is read before it is overwritten.

    ``local`` maps destination slot -> source slot (in the old placement). A destination that other copies read is
    written only once those reads are done. When only cycles remain, the readers of the smallest blocked slot are
    re-pointed to a slot already written with the same expert if there is one, else that slot is snapshotted and its
    readers read the snapshot.
    """
    local = dict(local)
    pending = {d: 0 for d in local}
    for s in local.values():
        if s in pending:
            pending[s] += 1
    holder: dict[int, int] = {}  # expert -> a finished slot holding it (never written again)
    snapped: set[int] = set()
    ready = [d for d, n in pending.items() if n == 0]
    heapq.heapify(ready)
    done: set[int] = set()
    steps: list[Step] = []
    while len(done) < len(local):
        if not ready:  # every remaining destination still has a pending reader: only cycles are left
            victim = min(d for d in local if d not in done)
            readers = [d for d in local if d not in done and local[d] == victim]
            expert = new_row[readers[0]]
            if expert in holder:
                for d in readers:
                    local[d] = holder[expert]
            else:
                steps.append(Step("snapshot", layer, victim, victim))
                snapped.add(victim)
            pending[victim] = 0
            heapq.heappush(ready, victim)
            continue
        d = heapq.heappop(ready)
        s = local[d]
        steps.append(Step("from_snapshot" if s in snapped else "local", layer, d, s))
        done.add(d)
        holder.setdefault(new_row[d], d)
        if s in pending and s not in snapped and s not in done:
            pending[s] -= 1
            if pending[s] == 0:
                heapq.heappush(ready, s)
    return steps


def plan_transfer(old_phy2log: np.ndarray, new_phy2log: np.ndarray, ep_rank: int, ep_size: int) -> TransferPlan:
    """Classify every slot of ``ep_rank`` as keep / local copy / disk load, and order the writes.

    Args:
        old_phy2log: int [L, P], the placement the rank holds now (the whole cluster's); -1 marks an empty slot
            (e.g. a rank loading from scratch).
        new_phy2log: int [L, P], the target placement; every entry a logical expert id >= 0.
        ep_rank, ep_size: the rank; its slots are ``[ep_rank*P/ep_size, (ep_rank+1)*P/ep_size)``.

    A local copy prefers a source slot that is kept (its contents do not change in this swap), so snapshots are only
    needed for genuine cycles. Deterministic: ties go to the lowest slot index.

    Raises:
        InputError: shapes differ, non-integer dtype, -1 or other negatives in ``new_phy2log``, values < -1 in
            ``old_phy2log``.
        TopologyError: P not a multiple of ``ep_size`` or ``ep_rank`` out of range.
    """
    old_all = _as_placement("old_phy2log", old_phy2log)
    new_all = _as_placement("new_phy2log", new_phy2log)
    if old_all.shape != new_all.shape:
        raise InputError(f"old_phy2log {old_all.shape} and new_phy2log {new_all.shape} differ in shape")
    if (new_all < 0).any():
        raise InputError("new_phy2log holds negative expert ids; every slot of a target placement needs an expert")
    if (old_all < -1).any():
        raise InputError("old_phy2log holds ids below -1 (-1 is the only marker of an empty slot)")
    sl = rank_slots(old_all.shape[1], ep_rank, ep_size)
    old = np.ascontiguousarray(old_all[:, sl])
    new = np.ascontiguousarray(new_all[:, sl])
    num_layers, slots = new.shape

    action = np.full((num_layers, slots), KEEP, dtype=np.int8)
    disk: list[tuple[int, int]] = []
    steps: list[Step] = []
    for layer in range(num_layers):
        o, n = old[layer].tolist(), new[layer].tolist()
        kept = {e for e, f in zip(o, n) if e == f}
        first_kept: dict[int, int] = {}
        first_any: dict[int, int] = {}
        for s, e in enumerate(o):
            if e < 0:
                continue
            first_any.setdefault(e, s)
            if e == n[s]:
                first_kept.setdefault(e, s)
        local: dict[int, int] = {}
        disk_index: dict[int, int] = {}
        disk_steps: list[Step] = []
        for s, e in enumerate(n):
            if o[s] == e:
                continue
            if e in first_any:
                action[layer, s] = LOCAL
                local[s] = first_kept[e] if e in kept else first_any[e]
            else:
                action[layer, s] = DISK
                if e not in disk_index:
                    disk_index[e] = len(disk)
                    disk.append((layer, e))
                disk_steps.append(Step("disk", layer, s, disk_index[e]))
        steps.extend(_order_local_copies(layer, local, n))
        steps.extend(disk_steps)
    return TransferPlan(ep_rank, ep_size, old, new, action, tuple(disk), tuple(steps))


def routing_tables(phy2log: np.ndarray, num_logical_experts: int, max_replicas: int,
                   live: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Derive ``log2phy`` int64 [L, E, max_replicas] (-1 padded, physical ids ascending) and ``logcnt`` int64 [L, E].

    ``live``: bool [ep_size], the EP ranks routed to (None: every rank). With some rank not live, only the live
    ranks' slots are named (:func:`fdeplb.placement.live_maps`, which raises
    :class:`~fdeplb.errors.RedundancyError` when an expert has no live replica).

    The width ``max_replicas`` is fixed (not the placement's current maximum) so the routing tensors keep their shape,
    and can be updated in place, across placements (FastDeploy sizes them ``num_redundant_experts + 1``).

    Raises:
        InputError: an id outside ``[0, num_logical_experts)``, a logical expert with no replica, or one with more
            than ``max_replicas`` replicas.
    """
    p2l = _as_placement("phy2log", phy2log)
    num_layers = p2l.shape[0]
    if p2l.min() < 0 or p2l.max() >= num_logical_experts:
        raise InputError(f"phy2log ids must lie in [0, {num_logical_experts})")
    if live is not None and not np.asarray(live).all():
        from fdeplb.placement.live_ranks import live_maps

        derived, logcnt = live_maps(p2l, num_logical_experts, len(live), np.asarray(live, dtype=bool))
    else:
        derived, logcnt = derive_maps(p2l, num_logical_experts)
    if (logcnt == 0).any():
        layer, expert = map(int, np.argwhere(logcnt == 0)[0])
        raise InputError(f"logical expert {expert} of layer {layer} has no replica in phy2log")
    if logcnt.max() > max_replicas:
        raise InputError(f"a logical expert has {int(logcnt.max())} replicas, more than max_replicas={max_replicas}")
    log2phy = np.full((num_layers, num_logical_experts, max_replicas), -1, dtype=np.int64)
    log2phy[:, :, : derived.shape[2]] = derived
    return log2phy, logcnt


class PauseBudget(NamedTuple):
    """What one safe point may switch (``ClusterConfig.max_pause_bytes`` / ``layers_per_safe_point``, or a rank
    agent's own): 0 = no limit of that kind; both 0 = the whole swap at one safe point."""

    max_pause_bytes: int = 0
    """Bytes one safe point may write into the rank's live slots."""
    layers_per_safe_point: int = 0
    """Changed layers one safe point may switch."""


def changed_layers(old_phy2log: np.ndarray, new_phy2log: np.ndarray) -> np.ndarray:
    """int64 [n]: the layers whose phy2log row differs (their routing rows switch on every rank), ascending. The
    same on every rank: both placements are the cluster's. Raises InputError for shapes that differ."""
    old, new = _as_placement("old_phy2log", old_phy2log), _as_placement("new_phy2log", new_phy2log)
    if old.shape != new.shape:
        raise InputError(f"old_phy2log {old.shape} and new_phy2log {new.shape} differ in shape")
    return np.flatnonzero((old != new).any(axis=1)).astype(np.int64)


def chunk_starts(changed: np.ndarray, layer_nbytes: np.ndarray, budget: PauseBudget) -> tuple[int, ...]:
    """This rank's chunk layout of a swap: the first layer of each chunk, ascending (empty when no layer changes).

    Greedy over the changed layers in order: a layer joins the current chunk while the chunk stays within
    ``budget`` (its bytes on this rank ``layer_nbytes`` int64 [L], its count of changed layers), else it starts the
    next one. A layer is never split (its routing rows switch with all of its weights): one larger than
    ``max_pause_bytes`` is a chunk of its own. A layer that changes only on other ranks costs this rank 0 bytes but
    counts against ``layers_per_safe_point``. Deterministic.

    Every rank proposes its own layout; the switch step fixes their union (:func:`chunk_layers` of the union is the
    common refinement, within every rank's budget): see ``store/lua/switch.lua``.

    Raises:
        InputError: a budget field that is not a non-negative integer (a bool, a float, a string, < 0); the
            cluster's and an agent's budgets are also bounded above (``store.cluster_config.check_pause_budget``).
    """
    max_bytes = check_int(budget.max_pause_bytes, "max_pause_bytes", lo=0)
    max_layers = check_int(budget.layers_per_safe_point, "layers_per_safe_point", lo=0)
    starts: list[int] = []
    nbytes = layers = 0
    for layer in np.asarray(changed, dtype=np.int64).tolist():
        cost = int(layer_nbytes[layer])
        over_bytes = max_bytes and cost and nbytes + cost > max_bytes  # a 0-byte layer always fits
        if starts and not (over_bytes or (max_layers and layers + 1 > max_layers)):
            nbytes, layers = nbytes + cost, layers + 1
            continue
        starts.append(layer)
        nbytes, layers = cost, 1
    return tuple(starts)


def chunk_layers(starts: tuple[int, ...] | list[int], changed: np.ndarray) -> list[tuple[int, ...]]:
    """The chunks of a layout: chunk k holds the changed layers in ``[starts[k], starts[k + 1])``; chunks without a
    changed layer are dropped (an unchanged layer costs nothing and switches nothing). Raises InputError when a
    changed layer lies before the first start."""
    changed = np.asarray(changed, dtype=np.int64)
    bounds = sorted({int(s) for s in starts})
    if changed.size and (not bounds or int(changed[0]) < bounds[0]):
        raise InputError(f"chunk starts {bounds[:8]} leave changed layer {int(changed[0])} outside every chunk")
    index = np.searchsorted(np.asarray(bounds, dtype=np.int64), changed, side="right") - 1
    chunks: dict[int, list[int]] = {}
    for k, layer in zip(index.tolist(), changed.tolist()):
        chunks.setdefault(k, []).append(layer)
    return [tuple(chunks[k]) for k in sorted(chunks)]
