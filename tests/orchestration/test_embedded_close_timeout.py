"""EmbeddedAgent.close(timeout_s=...) with a value that bounds no wait (NaN, infinity, not a number; a negative one is taken as 0, as before): an
InputError naming it, before anything is stopped or closed (a NaN reached ``Thread.join`` as a ValueError, infinity
as an OverflowError, after the loop was told to stop). One agent on a small cluster, no coordinator."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.errors import InputError
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.orchestration.embedded_agent import EmbeddedAgent
from fdeplb.store import ClusterConfig, Store
from fdeplb.testing import NumpyWeights


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), None, "10", True])
def test_close_refuses_a_timeout_that_bounds_no_wait_and_changes_nothing(redis_url, cluster_id, timeout_s):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=1),
                 np.arange(4, dtype=np.int64).reshape(1, 4), adopt=False)
    agent = EmbeddedAgent(store, 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None).start()
    try:
        with pytest.raises(InputError, match="timeout_s must be a finite number of seconds"):
            agent.close(timeout_s=timeout_s)
        assert not agent.stop_event.is_set() and agent._thread.is_alive() and not agent.abandoned
        store.read_cluster()  # the store is still open
    finally:
        agent.close(timeout_s=30)
        assert not agent._thread.is_alive()
        Store(redis_url, cluster_id).delete_cluster()
