"""Cluster set-up and requests: what an operator (CLI, API, demo) does to a cluster besides running it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fdeplb.errors import InputError, StateError, TopologyError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS
from fdeplb.store.redis_store import Store

POLICIES = ("deepseek", "greedy", "balanced", "move_aware")


@dataclass(frozen=True)
class Deadlines:
    """How long each wait may last (ms). Before the commit point an expired wait aborts the round; after it
    (swapping) it raises an alarm and the round keeps rolling forward."""

    collecting_ms: int = 30_000  # also bounds PLANNING
    loading_ms: int = 120_000
    commit_ms: int = 600_000  # external commit when the cluster is cordoned
    swapping_ms: int = 120_000


@dataclass(frozen=True)
class ClusterConfig:
    """Topology and rearrangement settings of one cluster, stored in Redis by :func:`init_cluster`.

    ``num_physical_experts`` = num_logical_experts + num_redundant_experts; slots of ep_rank r are
    ``[r * P / ep_size, (r + 1) * P / ep_size)``. ``checkpoint`` is ``{"path": ..., "preset": ...}``.
    ``min_gain``: a round whose plan improves mean balancedness by less than this is aborted (audited).
    """

    num_layers: int
    num_logical_experts: int
    num_physical_experts: int
    ep_size: int
    num_nodes: int = 1
    num_groups: int = 1
    policy: str = "deepseek"
    checkpoint: dict[str, Any] = field(default_factory=dict)
    deadlines: Deadlines = field(default_factory=Deadlines)
    min_gain: float = 0.0
    cordoned: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_logical_experts", "num_physical_experts", "ep_size", "num_nodes",
                     "num_groups"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
        if self.num_physical_experts < self.num_logical_experts:
            raise TopologyError(f"num_physical_experts ({self.num_physical_experts}) < num_logical_experts "
                                f"({self.num_logical_experts})")
        if self.num_physical_experts % self.ep_size:
            raise TopologyError(f"num_physical_experts ({self.num_physical_experts}) is not a multiple of "
                                f"ep_size ({self.ep_size})")
        if self.ep_size % self.num_nodes:
            raise TopologyError(f"ep_size ({self.ep_size}) is not a multiple of num_nodes ({self.num_nodes})")
        if self.policy not in POLICIES:
            raise InputError(f"unknown policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        # the placement's own rules (e.g. expert groups that divide E when the hierarchical policy applies)
        from fdeplb.placement._validate import check_topology

        check_topology(self.num_logical_experts, self.num_physical_experts, self.num_groups, self.num_nodes,
                       self.ep_size)

    @property
    def num_redundant_experts(self) -> int:
        return self.num_physical_experts - self.num_logical_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.ep_size

    def topology(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "num_logical_experts": self.num_logical_experts,
                "num_physical_experts": self.num_physical_experts, "ep_size": self.ep_size,
                "num_nodes": self.num_nodes, "num_groups": self.num_groups}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClusterConfig":
        try:
            data = dict(data)
            data["deadlines"] = Deadlines(**data.get("deadlines", {}))
            return cls(**data)
        except TypeError as exc:  # unknown or missing fields: not a configuration this version wrote
            raise InputError(f"not a cluster configuration: {exc}") from None


def init_cluster(store: Store, config: ClusterConfig, initial_phy2log: np.ndarray) -> bool:
    """Create a cluster: its configuration, initial placement, and a record per machine (cluster FREE, every
    rank IDLE, every weight status NORMAL), all at version 0, in one MULTI/EXEC (a crash leaves all or nothing).

    Idempotent: an existing cluster is left as it is (returns False); a different topology for an existing
    cluster is refused with :class:`TopologyError`. ``initial_phy2log`` is int [num_layers, num_physical_experts].
    """
    phy2log = np.asarray(initial_phy2log)
    expected = (config.num_layers, config.num_physical_experts)
    if phy2log.shape != expected or phy2log.dtype.kind not in "iu":
        raise InputError(f"initial phy2log must be int [{expected[0]}, {expected[1]}], got "
                         f"{phy2log.dtype} {list(phy2log.shape)}")
    if phy2log.min() < 0 or phy2log.max() >= config.num_logical_experts:
        raise InputError("initial phy2log holds expert ids outside [0, num_logical_experts)")
    records = [(store.keys.rearrange, CLUSTER.initial)]
    for r in range(config.ep_size):
        records += [(store.keys.rank(r), RANK.initial), (store.keys.weights(r), WEIGHTS.initial)]
    if store.create_cluster(config.to_json(), phy2log.astype(np.int64), records):
        return True
    existing = read_cluster_config(store)
    if existing.topology() != config.topology():
        raise TopologyError(f"cluster {store.cluster!r} exists with topology {existing.topology()}")
    return False


def read_cluster_config(store: Store) -> ClusterConfig:
    """The cluster's :class:`ClusterConfig` (NotFoundError if it was never initialised)."""
    return ClusterConfig.from_json(store.read_config())


def request_round(store: Store, reason: str = "operator") -> int:
    """Ask the coordinator for one more rearrangement round; returns the requested round count.

    The coordinator starts a round while ``requested`` exceeds the record's ``round`` (the start itself is a
    guarded, audited transition; a request is only a wish)."""
    pipe = store.client.pipeline(transaction=True)
    pipe.hincrby(store.keys.rearrange, "requested", 1)
    pipe.hset(store.keys.rearrange, "requested_reason", reason)
    n, _ = pipe.execute()
    store.emit_event("round_requested", reason=reason, requested=n)
    return int(n)


def request_commit(store: Store, plan_id: str) -> None:
    """Allow a cordoned cluster's LOAD_SUCC round with ``plan_id`` to commit (FastDeploy's
    ``update_weight_from_tensor`` step).

    Raises :class:`StateError` unless the cluster is cordoned and in LOAD_SUCC with exactly this plan (nothing is
    written then). The coordinator still commits only a LOAD_SUCC round whose plan_id matches the request."""
    config = read_cluster_config(store)
    rec = store.read_record(store.keys.rearrange)
    if not config.cordoned:
        raise StateError(f"cluster {store.cluster!r} is not cordoned: its rounds commit on their own")
    if rec.state != "LOAD_SUCC" or rec.get("plan_id") != plan_id:
        raise StateError(f"cluster {store.cluster!r} is {rec.state} with plan {rec.get('plan_id') or '-'}; a commit "
                         f"is only accepted in LOAD_SUCC for the staged plan (asked: {plan_id!r})")
    store.set_fields(store.keys.rearrange, {"commit_requested": plan_id})
    store.emit_event("commit_requested", plan_id=plan_id)


def plan_digest(expert_load: np.ndarray, old_phy2log: np.ndarray, policy: str, topology: dict[str, int]) -> str:
    """Content hash of (load snapshot, old placement, policy, topology): the plan_id (16 hex digits)."""
    h = hashlib.sha256()
    for arr in (np.ascontiguousarray(expert_load), np.ascontiguousarray(old_phy2log)):
        h.update(arr.dtype.str.encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    h.update(policy.encode())
    h.update(json.dumps(topology, sort_keys=True).encode())
    return h.hexdigest()[:16]
