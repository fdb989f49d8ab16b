"""The lower bound on moved experts (fdeplb.placement.move_bound): never above a real plan's moves nor the exact
minimum (enumerated on a tiny layer), zero when the old placement already meets the level, at least one when it
does not, non-increasing in the level, bad input refused; the same for the bound on plans that keep groups on
nodes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fdeplb.errors import InputError
from fdeplb.placement import imbalance, moved_experts, read_expert_load, rebalance_experts
from fdeplb.placement.move_bound import groups_on_nodes_lower_bound, moved_experts_lower_bound


def level(load, phy2log, num_gpus):
    """Mean over layers of max/mean GPU load."""
    return float((1.0 + imbalance(load, phy2log, num_gpus)).mean())


def drifted(seed: int, layers: int = 3, experts: int = 16, slots: int = 20, gpus: int = 4):
    """(new load, old placement = "balanced" on an unrelated load, slots, gpus)."""
    rng = np.random.default_rng(seed)
    old_load = rng.zipf(1.6, size=(layers, experts)).astype(np.float64)
    new_load = rng.zipf(1.6, size=(layers, experts)).astype(np.float64)
    return new_load, rebalance_experts(old_load, slots, 1, 1, gpus, policy="balanced").phy2log, slots, gpus


@pytest.mark.parametrize("seed", range(6))
def test_bound_never_above_a_plans_moves(seed):
    load, old, slots, gpus = drifted(seed)
    for policy in ("deepseek", "balanced", "move_aware"):
        plan = rebalance_experts(load, slots, 1, 1, gpus, policy=policy, old_phy2log=old).phy2log
        bound = moved_experts_lower_bound(load, old, gpus, max(level(load, plan, gpus), 1.0))
        assert bound <= moved_experts(old, plan, gpus), policy


def test_zero_when_old_meets_the_level_and_positive_when_not():
    load, old, _, gpus = drifted(7)
    old_level = level(load, old, gpus)
    assert old_level > 1.01  # the drift unbalances the old placement
    assert moved_experts_lower_bound(load, old, gpus, old_level) == 0
    assert moved_experts_lower_bound(load, old, gpus, 1.0 + (old_level - 1.0) / 2) >= 1


def test_numpy_scalar_level_accepted():
    load, old, _, gpus = drifted(3)
    assert moved_experts_lower_bound(load, old, gpus, np.float32(1.01)) == moved_experts_lower_bound(
        load, old, gpus, float(np.float32(1.01)))


def test_non_increasing_in_the_level():
    load, old, _, gpus = drifted(8)
    bounds = [moved_experts_lower_bound(load, old, gpus, lv) for lv in (1.0, 1.001, 1.01, 1.05, 1.2)]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] > bounds[-1]


@pytest.mark.real_data("qwen2_57b_oeplb/counts57b.json", "qwen2_57b_oeplb/counts57b_share.json")
def test_real_drift_pair_bound_below_move_aware(real_data):
    folder = real_data / "qwen2_57b_oeplb"
    a, b = (read_expert_load(folder / f"{n}.json").expert_load for n in ("counts57b", "counts57b_share"))
    slots, gpus = a.shape[1] + 8, 8
    old = rebalance_experts(a, slots, 1, 1, gpus, policy="balanced").phy2log
    plan = rebalance_experts(b, slots, 1, 1, gpus, policy="move_aware", old_phy2log=old).phy2log
    bound = moved_experts_lower_bound(b, old, gpus, level(b, plan, gpus))
    assert 1 <= bound <= moved_experts(old, plan, gpus)


@pytest.mark.parametrize("bad", [0.999, float("nan"), float("inf"), "1.1", None, True])
def test_bad_level_refused(bad):
    load, old, _, gpus = drifted(1)
    with pytest.raises(InputError, match="max_over_mean"):
        moved_experts_lower_bound(load, old, gpus, bad)


def test_bad_shapes_refused():
    load, old, _, gpus = drifted(2)
    with pytest.raises(InputError, match="shape"):
        moved_experts_lower_bound(load, old[:2], gpus, 1.01)
    with pytest.raises(InputError, match="multiple"):
        moved_experts_lower_bound(load, old, 3, 1.01)


@pytest.mark.parametrize("seed", [1, 2, 4, 8])  # seeds whose old placement is off the best level
def test_bound_never_above_the_exact_minimum(seed):
    """One layer, 4 experts on 2 GPUs x 3 slots: every placement enumerated, the fewest moves reaching each level."""
    rng = np.random.default_rng(seed)
    load = rng.integers(1, 50, size=(1, 4)).astype(np.float64)
    old = rng.permutation(np.r_[np.arange(4), rng.integers(0, 4, size=2)])[None, :]
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 6, indexing="ij"), axis=-1).reshape(-1, 6)
    grid = grid[np.array([len(set(row)) == 4 for row in grid])]  # every expert keeps a replica
    levels = np.array([level(load, row[None, :], 2) for row in grid])
    moves = np.array([moved_experts(old, row[None, :], 2) for row in grid])
    assert level(load, old, 2) > levels.min() + 1e-3
    for target in sorted(set(np.round(levels, 9)))[:6]:
        exact = int(moves[levels <= target + 1e-9].min())
        assert moved_experts_lower_bound(load, old, 2, float(target) + 1e-9) <= exact


# ---- plans that keep every expert group on one node ----------------------------------------------------------------

def _groups_on_nodes_plans():
    """Every placement of 4 experts, each its own group, on 8 slots (4 GPUs x 2, 2 nodes) with two groups on each
    node and every expert present: int64 [1176, 8] (6 maps x 14 x 14 fillings of the nodes' 4 slots)."""
    plans = []
    for node0 in itertools.combinations(range(4), 2):
        node1 = [g for g in range(4) if g not in node0]
        fill0 = [row for row in itertools.product(node0, repeat=4) if len(set(row)) == 2]
        fill1 = [row for row in itertools.product(node1, repeat=4) if len(set(row)) == 2]
        plans += [np.r_[a, b] for a in fill0 for b in fill1]
    return np.array(plans, dtype=np.int64)


@pytest.mark.parametrize("seed", range(5))
def test_groups_on_nodes_bound_never_above_the_exact_minimum(seed):
    """Two layers, every groups-on-nodes placement enumerated per layer: the fewest moves of any pair of plans whose
    mean max/mean is within each level is never below the bound, which is positive where a group must change node;
    the old placement's level needs no move."""
    rng = np.random.default_rng(seed)
    load = rng.integers(1, 60, size=(2, 4)).astype(np.float64)
    plans = _groups_on_nodes_plans()
    old = plans[rng.integers(0, len(plans), size=2)]
    n = len(plans)
    levels = np.stack([1.0 + imbalance(np.repeat(load[l:l + 1], n, axis=0), plans, 4) for l in range(2)])
    moves = np.stack([moved_experts(np.repeat(old[l:l + 1], n, axis=0), plans, 4, per_layer=True) for l in range(2)])
    assert groups_on_nodes_lower_bound(load, old, 4, 2, 4, level(load, old, 4)) == 0
    mean_level = (levels[0][:, None] + levels[1][None, :]) / 2
    total = moves[0][:, None] + moves[1][None, :]
    bounds = []
    for target in np.unique(np.round(mean_level, 9))[:8]:
        exact = int(total[mean_level <= target + 1e-9].min())
        bounds.append(groups_on_nodes_lower_bound(load, old, 4, 2, 4, float(target) + 1e-9))
        assert bounds[-1] <= exact
    assert bounds[0] >= 2  # the best level relocates a group


def test_groups_on_nodes_bound_refuses_what_it_cannot_bound():
    load = np.ones((2, 4))
    old = _groups_on_nodes_plans()[:2]
    with pytest.raises(InputError, match="not a multiple of num_nodes"):
        groups_on_nodes_lower_bound(load, old, 1, 2, 4, 1.1)
    with pytest.raises(InputError, match="shape"):
        groups_on_nodes_lower_bound(load, old[:1], 4, 2, 4, 1.1)
    skewed = np.array([[50.0, 1, 1, 1]] * 2)
    with pytest.raises(InputError, match="no plan with every group on one node"):
        groups_on_nodes_lower_bound(skewed, old, 4, 2, 4, 1.01)
    with pytest.raises(InputError, match="group-to-node maps"):
        groups_on_nodes_lower_bound(np.ones((1, 32)), np.arange(32)[None, :], 16, 4, 4, 1.1)


def test_groups_on_nodes_bound_with_one_group_a_node_is_the_cheapest_assignment():
    """8 experts in 4 groups of 2 on 4 nodes of one GPU and 2 slots, the old placement splitting every group over two
    nodes: whatever node a group goes to, one of its experts is new there (4 moves, what the best plan moves); an
    old placement with groups on nodes, relabelled, needs none; "move_aware" moves at least the bound. The same at
    8 groups on 8 nodes, past the number of maps the map search enumerates."""
    load = np.array([[5.0, 1, 4, 2, 3, 3, 6, 1]])
    split = np.array([[0, 2, 1, 3, 4, 6, 5, 7]])
    assert groups_on_nodes_lower_bound(load, split, 4, 4, 4, 2.0) == 4
    permuted = np.array([[6, 7, 0, 1, 2, 3, 4, 5]])
    assert groups_on_nodes_lower_bound(load, permuted, 4, 4, 4, 2.0) == 0
    plan = rebalance_experts(load, 8, 4, 4, 4, policy="move_aware", old_phy2log=split)
    assert moved_experts(split, plan, 4) >= 4
    with pytest.raises(InputError, match="no plan with every group on one node"):
        groups_on_nodes_lower_bound(load, split, 4, 4, 4, 1.1)  # the heaviest group alone is 7 / 6.25
    # 8 groups on 8 nodes (DeepSeek-V3 at EP64): 40,320 maps, above what the map search enumerates, no refusal
    wide = np.repeat(load, 2, axis=1)
    old = np.array([[0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]])
    assert groups_on_nodes_lower_bound(wide, old, 8, 8, 8, 2.0) == 8


@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json", "dsv3_sglang_ep_stats/decode_in1000out1000.json")
def test_groups_on_nodes_bound_on_the_deepseek_v3_4_node_drift(real_data):
    """DeepSeek-V3 prefill_in1024 -> decode_in1000out1000 at 288 slots, 8 groups, 4 nodes, 32 GPUs, at fresh
    "balanced" + 0.0005: no plan keeping groups on nodes moves under 14% of a fresh plan's moves (2,194 of 15,461;
    issue 33's 10% is out of reach there), and "move_aware" (at that level) moves more than the bound."""
    folder = real_data / "dsv3_sglang_ep_stats"
    a, b = (read_expert_load(folder / f"{n}.json").expert_load for n in ("prefill_in1024", "decode_in1000out1000"))
    topo = (288, 8, 4, 32)
    old = rebalance_experts(a, *topo, policy="balanced")
    fresh = rebalance_experts(b, *topo, policy="balanced", old_phy2log=old)
    plan = rebalance_experts(b, *topo, policy="move_aware", old_phy2log=old)
    target = level(b, fresh.phy2log, 32) + 0.0005
    assert level(b, plan.phy2log, 32) <= target
    bound = groups_on_nodes_lower_bound(b, old, 8, 4, 32, target)
    assert 0.14 * moved_experts(old, fresh, 32) <= bound <= moved_experts(old, plan, 32)


def test_groups_on_nodes_bound_counts_a_layer_without_load_at_one():
    """A layer without load has max/mean 1 (:func:`fdeplb.placement.imbalance`), not 0: it lends the other layers
    no slack. Layer 1's old map (experts 0 and 2, 10 tokens each, on node 0) has max/mean 20/11; a mean of 1.0
    needs layer 1 at 1.0, which relocates two experts."""
    load = np.array([[0.0, 0, 0, 0], [10.0, 1, 10, 1]])
    old = np.array([[0, 2, 1, 3], [0, 2, 1, 3]])
    assert groups_on_nodes_lower_bound(load, old, 4, 2, 2, 1.0) == 2
    assert groups_on_nodes_lower_bound(load, old, 4, 2, 2, (1 + 20 / 11) / 2) == 0
