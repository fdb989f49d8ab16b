"""The small clusters the command tests share: ``small_store``, E=4 experts in P=6 slots on 3 ranks of 2 slots
(phy2log ``[0, 1, 2, 3, 0, 1]``: rank 1 holds experts 2, 3 and nothing else does); ``two_rank_store``, 4 experts in
4 slots on 2 ranks. Each removed after the test."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Store


@pytest.fixture
def small_store(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3),
                 np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64))
    yield store
    store.delete_cluster()


@pytest.fixture
def two_rank_store(redis_url, cluster_id):
    """The status and audit tests' cluster: 4 experts in 4 slots on 2 ranks, removed after the test."""
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=2),
                 np.arange(4, dtype=np.int64).reshape(1, 4))
    yield store
    store.delete_cluster()
