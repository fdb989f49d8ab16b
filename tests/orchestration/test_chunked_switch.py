"""A committed swap applied in chunks of layers, one per safe point: every rank switches chunk k at the same step
(``switch_step + k``), the layout being the union of every rank's own (each within its pause budget), and the rank
reports its pauses; a real worker process SIGKILLed between two chunks restarts into the committed placement."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from fdeplb.api.prometheus import ClusterCollector

from fdeplb.machines.tables import ClusterState, RankState
from fdeplb.orchestration.embedded_agent import EmbeddedAgent
from fdeplb.store.liveness import parse_chunks
from fdeplb.testing import NumpyWeights
from fdeplb.weights.plan import changed_layers, chunk_layers
from tests.helpers import thread_cluster, wait_for
from tests.orchestration.helpers import Workers, kill_rank1_between_chunks, round_done


def test_every_rank_switches_each_chunk_at_the_same_step_in_the_union_of_their_layouts(
        redis_url, cluster_id, tmp_path):
    """Rank 0 switches one layer per safe point, the others would take the whole swap at once (their default
    budget): every rank follows the finer layout, chunk k at switch_step + k, and serves the same placement at
    every step, one more layer of it new after each chunk."""
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=4) as tc:
        agents = [EmbeddedAgent(tc.store(), r, backend_factory=NumpyWeights.factory(), verify_all=True,
                                block_ms=50, publish_interval_s=None,
                                layers_per_safe_point=1 if r == 0 else None).start()
                  for r in range(tc.config.ep_size)]
        tc.start_coordinator()
        store = tc.store()
        before = store.current_placement().phy2log
        try:
            with Workers(agents, tc.loads, slow=3) as workers:
                wait_for(lambda: all(store.read_rank(r).step > 0 for r in range(4)), 30, store, "step reports")
                store.request_round("test")
                rec = wait_for(lambda: round_done(store, 1), 60, store, "round 1")
            after = store.current_placement().phy2log
            changed = changed_layers(before, after)
            assert changed.size >= 2, "the round must change several layers for this test"
            layout = parse_chunks(rec.switch_chunks)
            assert chunk_layers(layout, changed) == [(int(layer),) for layer in changed]  # rank 0's layout
            ranks = [store.read_rank(r) for r in range(4)]
            last = rec.switch_step + len(changed) - 1  # chunk k at switch_step + k
            assert [x.applied_step for x in ranks] == [last] * 4, ranks
            assert [x.late_steps for x in ranks] == [0] * 4
            assert [x.chunks for x in ranks] == [len(changed)] * 4
            assert all(0 < x.pause_max_ms <= x.pause_sum_ms for x in ranks)
            assert all(x.state is RankState.IDLE and x.slots_verified == x.slots_total for x in ranks)
            registry = CollectorRegistry()
            registry.register(ClusterCollector(store))
            text = generate_latest(registry).decode()
            assert f'fdeplb_swap_chunks{{ep_rank="2"}} {float(len(changed))}' in text
            assert f'fdeplb_swap_pause_max_seconds{{ep_rank="0"}} {ranks[0].pause_max_ms / 1000}' in text
            assert 'fdeplb_swap_pause_sum_seconds{ep_rank="3"}' in text
            steps = min(len(p) for p in workers.placements)
            for s in range(steps):  # at every step every rank served the same placement
                assert len({workers.placements[r][s] for r in range(4)}) == 1, f"ranks disagree at step {s + 1}"
            seen = [np.frombuffer(p, dtype=np.int64).reshape(before.shape) for p in
                    dict.fromkeys(workers.placements[0][:steps])]
            assert len(seen) == len(changed) + 1  # the old placement, then one more layer new per chunk
            for k, placement in enumerate(seen):
                assert np.array_equal(placement[changed[:k]], after[changed[:k]])
                assert np.array_equal(placement[changed[k:]], before[changed[k:]])
        finally:
            for a in agents:
                a.close()


def test_a_worker_sigkilled_between_two_chunks_restarts_into_the_committed_placement(redis_url, real_data,
                                                                                  tmp_path):
    """Four engine processes (a safe point every 5 ms), one changed layer per safe point; rank 1's process is
    SIGKILLed after its second chunk. The others finish their chunks; the restarted rank loads the committed
    placement; the round completes and every rank serves it."""
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id
    from fdeplb.store import ClusterConfig, Deadlines, Store
    from tests.helpers import real_traces_28x64

    traces = real_traces_28x64(real_data, tmp_path)
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=4,
                           layers_per_safe_point=1, policy="deepseek",
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=30_000, swapping_ms=60_000))
    store = Store(redis_url, new_cluster_id("chunk-kill"))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=config, trace=traces, workdir=tmp_path,
                           backend="numpy")
    cluster.init(initial_placement(28, 64, 72).phy2log)
    step = ("--step-ms", "5")
    coordinator = Coordinator(Store(redis_url, store.cluster), lease_ms=1_500)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    try:
        hit = kill_rank1_between_chunks(cluster, store, thread, step, "kill between chunks")
        rec = store.read_cluster()
        assert rec.state is ClusterState.SWAPPING and rec.switch_step > 0  # past the commit point
        assert int(hit["chunks"]) == 2 and len(parse_chunks(rec.switch_chunks)) > 2  # killed between chunks
        wait_for(lambda: all(store.read_rank(r).state is RankState.SWAPPED for r in (0, 2, 3)), 60, store,
                 "the other ranks finish their chunks")
        cursor = store.cursor()
        cluster.start_rank(1, *step)
        cluster.wait_ready([1], timeout_s=120, after=cursor)
        wait_for(lambda: round_done(store, 1), 90, store, "the round completes after the restart")
        placement = store.current_placement()
        ranks = [store.read_rank(r) for r in range(4)]
        assert {x.routing_digest for x in ranks} == {ranks[0].routing_digest} and ranks[0].routing_digest
        assert all(x.live_plan_id == placement.plan_id and x.slots_verified == x.slots_total for x in ranks)
        assert [ranks[r].chunks for r in (0, 2, 3)] == [len(parse_chunks(rec.switch_chunks))] * 3
    finally:
        coordinator.stop_event.set()
        thread.join(10)
        cluster.stop()
        store.delete_cluster()


def test_a_safe_point_that_waits_for_the_chunks_prepare_counts_the_wait_in_its_pause():
    """The background prepare of chunk k (its device-buffer load) and chunk k's pause share the op's lock: a worker
    that reaches the safe point while the load still runs is held until it ends, and that wait is part of the
    pause it reports (QA: a 251 ms stall was reported as a 0.011 ms pause)."""
    import time

    from fdeplb.orchestration.safe_points import Chunked, SafePointOp

    entered, release = threading.Event(), threading.Event()

    def slow_prepare(layers):
        entered.set()
        assert release.wait(10), "the test never released the prepare"

    op = SafePointOp(("swap", "p", 1), 1, None, lambda: None,
                     Chunked((0, 1), np.array([0, 1]), prepare=slow_prepare, apply=lambda layers: "ok"))
    op.set_layout((0, 1))
    background = threading.Thread(target=op.prepare_next)
    background.start()
    assert entered.wait(10)  # the background thread is inside the prepare, holding the lock
    started: list[float] = []
    worker = threading.Thread(target=lambda: (started.append(time.perf_counter()), op.apply(1)))
    worker.start()
    threading.Event().wait(0.2)  # the worker blocks on the lock meanwhile (if it were late, the bound only shrinks)
    released = time.perf_counter()
    release.set()
    worker.join(10)
    background.join(10)
    assert op.late_prepares == 0 and op.result == ["ok"]
    assert op.pauses_ms[0] >= (released - started[0]) * 1000
