"""The "topology_aware" policy and the cross-node fraction metric."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdeplb.errors import InputError
from fdeplb.placement import cross_node_fraction, imbalance, rebalance_experts
from tests.placement.helpers import check_invariants


def per_source_load(seed: int, L: int = 4, E: int = 64, G: int = 16, N: int = 4) -> np.ndarray:
    """[L, G, E]: zipf expert loads, every expert's tokens split over nodes by a skewed Dirichlet share (each node
    sends most of some experts' tokens), evenly over the ranks of a node."""
    rng = np.random.default_rng(seed)
    load = rng.zipf(1.6, (L, E)).astype(np.float64) * 1000
    share = rng.dirichlet(np.full(N, 0.4), size=(L, E))  # [L, E, N]
    per_node = (load[:, :, None] * share).transpose(0, 2, 1)  # [L, N, E]
    return np.repeat(per_node[:, :, None, :] / (G // N), G // N, axis=2).reshape(L, G, E)


@pytest.mark.parametrize("seed, nodes", [(0, 4), (1, 2)])
def test_topology_aware_lowers_cross_node_traffic_within_the_slack(seed, nodes):
    source = per_source_load(seed, N=nodes)
    load = source.sum(axis=1)
    L, G, E = source.shape
    P, tol = E + G, 0.002
    balanced = rebalance_experts(load, P, 1, nodes, G, policy="balanced")
    plan = rebalance_experts(source, P, 1, nodes, G, policy="topology_aware", tolerance=tol)
    check_invariants(plan, E, P)
    assert (plan.logcnt == balanced.logcnt).all()  # the same replica counts: only swaps
    before = cross_node_fraction(source, balanced, G, nodes)
    after = cross_node_fraction(source, plan, G, nodes)
    assert after.mean() < before.mean() - 0.02, (before.mean(), after.mean())
    assert (imbalance(load, plan, G) <= imbalance(load, balanced, G) + tol + 1e-12).all()
    assert plan == rebalance_experts(source, P, 1, nodes, G, policy="topology_aware", tolerance=tol)  # deterministic
    # no slack: balance as "balanced" has it, traffic never higher
    tight = rebalance_experts(source, P, 1, nodes, G, policy="topology_aware", tolerance=0.0)
    assert (imbalance(load, tight, G) <= imbalance(load, balanced, G) + 1e-12).all()
    assert (cross_node_fraction(source, tight, G, nodes) <= before + 1e-12).all()


def test_topology_aware_without_a_split_or_nodes_is_balanced():
    source = per_source_load(2)
    load = source.sum(axis=1)
    balanced = rebalance_experts(load, 80, 1, 4, 16, policy="balanced")
    assert rebalance_experts(load, 80, 1, 4, 16, policy="topology_aware") == balanced.with_policy("topology_aware")
    one_node = rebalance_experts(source, 80, 1, 1, 16, policy="topology_aware")
    assert one_node == rebalance_experts(load, 80, 1, 1, 16, policy="balanced").with_policy("topology_aware")


def test_cross_node_fraction_by_hand():
    # 2 layers, 2 ranks on 2 nodes, 2 experts, 2 slots: expert 0 on rank 0's node, expert 1 on rank 1's
    source = np.array([[[3, 1], [0, 4]], [[0, 0], [0, 0]]])
    assert cross_node_fraction(source, [[0, 1], [0, 1]], 2, 2).tolist() == [1 / 8, 0.0]
    assert cross_node_fraction(source, [[1, 0], [0, 1]], 2, 2).tolist() == [7 / 8, 0.0]
    assert cross_node_fraction(source, [[0, 1], [0, 1]], 2, 1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("source, topo, message", [
    (np.ones((2, 3, 8)), (12, 1, 2, 4), "source ranks"),  # 3 source ranks, 4 GPUs
    (-np.ones((2, 4, 8)), (12, 1, 2, 4), "negative"),
    (np.ones((2, 4, 8, 1)), (12, 1, 2, 4), "2-D"),
    # the first bad value is named by its layer, source rank and expert (QA: a flattened index named "layer 9")
    (np.where(np.arange(64).reshape(2, 4, 8) == 8 * 4 + 8 + 3, -1.0, 5.0), (12, 1, 2, 4),
     r"negative value -1.0 at \[layer 1, source rank 1, expert 3\]"),
    (np.where(np.arange(64).reshape(2, 4, 8) == 5, np.nan, 5.0), (12, 1, 2, 4),
     r"NaN or inf value at \[layer 0, source rank 0, expert 5\]"),
])
def test_bad_source_load_is_refused(source, topo, message):
    with pytest.raises(InputError, match=message):
        rebalance_experts(source, *topo, policy="topology_aware")
    if source.ndim == 3:
        with pytest.raises(InputError):
            cross_node_fraction(source, np.zeros((2, 12), dtype=np.int64) + np.arange(12) % 8, 4, 2)


@st.composite
def source_problems(draw):
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    G = num_nodes * draw(st.integers(1, 3))
    E = draw(st.integers(2, 12))
    P = G * draw(st.integers(-(-E // G), -(-E // G) + 2))
    L = draw(st.integers(1, 2))
    values = st.lists(st.integers(0, 30), min_size=L * G * E, max_size=L * G * E)
    return np.array(draw(values)).reshape(L, G, E), (P, 1, num_nodes, G), draw(st.sampled_from([0.0, 0.001, 0.05]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_problems())
def test_topology_aware_properties(problem):
    """Valid, deterministic, every layer within the slack of "balanced" on the summed load, and never more
    cross-node traffic than it (layers with load; a layer without load keeps the trivial placement)."""
    source, topo, tol = problem
    P, _, N, G = topo
    load = source.sum(axis=1)
    plan = rebalance_experts(source, *topo, policy="topology_aware", tolerance=tol)
    check_invariants(plan, load.shape[1], P)
    assert plan == rebalance_experts(source, *topo, policy="topology_aware", tolerance=tol)
    balanced = rebalance_experts(load, *topo, policy="balanced")
    assert (imbalance(load, plan, G) <= imbalance(load, balanced, G) + tol + 1e-9).all()
    busy = load.max(axis=1) > 0
    assert (cross_node_fraction(source, plan, G, N)[busy] <= cross_node_fraction(source, balanced, G, N)[busy]
            + 1e-12).all()
