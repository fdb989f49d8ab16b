"""The cluster's configuration, hash ``fdeplb:{c}:config``: topology, placement policy, deadlines and retention,
validated when it is built (from the CLI or the API, or read back from Redis by the store).

Raises :class:`~fdeplb.errors.InputError` / :class:`~fdeplb.errors.TopologyError` for values that cannot describe a
cluster; the store turns those into :class:`~fdeplb.errors.CorruptRecordError` for a stored configuration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fdeplb.checks import check_int
from fdeplb.errors import InputError, TopologyError

#: longest deadline a wait may have (7 days, in ms)
MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
#: most bytes one placement table (num_layers x num_physical_experts int64) may take: 256 MiB
MAX_TABLE_BYTES = 256 * 2**20
#: most EP ranks, layers and experts per layer a cluster may have
MAX_EP_SIZE = 65_536
MAX_LAYERS = 4_096
MAX_EXPERTS = 65_536
#: most rounds of snapshots and plans a cluster may keep
MAX_RETAIN_ROUNDS = 1_000


@dataclass(frozen=True)
class Deadlines:
    """How long each wait may last (ms). Before the commit point an expired wait aborts the round; after it
    (swapping) it raises an alarm and the round keeps rolling forward."""

    collecting_ms: int = 30_000
    """COLLECTING and PLANNING: every rank publishes its window, the plan is computed."""
    loading_ms: int = 120_000
    """LOADING: every rank stages the experts of the plan."""
    commit_ms: int = 600_000
    """LOAD_SUCC on a cordoned cluster: the external commit arrives."""
    swapping_ms: int = 120_000
    """SWAPPING: every rank swaps (past the commit point: an alarm, not an abort)."""
    weights_ms: int = 120_000
    """A weight clear / update: its switch step is fixed once every rank's worker is armed for it at a safe point.
    Past this (from the coordinator first seeing the request pending), an audited alarm names the ranks not armed;
    the request keeps waiting (no rank applied it)."""
    exclude_ms: int = 30_000
    """A SUSPECT rank (heartbeat past its TTL) still stale this long after it was suspected is excluded from the
    members by the leading coordinator (fenced); its experts are then re-placed on the live ranks."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_int(getattr(self, f.name), f"deadlines.{f.name}", lo=1, hi=MAX_DEADLINE_MS)


