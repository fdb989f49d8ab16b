"""Expert weights: checkpoint reading, per-rank transfer plans, bounded staging and verified in-place swaps.

Only :mod:`fdeplb.weights._paddle` imports ``paddle`` / ``safetensors``, lazily; the transfer plan is pure numpy.
"""

from fdeplb.weights._paddle import dtype_name, paddle as import_paddle
from fdeplb.weights.backend import BackendFactory, CheckpointBackend, Staged, WeightBackend
from fdeplb.weights.checkpoint import CheckpointReader, write_synthetic_checkpoint
from fdeplb.weights.live import LiveExperts
from fdeplb.weights.plan import DISK, KEEP, LOCAL, Step, TransferPlan, plan_transfer, rank_slots, routing_tables
from fdeplb.weights.reports import SlotCheck, StageReport, SwapReport
from fdeplb.weights.staging import StagedExperts, expert_checksum, stage_experts
from fdeplb.weights.template import PRESETS, ExpertTemplate

__all__ = [
    "DISK",
    "KEEP",
    "LOCAL",
    "PRESETS",
    "BackendFactory",
    "CheckpointBackend",
    "SlotCheck",
    "StageReport",
    "Staged",
    "WeightBackend",
    "CheckpointReader",
    "ExpertTemplate",
    "LiveExperts",
    "StagedExperts",
    "Step",
    "SwapReport",
    "TransferPlan",
    "dtype_name",
    "expert_checksum",
    "import_paddle",
    "plan_transfer",
    "rank_slots",
    "routing_tables",
    "stage_experts",
    "write_synthetic_checkpoint",
]
