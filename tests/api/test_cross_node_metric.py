"""``fdeplb_cross_node_fraction`` in ``/metrics``: on a cluster of two nodes, the share of tokens leaving their
source rank's node under the current placement, computed on the ranks' published windows (the load per source
rank); no sample before a window is published; no such family on one node."""

from __future__ import annotations

import numpy as np

from fdeplb.api.prometheus import ClusterCollector
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.placement import cross_node_fraction
from fdeplb.store import ClusterConfig, Store


def _families(store):
    return {f.name: f for f in ClusterCollector(store).collect()}


def test_cross_node_fraction_gauge_on_the_published_windows(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=np.int64)  # node 0: experts 0-3, node 1: experts 4-7
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=8, num_physical_experts=8, ep_size=4,
                                      num_nodes=2), phy2log)
    try:
        assert _families(store)["fdeplb_cross_node_fraction"].samples == []  # no window yet
        stack = np.zeros((4, 1, 8), dtype=np.int64)
        stack[0, 0, :4] = 30   # rank 0 (node 0) routes to node 0's experts only
        stack[3, 0, :4] = 10   # rank 3 (node 1) routes to node 0's experts only: all of it crosses
        for r in range(4):
            store.publish_load(r, 0, stack[r])
        samples = _families(store)["fdeplb_cross_node_fraction"].samples
        expected = float(cross_node_fraction(np.moveaxis(stack, 0, 1), phy2log, 4, 2).mean())
        assert [(s.labels, s.value) for s in samples] == [({"placement": "current"}, expected)]
        assert abs(expected - 10 / 40) < 1e-12
    finally:
        store.delete_cluster()


def test_no_cross_node_family_on_one_node(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=2),
                 np.array([[0, 1, 2, 3]], dtype=np.int64))
    try:
        store.publish_load(0, 0, np.array([[5, 0, 0, 1]], dtype=np.int64))
        assert "fdeplb_cross_node_fraction" not in _families(store)
    finally:
        store.delete_cluster()
