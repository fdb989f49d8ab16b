"""A stale round request's expiry that loses to other writers on every attempt (ContentionError) is contention,
not a withdrawal: the step logs it as such, nothing is withdrawn or audited, and the next pass withdraws it."""

from __future__ import annotations

import numpy as np
import structlog

from fdeplb.errors import ContentionError
from fdeplb.machines.tables import CLUSTER
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.store import ClusterConfig, Deadlines, Store


def test_an_expiry_that_meets_contention_says_so_and_the_next_pass_withdraws(redis_url, cluster_id, monkeypatch):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=2,
                                      deadlines=Deadlines(request_ttl_ms=1)), np.arange(4).reshape(1, 4))
    try:
        store.request_round("test")
        store.update(CLUSTER, requested_ms=1)  # made long ago: it expires at the next pass
        coordinator = Coordinator(store, lease_ms=3_000)
        assert coordinator.ensure_leadership()
        real = store.withdraw_request

        def contended(*args, **kwargs):
            raise ContentionError("gave up after 64 attempts: another writer changed the record")

        monkeypatch.setattr(store, "withdraw_request", contended)
        with structlog.testing.capture_logs() as logs:
            coordinator.step()
        assert store.read_cluster().requested == 1  # not withdrawn
        assert not [a for a in store.audit() if a["trigger"] == "request_expired"]
        assert any(e["event"] == "request expiry contended" and "64 attempts" in e["error"] for e in logs), logs
        monkeypatch.setattr(store, "withdraw_request", real)
        coordinator.step()
        assert store.read_cluster().requested == 0
        assert [a for a in store.audit() if a["trigger"] == "request_expired"]
    finally:
        store.delete_cluster()
