"""An online round of a "topology_aware" cluster plans from the load per source rank: the windows are kept unsummed
with the snapshot, the plan keeps more tokens on their node than "balanced"'s on the same load, the gate's figures
name the cross-node fraction, and the round replays to the same plan from its recording. A bad split (a window of
the wrong shape, a corrupt stored split) aborts the round as a bad window does. Real Redis, threads."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from fdeplb.errors import InputError, ReplayError
from fdeplb.placement import cross_node_fraction, initial_placement, rebalance_experts
from fdeplb.recording import export_recording
from fdeplb.replay.verify import check_recording
from fdeplb.rounds import reasons
from fdeplb.store import Store
from tests.helpers import RawRedis, run_cli, thread_cluster, wait_for
from tests.orchestration.helpers import round_over

pytestmark = pytest.mark.slow  # a thread cluster

L, E, R, NODES = 3, 16, 4, 2


def per_rank_load() -> np.ndarray:
    """int64 [R, L, E]: experts 2k and 2k+1 carry the same total, node 0's ranks send most of their tokens to the
    even one, node 1's to the odd one (so swapping them across nodes costs no balance and saves traffic)."""
    total = np.repeat(np.random.default_rng(7).integers(20, 200, size=(L, E // 2)), 2, axis=1)
    return np.stack([np.where(np.arange(E) % 2 == r // 2, 9 * total, total) for r in range(R)]).astype(np.int64)


@pytest.fixture(scope="module")
def topology_round(redis_url, tmp_path_factory):
    """(store, recording path, cluster id, per-rank load [R, L, E]) of one committed round of a 2-node
    topology_aware cluster, threads stopped, the cluster still in Redis."""
    tmp = tmp_path_factory.mktemp("topology")
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with thread_cluster(redis_url, cluster, tmp, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        policy="topology_aware") as tc:
        tc.loads = per_rank_load()
        store = tc.store()
        tc.start()
        store.request_round("topology round")
        wait_for(round_over(store, 1), 60, store, "round 1")
        tc.stop()
        path = tmp / "topology.jsonl"
        export_recording(store, path)
        yield store, path, cluster, tc.loads


def test_the_round_plans_from_the_split_and_keeps_more_tokens_on_their_node(topology_round):
    store, _, _, loads = topology_round
    source = np.moveaxis(loads, 0, 1)  # [L, R, E]
    assert np.array_equal(store.read_source_load(1), source) and np.array_equal(store.read_snapshot(1),
                                                                                source.sum(axis=1))
    placement = store.current_placement()
    assert placement.plan_id, "round 1 committed no plan"
    plan = store.read_plan(placement.plan_id)
    assert "source_load" in plan.topology
    init = initial_placement(L, E, E + 4).phy2log
    balanced = rebalance_experts(source.sum(axis=1), E + 4, 1, NODES, R, policy="balanced", old_phy2log=init)
    committed = cross_node_fraction(source, placement.phy2log, R, NODES).mean()
    assert committed < cross_node_fraction(source, balanced.phy2log, R, NODES).mean()
    # the gate's figures (the load record's detail) name the cross-node fraction before and after
    load = next(a for a in store.iter_audit() if a["machine"] == "cluster" and a["trigger"] == "load")
    gate = reasons.gate_figures(load)
    assert gate["cross_node_fraction_after"] == pytest.approx(committed)
    assert gate["cross_node_fraction_before"] == pytest.approx(cross_node_fraction(source, init, R, NODES).mean())


def test_the_round_replays_to_the_same_plan(topology_round, capsys, redis_url):
    store, path, cluster, _ = topology_round
    report = check_recording(path)  # self-contained: the split is the snapshot line's
    plan_id = store.current_placement().plan_id
    assert report.plans_checked == [plan_id] and report.plans_unchecked == [] and 1 in report.gates_checked
    code, out, err = run_cli(capsys, "replay", str(path), "--redis-url", redis_url, "--cluster", cluster, "--json")
    assert code == 0, err
    assert json.loads(out)["plans_checked"] == [plan_id]


def test_a_rebuild_keeps_the_split(topology_round, capsys, redis_url, cluster_id):
    store, path, _, _ = topology_round
    code, _, err = run_cli(capsys, "replay", str(path), "--into", redis_url, "--cluster", cluster_id)
    assert code == 0, err
    rebuilt = Store(redis_url, cluster_id)
    try:
        assert np.array_equal(rebuilt.read_source_load(1), store.read_source_load(1))
    finally:
        rebuilt.delete_cluster()


def test_a_recording_with_another_split_of_the_same_sum_does_not_replay(topology_round, tmp_path):
    _, path, _, _ = topology_round
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    snap = next(x for x in lines if x.get("type") == "snapshot")
    split = np.asarray(snap["source_load"]["data"]).reshape(snap["source_load"]["shape"])
    split[:, [0, 2]] = split[:, [2, 0]]  # rank 0's tokens as if node 1 sent them: same sum, other traffic
    snap["source_load"]["data"] = split.ravel().tolist()
    forged = tmp_path / "forged.jsonl"
    forged.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ReplayError, match="per source rank of digest"):
        check_recording(forged)


def test_a_recording_whose_snapshot_lost_its_split_does_not_replay(topology_round, tmp_path):
    """The snapshot is held, its split is not: the plan that names a split cannot be recomputed, which is an edited
    recording (a pruned snapshot takes its split with it), never a plan left unchecked."""
    _, path, _, _ = topology_round
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    next(x for x in lines if x.get("type") == "snapshot").pop("source_load")
    forged = tmp_path / "stripped.jsonl"
    forged.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ReplayError, match="holds no load per source rank"):
        check_recording(forged)


def test_a_corrupt_split_aborts_the_round_and_the_next_one_succeeds(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        policy="topology_aware") as tc:
        tc.loads = per_rank_load()
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        wrong = np.zeros((L, R - 1, E), np.int64)  # one rank short
        raw.r.hset(raw.keys.snapshot(1), mapping={
            "expert_load": tc.loads.sum(axis=0).tobytes(), "expert_load:dtype": "<i8", "expert_load:shape": f"{L},{E}",
            "source_load": wrong.tobytes(), "source_load:dtype": "<i8", "source_load:shape": f"{L},{R - 1},{E}",
            "round": "1"})
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "aborted round 1")
        rec = store.read_cluster()
        assert "load snapshot of round 1 is corrupt" in rec.reason and "source_load" in rec.reason, rec.reason
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        assert "source_load" in store.read_plan(store.current_placement().plan_id).topology


def test_a_window_of_the_wrong_shape_aborts_the_round_as_for_any_policy(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        policy="topology_aware") as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        with pytest.raises(InputError, match="has shape"):  # refused at publish, nothing written
            store.publish_load(2, 1, np.zeros((L, E + 1), np.int64))
        assert store.read_load(2) is None
        raw.r.hset(raw.keys.load(2), mapping={"expert_load": np.zeros((L - 1, E), np.int64).tobytes(),
                                              "expert_load:dtype": "<i8", "expert_load:shape": f"{L - 1},{E}",
                                              "round": "1", "published_ms": "1"})
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "aborted round 1")
        rec = store.read_cluster()
        assert rec.reason.startswith("load window of rank 2 is corrupt"), rec.reason
        assert store.read_snapshot(1) is None


def test_the_periodic_trigger_judges_a_topology_aware_plan_from_the_split(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        policy="topology_aware", min_gain=1.0) as tc:  # no plan gains 1.0: the trigger skips
        tc.loads = per_rank_load()
        tc.start_agents(publish_interval_s=0.2)
        store = tc.store()
        wait_for(lambda: all(store.read_load(r) is not None for r in range(R)), 30, store, "windows")
        tc.start_coordinator(interval_s=0.5)
        skip = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "skip"], 30, store, "skip")[0]
        tc.stop()
        figures = reasons.gate_figures(skip)
        init = initial_placement(L, E, E + 4).phy2log
        assert figures["cross_node_fraction_before"] == pytest.approx(
            cross_node_fraction(np.moveaxis(tc.loads, 0, 1), init, R, NODES).mean())