@dataclass(frozen=True)
class ClusterConfig:
    """Topology and rearrangement settings of one cluster, hash ``fdeplb:{c}:config`` (written once).

    Raises :class:`InputError` / :class:`TopologyError` on construction for values that cannot describe a cluster.
    """

    num_layers: int
    """MoE layers (L)."""
    num_logical_experts: int
    """Experts per MoE layer (E)."""
    num_physical_experts: int
    """Slots per layer (P = E + num_redundant_experts); slots of ep_rank r: [r*P/ep_size, (r+1)*P/ep_size)."""
    ep_size: int
    """EP ranks (GPUs)."""
    num_nodes: int = 1
    """Server nodes; the GPUs of a node are contiguous ranks."""
    num_groups: int = 1
    """Expert groups (contiguous logical experts routed together; DeepSeek-V3: 8)."""
    policy: str = "move_aware"
    """Placement policy, a name of :data:`fdeplb.placement.POLICIES`. Default "move_aware": moves fewest experts
    while its mean max/mean GPU load stays within 0.0005 of "balanced" (each layer within 0.001); "deepseek"
    reproduces DeepSeek's EPLB."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """``{"path": safetensors dir or file, "preset": expert tensor names}``; {} for a backend without one."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """How long each wait may last."""
    min_gain: float = 0.0
    """A round is skipped (audited) unless its plan raises mean balancedness by more than this."""
    cordoned: bool = False
    """Commit only on an external request (FastDeploy's ``update_weight_from_tensor``)."""
    retain_rounds: int = 3
    """Load snapshots and plans of the last this-many rounds are kept (besides those the current placement and
    the round in flight refer to); the coordinator prunes older ones when a round ends. In [1, 1000]."""
    audit_keep: int = 0
    """Audit records kept in Redis: 0 (default) keeps the stream complete; N > 0 lets the coordinator export
    older records to ``audit_export_path`` (JSONL, appended and fsynced) and only then trim them."""
    audit_export_path: str = ""
    """JSONL file older audit records are appended to before trimming (required when ``audit_keep`` > 0)."""
    incarnation: str = ""
    """This creation of the cluster: a fresh random id written by :meth:`Store.create_cluster` ("" in a
    configuration given to it, or in one written before incarnations existed). A rank agent that finds another one
    (the cluster was created again after Redis lost its data) re-registers or refuses, see
    :mod:`fdeplb.orchestration.recovery`."""

    def __post_init__(self) -> None:
        from fdeplb.placement import POLICIES, check_topology

        limits = {"num_layers": MAX_LAYERS, "num_logical_experts": MAX_EXPERTS,
                  "num_physical_experts": 2 * MAX_EXPERTS, "ep_size": MAX_EP_SIZE, "num_nodes": MAX_EP_SIZE,
                  "num_groups": MAX_EXPERTS}
        for name, hi in limits.items():
            v = check_int(getattr(self, name), name)
            if v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
            if v > hi:
                raise InputError(f"{name} must be at most {hi}, got {v}")
        table_bytes = int(self.num_layers) * int(self.num_physical_experts) * 8
        if table_bytes > MAX_TABLE_BYTES:
            raise InputError(f"num_layers x num_physical_experts = {self.num_layers} x {self.num_physical_experts} "
                             f"needs {table_bytes / 2**20:.0f} MiB per placement table (int64); the limit is "
                             f"{MAX_TABLE_BYTES // 2**20} MiB")
        if not isinstance(self.min_gain, (int, float, np.floating, np.integer)) or isinstance(self.min_gain, bool) \
                or not math.isfinite(self.min_gain) or not 0 <= self.min_gain <= 1:
            raise InputError(f"min_gain must be a finite number in [0, 1] (a balancedness gain; 1 never rebalances), "
                             f"got {self.min_gain!r}")
        if not isinstance(self.deadlines, Deadlines):
            raise InputError(f"deadlines must be a Deadlines, got {type(self.deadlines).__name__}")
        check_int(self.retain_rounds, "retain_rounds", lo=1, hi=MAX_RETAIN_ROUNDS)
        if not isinstance(self.incarnation, str) or len(self.incarnation) > 64:
            raise InputError(f"incarnation must be a string of at most 64 characters, got {self.incarnation!r}")
        check_int(self.audit_keep, "audit_keep", lo=0, hi=10**9)
        if self.audit_keep and not self.audit_export_path:
            raise InputError("audit_keep > 0 trims the audit stream: set audit_export_path to export it first")
        if self.num_physical_experts % self.ep_size:
            raise TopologyError(f"num_physical_experts ({self.num_physical_experts}) is not a multiple of "
                                f"ep_size ({self.ep_size})")
        if self.policy not in POLICIES:
            raise InputError(f"unknown policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        check_topology(self.num_logical_experts, self.num_physical_experts, self.num_groups, self.num_nodes,
                       self.ep_size)

    @property
    def num_redundant_experts(self) -> int:
        """P - E."""
        return self.num_physical_experts - self.num_logical_experts

    @property
    def slots_per_rank(self) -> int:
        """P / ep_size."""
        return self.num_physical_experts // self.ep_size

    def topology(self) -> dict[str, int]:
        """The fields that shape a placement (what a plan_id hashes besides load, placement and policy)."""
        return {"num_layers": self.num_layers, "num_logical_experts": self.num_logical_experts,
                "num_physical_experts": self.num_physical_experts, "ep_size": self.ep_size,
                "num_nodes": self.num_nodes, "num_groups": self.num_groups}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the stored form)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ClusterConfig":
        """Inverse of :meth:`to_json`; :class:`InputError` for unknown or missing fields."""
        try:
            data = dict(data)
            data["deadlines"] = Deadlines(**data.get("deadlines", {}))
            return cls(**data)
        except TypeError as exc:  # unknown or missing fields: not a configuration this version wrote
            raise InputError(f"not a cluster configuration: {exc}") from None
