"""A worker SIGKILLed between two chunks that stays down until the round has completed among the
other members and its re-placement failed closed (too few redundant slots), then comes back. The rejoined rank
holds the committed placement; its rank record stayed SWAPPING forever (its agent retried a swap routed over the
aborted membership round's members [0, 2, 3], which raised RedundancyError every ~3 s), so no later round could
start: the coordinator's start guard reported ``rank:1 is SWAPPING, not IDLE`` and every request expired. The agent
now holds the current placement, routed over the ranks it names, and leaves SWAPPING."""

from __future__ import annotations

import threading

import pytest

from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState, RankState
from fdeplb.rounds.reasons import FAIL_CLOSED
from tests.helpers import wait_for
from tests.orchestration.helpers import kill_rank1_between_chunks, round_done


@pytest.mark.slow
@pytest.mark.faults
def test_a_rank_killed_between_chunks_that_rejoins_after_a_fail_closed_replacement_leaves_swapping(
        redis_url, real_data, tmp_path):
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id
    from fdeplb.store import ClusterConfig, Deadlines, Store
    from tests.helpers import real_traces_28x64

    from fdeplb.weights import write_synthetic_checkpoint

    traces = real_traces_28x64(real_data, tmp_path)
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", 28, 64, hidden=8, intermediate=4)
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=4,
                           checkpoint={"path": str(ckpt), "preset": "ernie"},
                           layers_per_safe_point=1, policy="deepseek",
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=30_000, swapping_ms=60_000,
                                               exclude_ms=1_000))
    store = Store(redis_url, new_cluster_id("chunk-kill-rejoin"))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=config, trace=traces, workdir=tmp_path,
                           backend="paddle")  # the numpy backend routes nothing, so never raises
    cluster.init(initial_placement(28, 64, 72).phy2log)
    args = ("--step-ms", "5", "--heartbeat-ttl-ms", "1500")
    coordinator = Coordinator(Store(redis_url, store.cluster), lease_ms=1_500)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    try:
        kill_rank1_between_chunks(cluster, store, thread, args, "kill between chunks, stay down")
        # the round completes among the members once rank 1 is suspected; rank 1 is excluded, its orphans cannot
        # be re-placed on 8 redundant slots: the membership round fails closed
        wait_for(lambda: round_done(store, 1), 90, store, "round 1 completes without rank 1")
        wait_for(lambda: store.read(MEMBERSHIP, 1).state is MemberState.EXCLUDED, 60, store, "rank 1 excluded")
        assert store.read_rank(1).state is RankState.SWAPPING
        wait_for(lambda: any(a["trigger"] == "abort" and a["reason"].startswith(FAIL_CLOSED)
                             for a in store.iter_audit()), 60, store, "the re-placement fails closed")
        cursor = store.cursor()
        cluster.start_rank(1, *args)  # the worker comes back (without the failpoint)
        cluster.wait_ready([1], timeout_s=120, after=cursor)
        wait_for(lambda: store.read(MEMBERSHIP, 1).state is MemberState.ACTIVE, 60, store, "rank 1 rejoins")
        # the rejoined rank holds the committed placement; it must leave SWAPPING so that rounds can run again
        wait_for(lambda: store.read_rank(1).state is RankState.IDLE, 30, store,
                 "the rejoined rank 1 leaves SWAPPING (else no round can ever start)")
        rounds = store.read_cluster().round
        store.request_round("after the rejoin")
        wait_for(lambda: store.read_cluster().round > rounds and store.read_cluster().state is ClusterState.FREE,
                 90, store, "a round after the rejoin")
    finally:
        coordinator.stop_event.set()
        thread.join(10)
        cluster.stop()
        store.delete_cluster()
