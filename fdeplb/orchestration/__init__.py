"""Orchestration: the coordinator (lease + fence) and the rank agent, reconcile loops that meet only in Redis."""

from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.orchestration.handles import Fired, RecordHandle
from fdeplb.rounds.gating import default_planner

__all__ = ["Coordinator", "Fired", "RankAgent", "RecordHandle", "default_planner", "init_cluster"]
