"""Redis: the only package that talks to it. Typed records, the commit and lease scripts, the embedded server."""

from fdeplb.store.cluster_config import ClusterConfig, Deadlines
from fdeplb.store.embedded import EmbeddedRedis
from fdeplb.store.records import (
    ClusterRecord,
    LeaseInfo,
    LoadWindow,
    PlacementEntry,
    MemberRecord,
    RankRecord,
    WeightRecord,
)
from fdeplb.store.deferred import PendingCall
from fdeplb.store.plan_entry import PlanEntry
from fdeplb.store.machine_io import CommitResult
from fdeplb.store.redis_store import Store
from fdeplb.store.streams import AuditRecord, Cursor

__all__ = [
    "AuditRecord",
    "ClusterConfig",
    "ClusterRecord",
    "CommitResult",
    "Cursor",
    "Deadlines",
    "EmbeddedRedis",
    "LeaseInfo",
    "LoadWindow",
    "PendingCall",
    "PlacementEntry",
    "PlanEntry",
    "MemberRecord",
    "RankRecord",
    "Store",
    "WeightRecord",
]