def test_a_round_over_some_ranks_keeps_a_zero_row_for_a_non_member_and_plans_on_the_sum(redis_url, cluster_id,
                                                                                         tmp_path):
    from fdeplb.orchestration.membership import operator_fire

    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        num_redundant=16, policy="topology_aware") as tc:  # every expert twice: none orphaned
        tc.loads = per_rank_load()
        store = tc.store()
        operator_fire(store, 3, "drain", who="operator:test", reason="")
        tc.start()
        wait_for(round_over(store, 1), 60, store, "round 1 over ranks 0..2")
        split = store.read_source_load(1)
        assert store.read_cluster().members == "0,1,2"
        assert np.array_equal(split[:, 3], np.zeros((L, E))) and np.array_equal(split[:, :3],
                                                                                 np.moveaxis(tc.loads[:3], 0, 1))
        assert np.array_equal(split.sum(axis=1), store.read_snapshot(1))
        plan = store.read_plan(store.current_placement().plan_id)
        assert plan.topology["live_ranks"] == [0, 1, 2] and "source_load" not in plan.topology


def test_switching_a_balanced_cluster_to_topology_aware_commits_a_round_for_locality(redis_url, cluster_id, tmp_path):
    # round 1 under "balanced" balances the load; round 2 under "topology_aware" gains no balancedness (the paired
    # experts carry the same totals) but keeps more tokens on their node: the gate lets it through for locality
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=L, num_experts=E, ep_size=R, num_nodes=NODES,
                        policy="balanced") as tc:
        tc.loads = per_rank_load()
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        first = store.current_placement()
        store.change_config({"policy": "topology_aware"}, actor="test")
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        second = store.current_placement()
        source = np.moveaxis(tc.loads, 0, 1)
        assert second.plan_id != first.plan_id, store.read_cluster().reason
        assert cross_node_fraction(source, second.phy2log, R, NODES).mean() < \
            cross_node_fraction(source, first.phy2log, R, NODES).mean()
        load = [a for a in store.iter_audit() if a["machine"] == "cluster" and a["trigger"] == "load"][-1]
        assert "cross-node fraction" in load["reason"] and "balancedness given up 0.0000" in load["reason"], \
            load["reason"]  # the plan gains 0.0: nothing given up, never "-0.0000"
        tc.stop()
        path = tmp_path / "locality.jsonl"
        export_recording(store, path)
    # the replay judges the round by the same rule (QA: its header check of min_gain ignored the split and refused
    # the recording: "the round went on ... which that min_gain skips")
    report = check_recording(path)
    assert 2 in report.gates_checked and second.plan_id in report.plans_checked


