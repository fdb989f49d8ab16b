"""Re-counting rows whose heaviest GPU must hold two replicas of one expert (fdeplb.placement.recount).

That no row of a real dump is re-counted: test_policies.py checks "balanced" keeps DeepSeek's counts on all of them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fdeplb.placement import gpu_loads, imbalance, rebalance_experts
from fdeplb.placement.balanced import balanced_plan, improve_by_swaps
from fdeplb.placement.recount import forced_peak, recount_rows
from tests.placement.helpers import check_invariants, groups_on_nodes


def hot_layer_load(share: float, layers: int = 2, seed: int = 0) -> np.ndarray:
    """int64 [layers, 256]: expert 0 carries ``share`` of every layer's load, the rest uniform in [100, 1000)."""
    load = np.random.default_rng(seed).integers(100, 1000, size=(layers, 256)).astype(np.int64)
    load[:, 0] = (load[:, 1:].sum(axis=1) * share / (1 - share)).astype(np.int64)
    return load


@pytest.mark.parametrize("share", [0.5, 0.8, 0.93, 0.99])
def test_one_replica_per_gpu_for_an_expert_carrying_most_of_the_load(share):
    load = hot_layer_load(share)
    deepseek = rebalance_experts(load, 288, 8, 1, 32)
    balanced = rebalance_experts(load, 288, 8, 1, 32, policy="balanced")
    check_invariants(balanced, 256, 288)
    assert (deepseek.logcnt[:, 0] == 33).all()  # 33 replicas on 32 GPUs: one GPU holds two
    assert (balanced.logcnt[:, 0] == 32).all()
    for layer in range(2):  # one replica on every GPU
        assert sorted(np.nonzero(balanced.phy2log[layer] == 0)[0] // 9) == list(range(32))
    assert (1 + imbalance(load, balanced, 32) <= 1.001).all()
    assert (1 + imbalance(load, deepseek, 32) > 1.05).all()
    again = rebalance_experts(load, 288, 8, 1, 32, policy="balanced")
    assert np.array_equal(again.phy2log, balanced.phy2log)  # deterministic


@pytest.mark.parametrize("shares, counts", [((0.4, 0.4), (16, 16)), ((0.6, 0.3), (21, 11)), ((0.45, 0.2), (22, 10))])
def test_several_hot_experts_are_counted_together(shares, counts):
    # DeepSeek gives (0.4, 0.4) 17 + 17 replicas: two GPUs hold one of each (1.54); 16 + 16 put one on every GPU
    load = np.random.default_rng(0).integers(100, 1000, size=(2, 256)).astype(np.float64)
    whole = load[:, len(shares):].sum(axis=1) / (1 - sum(shares))
    for i, share in enumerate(shares):
        load[:, i] = np.floor(whole * share)
    deepseek = rebalance_experts(load, 288, 8, 1, 32)
    balanced = rebalance_experts(load, 288, 8, 1, 32, policy="balanced")
    check_invariants(balanced, 256, 288)
    assert (balanced.logcnt[:, :len(shares)] == counts).all()
    assert (1 + imbalance(load, balanced, 32) <= 1.001).all()
    assert (1 + imbalance(load, deepseek, 32) > 1.2).all()


def test_hierarchical_rows_recount_inside_their_node_and_keep_groups_on_nodes():
    load = hot_layer_load(0.8)
    deepseek = rebalance_experts(load, 288, 8, 4, 32)
    balanced = rebalance_experts(load, 288, 8, 4, 32, policy="balanced")
    check_invariants(balanced, 256, 288)
    assert groups_on_nodes(balanced.phy2log, 256, 8, 4)
    assert (deepseek.logcnt[:, 0] == 9).all()  # 9 replicas on the 8 GPUs of its node
    assert (balanced.logcnt[:, 0] == 8).all()
    node = gpu_loads(load, balanced, 32).reshape(2, 4, 8)
    node_ds = gpu_loads(load, deepseek, 32).reshape(2, 4, 8)
    inside = node.max(axis=2) / node.mean(axis=2)
    assert (inside.max(axis=1) <= 1.001).all()
    assert ((node_ds.max(axis=2) / node_ds.mean(axis=2)).max(axis=1) > 1.05).all()
    assert (imbalance(load, balanced, 32) <= imbalance(load, deepseek, 32) + 1e-12).all()


def test_a_row_without_a_doubled_heaviest_gpu_is_left_as_it_is():
    load = hot_layer_load(0.8, layers=1)
    load[0, 0] = load[0, 1]  # no hot expert any more
    plan, _ = balanced_plan(load.astype(np.float64), 288, 1, 1, 32)
    assert np.array_equal(recount_rows(load.astype(np.float64), plan, 1, 32, improve_by_swaps), plan)


def test_forced_peak_is_the_pigeonhole_bound_and_a_real_packing_reaches_it():
    items = np.array([[5, 5, 5, 5, 5, 1, 1, 1], [9, 1, 1, 1, 1, 1, 1, 1]], dtype=np.float64)
    assert forced_peak(items, 4).tolist() == [10.0, 2.0]  # five 5s on 4 GPUs: two on one; the 9 alone bounds nothing
    rng = np.random.default_rng(5)
    for _ in range(20):  # never above the best packing, found by brute force on 3 GPUs x 2 slots
        row = rng.integers(1, 50, size=6).astype(np.float64)
        best = min(max(row[list(p[:2])].sum(), row[list(p[2:4])].sum(), row[list(p[4:])].sum())
                   for p in itertools.permutations(range(6)))
        assert forced_peak(row[None, :], 3)[0] <= best + 1e-9


def test_a_few_gpus_with_many_replicas_each():
    # 9 replicas of the hot expert on 4 GPUs force three on one (1.11); 8 give two on each
    load = np.random.default_rng(0).integers(100, 1000, size=(2, 16)).astype(np.int64)
    load[:, 0] = load[:, 1:].sum(axis=1) * 4
    deepseek = rebalance_experts(load, 24, 1, 1, 4)
    balanced = rebalance_experts(load, 24, 1, 1, 4, policy="balanced")
    assert (deepseek.logcnt[:, 0] == 9).all() and (balanced.logcnt[:, 0] == 8).all()
    assert (1 + imbalance(load, balanced, 4) <= 1.002).all() and (1 + imbalance(load, deepseek, 4) > 1.1).all()
