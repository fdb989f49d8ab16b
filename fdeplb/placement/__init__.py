"""Expert placement: policies, metrics, load readers and placement files. Pure numpy + scipy (DESIGN.md section 2).

Terms follow DESIGN.md: ``phy2log`` int64 [L, P] is the canonical placement; ``log2phy`` and ``logcnt`` derive from
it; ``expert_load`` [L, E] is tokens routed per logical expert.
"""

from fdeplb.placement._validate import MAX_LOAD, check_counts, check_expert_load, check_int, check_phy2log, \
    check_topology
from fdeplb.placement.core import Placement, initial_placement
from fdeplb.placement.digest import plan_digest, routing_digest
from fdeplb.placement.files import FORMATS, PlacementFile, read_placement, write_placement
from fdeplb.placement.live_ranks import check_live_ranks, live_maps, orphaned_experts, replace_orphans
from fdeplb.placement.loads import ExpertLoad, load_digest, read_expert_load
from fdeplb.placement.metrics import balancedness, cross_node_fraction, gpu_loads, imbalance, moved_bytes, \
    moved_experts
from fdeplb.placement.rebalance import POLICIES, TOLERANCE, rebalance_experts

__all__ = [
    "FORMATS",
    "MAX_LOAD",
    "POLICIES",
    "TOLERANCE",
    "ExpertLoad",
    "Placement",
    "PlacementFile",
    "balancedness",
    "check_counts",
    "check_expert_load",
    "check_int",
    "check_live_ranks",
    "check_phy2log",
    "check_topology",
    "cross_node_fraction",
    "gpu_loads",
    "imbalance",
    "initial_placement",
    "live_maps",
    "load_digest",
    "moved_bytes",
    "moved_experts",
    "orphaned_experts",
    "plan_digest",
    "read_expert_load",
    "read_placement",
    "replace_orphans",
    "routing_digest",
    "rebalance_experts",
    "write_placement",
]