@pytest.mark.parametrize("after, cross_after, goes_on", [
    (0.9990, 0.40, False),  # balancedness given up 0.0010 > the slack (TOLERANCE 0.0005)
    (0.9996, 0.40, True),   # given up 0.0004 <= 0.0005 for 0.10 fewer cross-node tokens
    (0.9996, 0.50, False),  # no fewer cross-node tokens
    (1.0000, 0.49, True),   # no balancedness given up, 0.01 fewer cross-node tokens
])
def test_the_gate_lets_a_plan_give_up_the_tolerance_of_balancedness_for_locality(after, cross_after, goes_on):
    from fdeplb.rounds.gating import GateDecision

    gate = GateDecision(np.zeros((1, 1), np.int64), 1.0, after, 3, 0.0, cross_node_before=0.5,
                        cross_node_after=cross_after)
    assert gate.goes_on is goes_on
    assert (gate.why_skipped is None) is goes_on
    if not goes_on:
        assert ("cross-node fraction not lower (0.5000 -> 0.5000)" if cross_after == 0.5 else
                "balancedness given up 0.0010 > 0.0005") in gate.why_skipped, gate.why_skipped
    # without the split (a summed round) the same figures are judged on balancedness alone
    assert GateDecision(np.zeros((1, 1), np.int64), 1.0, after, 3, 0.0).goes_on is False
