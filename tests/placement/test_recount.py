"""Re-counting rows whose heaviest GPU must hold two replicas of one expert (fdeplb.placement.recount).

That no row of a real dump is re-counted: test_policies.py checks "balanced" keeps DeepSeek's counts on all of them."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.placement import gpu_loads, imbalance, rebalance_experts
from fdeplb.placement.balanced import balanced_plan, improve_by_swaps
from fdeplb.placement.recount import recount_rows
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
