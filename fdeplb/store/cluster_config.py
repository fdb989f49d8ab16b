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
#: default pause budget of one safe point (bytes a rank writes into its live slots at one switch step): 64 MiB
DEFAULT_MAX_PAUSE_BYTES = 64 * 2**20
#: the largest pause budget in bytes a cluster or a rank agent may set (0 = no byte limit)
MAX_PAUSE_BYTES = 2**62


def check_pause_budget(max_pause_bytes: Any, layers_per_safe_point: Any) -> tuple[int, int]:
    """The pause budget of one safe point, the cluster's (:class:`ClusterConfig`) or a rank agent's own:
    ``max_pause_bytes`` in [0, 2**62] bytes, ``layers_per_safe_point`` in [0, :data:`MAX_LAYERS`] (0 = no limit of
    that kind). Returns them as ints; raises InputError (bools, floats, out of range)."""
    return (check_int(max_pause_bytes, "max_pause_bytes", lo=0, hi=MAX_PAUSE_BYTES),
            check_int(layers_per_safe_point, "layers_per_safe_point", lo=0, hi=MAX_LAYERS))


#: the settings ``fdeplb config set`` may change on a running cluster (each a field of :class:`ClusterConfig`;
#: ``deadlines`` field by field); the rest (topology, checkpoint, layer ids, pause budget) is fixed when the cluster
#: is created
SETTABLE = ("policy", "min_gain", "cordoned", "retain_rounds", "audit_keep", "audit_export_path", "deadlines")
#: the settings of :data:`SETTABLE` only the command line sets (``init-cluster``, ``config set``), never the API
#: (``POST /v1/config`` refuses them): the audit export path names a file the coordinators write, confined to their
#: ``--audit-dir``, and ``audit_keep`` > 0 makes them write it; whether a coordinator will start with either depends
#: on that ``--audit-dir``, which only the command line is given (:func:`fdeplb.store.audit_export.check_trimming`)
COMMAND_LINE_ONLY = ("audit_keep", "audit_export_path")


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
    request_ttl_ms: int = 30_000
    """A requested round that has not started this long after it was requested (a stale rank, weights not NORMAL,
    no leading coordinator) expires: the leading coordinator withdraws it with an audited ``request_expired`` note,
    so a request made while a rank was away never fires minutes later, when it returns. Default: as
    ``collecting_ms``'s."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_int(getattr(self, f.name), f"deadlines.{f.name}", lo=1, hi=MAX_DEADLINE_MS)


@dataclass(frozen=True)
class ClusterConfig:
    """Topology and rearrangement settings of one cluster, hash ``fdeplb:{c}:config`` (written at creation; the
    :data:`SETTABLE` settings change only through :meth:`fdeplb.store.Store.change_config`, which bumps
    :attr:`version`).

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
    """JSONL file older audit records are appended to before trimming (required when ``audit_keep`` > 0): set only
    on the command line (:data:`COMMAND_LINE_ONLY`), an absolute path inside the coordinators' ``--audit-dir``
    (:mod:`fdeplb.store.audit_export`)."""
    max_pause_bytes: int = DEFAULT_MAX_PAUSE_BYTES
    """Pause budget of one safe point: a committed swap is applied in chunks of whole MoE layers, one chunk per
    safe point, each writing at most this many bytes into a rank's live slots (a layer larger than this is a chunk
    of its own); 0 = no byte limit. A rank agent may set its own (``EmbeddedAgent(max_pause_bytes=...)``); every
    rank then switches at the chunk boundaries of all of them together (the common refinement)."""
    layers_per_safe_point: int = 0
    """Most changed MoE layers one safe point switches (vLLM's async EPLB: 1); 0 = no layer limit. With both
    limits 0 a swap is applied at one safe point (stop the world)."""
    layer_ids: list[int] = field(default_factory=list)
    """Model layer index of every MoE layer (row of a placement), ascending; [] = rows are model layers
    0..num_layers-1. DeepSeek-V3: 3..60 (its first 3 layers are dense). Exports write SGLang's one row per model
    layer (dense layers with the trivial placement, as SGLang's own files) and TensorRT-LLM's model layer keys."""
    num_model_layers: int = 0
    """Model layers, dense ones included (SGLang's rows); 0 = the largest layer id + 1."""
    version: int = 0
    """Changes of the settings so far (``fdeplb config set``): 0 as created, +1 per change (audited)."""
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
        check_pause_budget(self.max_pause_bytes, self.layers_per_safe_point)
        if self.audit_keep and not self.audit_export_path:
            raise InputError("audit_keep > 0 trims the audit stream: set audit_export_path to export it first")
        check_int(self.version, "version", lo=0, hi=2**62)
        self._check_layers()
        if self.num_physical_experts % self.ep_size:
            raise TopologyError(f"num_physical_experts ({self.num_physical_experts}) is not a multiple of "
                                f"ep_size ({self.ep_size})")
        if self.policy not in POLICIES:
            raise InputError(f"unknown policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        check_topology(self.num_logical_experts, self.num_physical_experts, self.num_groups, self.num_nodes,
                       self.ep_size)

    def _check_layers(self) -> None:
        ids = self.layer_ids
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InputError(f"layer_ids must be a list of integers, got {ids!r}"[:200])
        if ids and (len(ids) != self.num_layers or ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:]))):
            raise InputError(f"layer_ids must be {self.num_layers} ascending non-negative model layer ids (one per "
                             f"MoE layer), got {len(ids)}: {ids[:5]}{'...' if len(ids) > 5 else ''}")
        check_int(self.num_model_layers, "num_model_layers", lo=0, hi=MAX_LAYERS)
        if self.num_model_layers and self.num_model_layers <= self.model_layer_ids[-1]:
            raise InputError(f"num_model_layers ({self.num_model_layers}) must exceed the largest layer id "
                             f"({self.model_layer_ids[-1]})")

    @property
    def model_layer_ids(self) -> list[int]:
        """The model layer of every placement row (:attr:`layer_ids`, or 0..num_layers-1)."""
        return list(self.layer_ids) if self.layer_ids else list(range(self.num_layers))

    @property
    def model_layers(self) -> int:
        """Model layers, dense ones included (:attr:`num_model_layers`, or the largest layer id + 1)."""
        return self.num_model_layers or self.model_layer_ids[-1] + 1

    def settings(self) -> dict[str, Any]:
        """The :data:`SETTABLE` settings, JSON-ready (``deadlines`` as a dict)."""
        data = self.to_json()
        return {name: data[name] for name in SETTABLE}

    def flat_settings(self) -> dict[str, Any]:
        """:meth:`settings` with ``deadlines`` spread out as ``deadlines.<name>``: the names a change is audited
        under and ``init-cluster`` compares."""
        data = self.settings()
        out = {k: v for k, v in data.items() if k != "deadlines"}
        out.update({f"deadlines.{k}": v for k, v in data["deadlines"].items()})
        return out

    def with_settings(self, changes: Mapping[str, Any]) -> "ClusterConfig":
        """A copy with ``changes`` applied (names of :data:`SETTABLE`, ``deadlines`` as a partial dict of
        milliseconds) and :attr:`version` + 1, validated as any configuration is.

        Raises :class:`InputError` for a name that may not change (topology, checkpoint, layer ids) or an invalid
        value (nothing changes then)."""
        unknown = sorted(set(changes) - set(SETTABLE))
        if unknown:
            raise InputError(f"{', '.join(unknown)} cannot change on an existing cluster; settable: "
                             f"{', '.join(SETTABLE)}")
        data = self.to_json()
        for name, value in changes.items():
            if name == "deadlines":
                bad = sorted(set(value) - set(data["deadlines"]))
                if bad:
                    raise InputError(f"unknown deadline(s) {', '.join(bad)}; deadlines: "
                                     f"{', '.join(data['deadlines'])}")
                data["deadlines"] = {**data["deadlines"], **value}
            else:
                data[name] = value
        data["version"] = self.version + 1
        return ClusterConfig.from_json(data)

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
