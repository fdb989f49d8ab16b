"""A local simulated serving cluster (one worker process per EP rank) for ``fdeplb demo`` and the tests."""

from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id, temp_workdir
from fdeplb.sim.shares import integral_load, rank_share

__all__ = ["LocalCluster", "integral_load", "new_cluster_id", "rank_share", "temp_workdir"]
