"""QA finding: a peer whose sending stalls (its process and heartbeat alive) is meant to cost only the experts it did
not deliver (README: "a peer that refuses, dies, stalls past the deadline ... costs only that expert ... the round
goes on"). But staging runs on the agent's loop thread, which sends no heartbeat while it stages: every receiver
waits out the 10 s per-expert deadline without a heartbeat, so with the default heartbeat TTL (10 s) the receivers
are suspected and every round aborts ("membership changed in the round") for as long as the peer stalls."""

from __future__ import annotations

import json
import threading

import pytest

from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.store import ClusterConfig, Deadlines, Store
from tests.helpers import real_traces_28x64, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]

EP = 4


def test_a_stalled_peer_costs_disk_reads_not_the_round(redis_url, real_data, tmp_path):
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id

    traces = real_traces_28x64(real_data, tmp_path)
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=EP,
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=60_000, commit_ms=30_000,
                                               swapping_ms=30_000))
    store = Store(redis_url, new_cluster_id("peerstall"))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=config, trace=traces, workdir=tmp_path,
                           backend="numpy", peer_secret="peer-stall-secret")
    cluster.init(initial_placement(28, 64, 72).phy2log)
    coordinator = Coordinator(Store(redis_url, store.cluster), lease_ms=1_500)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    try:
        for r in range(EP):  # rank 1's server hangs in the middle of the first expert it sends; it lives on
            cluster.start_rank(r, env={"FDEPLB_FAILPOINTS": "peer.hang=sending"} if r == 1 else None)
        cluster.wait_ready(timeout_s=120)
        thread.start()
        store.request_round()
        wait_for(lambda: store.read_cluster().state == "FREE" and store.read_cluster().round >= 1, 120, store,
                 "round 1 to end")
        ends = [a for a in store.iter_audit() if a["machine"] == "cluster" and a["round"] == "1"
                and a["trigger"] in ("abort", "release")]
        suspects = [a["reason"] for a in store.iter_audit() if a["trigger"] == "suspect"]
        assert ends and ends[-1]["trigger"] == "release", (ends[-1]["reason"] if ends else None, suspects)
        fallbacks = [json.loads(a["detail"]) for a in store.iter_audit()
                     if a["trigger"] == "staged" and a["detail"] and "fallback" in a["detail"]]
        assert fallbacks and all(f["peer"] == 1 for d in fallbacks for f in d["fallback"])
    finally:
        coordinator.stop_event.set()
        cluster.stop()
        thread.join(10)
        store.delete_cluster()
