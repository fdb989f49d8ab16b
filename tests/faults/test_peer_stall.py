"""A peer whose sending stalls (its process and heartbeat alive) costs only the experts it did not deliver (README:
"a peer that refuses, dies, stalls past the deadline ... costs only that expert ... the round goes on"): the
receivers wait out their per-peer wait (half the heartbeat TTL) while heartbeating from a thread of their own
(orchestration/busy_heartbeat), so none is suspected and the round releases. Before, staging on the agent's loop
thread sent no heartbeat and the 10 s wait equalled the 10 s TTL: every round aborted (QA HIGH 1)."""

from __future__ import annotations

import json

import pytest

from tests.faults.helpers import peer_cluster
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_a_stalled_peer_costs_disk_reads_not_the_round(redis_url, real_data, tmp_path):
    store, cluster, coordinator, thread = peer_cluster(redis_url, real_data, tmp_path, "peerstall", hang_rank=1)
    try:  # rank 1's server hangs in the middle of the first expert it sends; it lives on, its heartbeat fresh
        thread.start()
        store.request_round()
        ends = wait_for(lambda: [a for a in store.iter_audit() if a["machine"] == "cluster" and a["round"] == "1"
                                 and a["trigger"] in ("abort", "release")], 120, store, "round 1 to end")
        suspects = [a["reason"] for a in store.iter_audit() if a["trigger"] == "suspect"]
        trail = [(a["round"], a["trigger"], a["reason"][:80]) for a in store.iter_audit()
                 if a["machine"] == "cluster"]
        assert ends and ends[-1]["trigger"] == "release", (ends[-1]["reason"] if ends else None, suspects, trail)
        fallbacks = [json.loads(a["detail"]) for a in store.iter_audit()
                     if a["trigger"] == "staged" and a["detail"] and "fallback" in a["detail"]]
        assert fallbacks and all(f["peer"] == 1 for d in fallbacks for f in d["fallback"])
    finally:
        coordinator.stop_event.set()
        cluster.stop()
        thread.join(10)
        store.delete_cluster()
