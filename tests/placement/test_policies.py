"""greedy / balanced / move_aware policies, slot alignment, and hypothesis properties of every policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fdeplb.errors import InputError
from fdeplb.placement import (
    POLICIES,
    gpu_loads,
    imbalance,
    initial_placement,
    moved_experts,
    read_expert_load,
    rebalance_experts,
)
from fdeplb.placement.balanced import balanced_plan
from fdeplb.placement.move_aware import _align_gpus, layers_to_replan, reference_peak
from fdeplb.placement.reference import deepseek_reference
from fdeplb.placement.repair import repair_rows
from fdeplb.placement.slots import align_slots
from fdeplb.placement.stops import choose_stops
from tests.placement.helpers import check_invariants, dumps, groups_on_nodes, topologies


def ratio(load, placement, num_gpus):
    """Per-layer max/mean GPU load."""
    return 1.0 + imbalance(load, placement, num_gpus)


def reference_ratio(load, num_replicas, num_groups, num_nodes, num_gpus):
    """Per-layer max/mean "move_aware" is held to: the "balanced" policy's (global; the policy measures against a
    lower bound at or below it, reference_peak), "balanced" with 1-1 swaps only (hierarchical: at or above the node
    bound the policy measures against)."""
    if num_groups % num_nodes == 0:
        plan = balanced_plan(np.asarray(load), num_replicas, num_groups, num_nodes, num_gpus, pairs=False)[0]
        return ratio(load, plan, num_gpus)
    return ratio(load, rebalance_experts(load, num_replicas, num_groups, num_nodes, num_gpus, policy="balanced"),
                 num_gpus)


def bound_ratio(load, num_replicas, num_gpus, num_groups=1, num_nodes=1):
    """Per-layer reference_peak (global, or hierarchical when num_groups % num_nodes == 0) over the mean GPU load (1
    for a layer without load)."""
    mean = np.asarray(load, dtype=np.float64).sum(axis=1) / num_gpus
    peak = reference_peak(load, num_replicas, num_groups, num_nodes, num_gpus)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)


# ---- greedy (TensorRT-LLM) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "load, topo, expected",
    [
        ([[1, 5, 3, 2]], (4, 1, 1, 4), [[1, 2, 3, 0]]),  # one slot per GPU: heaviest replica on rank 0
        ([[0, 0, 0, 0]], (6, 1, 1, 2), [[0, 0, 1, 1, 2, 3]]),  # no load: P // E each, extra to the lowest ids
        ([[4, 4, 2, 2]], (6, 1, 1, 2), [[0, 1, 2, 0, 1, 3]]),  # ties: lowest expert id, then lowest rank
        ([[10, 1, 1, 1]], (8, 4, 2, 2), [[0, 0, 0, 3, 0, 0, 1, 2]]),  # groups and nodes are ignored
    ],
)
def test_greedy_follows_tensorrt_llm_rules(load, topo, expected):
    assert rebalance_experts(np.array(load), *topo, policy="greedy").phy2log.tolist() == expected


# ---- balanced -----------------------------------------------------------------------------------------------------
@pytest.mark.slow  # every real dump, two policies
def test_balanced_never_worse_than_deepseek_and_keeps_groups_on_nodes(real_data):
    for name, dump in dumps(real_data):
        load = dump.expert_load
        for topo in topologies(load.shape[1]):
            deepseek = rebalance_experts(load, *topo)
            balanced = rebalance_experts(load, *topo, policy="balanced")
            check_invariants(balanced, load.shape[1], topo[0])
            assert (ratio(load, balanced, topo[3]) <= ratio(load, deepseek, topo[3]) + 1e-12).all(), (name, topo)
            P, G, N, _ = topo
            same_nodes = np.ones(load.shape[0], dtype=bool)
            if N > 1 and G % N == 0:
                node_of_slot = np.arange(P) // (P // N)
                group = balanced.phy2log // (load.shape[1] // G)
                for layer in range(load.shape[0]):
                    assert np.unique(np.stack([group[layer], node_of_slot]), axis=1).shape[1] == G
                size = load.shape[1] // G
                ours, theirs = group_nodes(balanced.phy2log, size, G, N), group_nodes(deepseek.phy2log, size, G, N)
                same_nodes = (ours == theirs).all(axis=1)
                # a node packing of its own only where it has a lighter heaviest node
                group_load = load.reshape(load.shape[0], G, -1).sum(axis=2)
                heaviest = [np.array([np.bincount(m, weights=w, minlength=N).max() for m, w in zip(maps, group_load)])
                            for maps in (ours, theirs)]
                assert (heaviest[0][~same_nodes] < heaviest[1][~same_nodes]).all()
            # same replica counts where the node packing is DeepSeek's (no row re-counted)
            assert (balanced.logcnt[same_nodes] == deepseek.logcnt[same_nodes]).all()
            if N == 2 and G == 8:  # DeepSeek-V3: DeepSeek's greedy packs 8 groups on 2 nodes worse than it could
                assert not same_nodes.all()


def group_nodes(phy2log: np.ndarray, group_size: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """int64 [L, num_groups]: the node of every group of a plan that keeps groups on nodes."""
    L, P = phy2log.shape
    out = np.zeros((L, num_groups), dtype=np.int64)
    out[np.arange(L)[:, None], phy2log // group_size] = np.arange(P) // (P // num_nodes)
    return out


#: the balance bar: every dump's mean over layers of max/mean GPU load at these (folder, topology) pairs, global (and,
#: DeepSeek-V3 on 4 nodes, inside every node: heaviest GPU over the node's mean)
BALANCE_BAR = 1.0003
BAR_TOPOLOGIES = [("dsv3_sglang_ep_stats", (288, 8, 1, 32)), ("dsv3_sglang_ep_stats", (288, 8, 4, 32)),
                  ("qwen3_235b_oeplb", (144, 1, 1, 16)), ("qwen3_30b_oeplb", (144, 1, 1, 16)),
                  ("qwen2_57b_oeplb", (72, 1, 1, 8))]


@pytest.mark.parametrize("folder, topo", [pytest.param(f, t, id=f"{f}-{t[2]}nodes") for f, t in BAR_TOPOLOGIES])
def test_balanced_within_the_bar_on_every_real_dump(real_data, folder, topo):
    paths = sorted((real_data / folder).glob("*.json"))
    if not paths:
        pytest.skip(f"no dump in {real_data / folder}")
    P, _, N, G = topo
    for path in paths:
        load = read_expert_load(path).expert_load
        plan = rebalance_experts(load, *topo, policy="balanced")
        deepseek = rebalance_experts(load, *topo)
        assert (ratio(load, plan, G) <= ratio(load, deepseek, G) + 1e-12).all(), path.stem
        gpu = gpu_loads(load, plan, G).reshape(load.shape[0], N, G // N)
        inside = (gpu.max(axis=2) / gpu.mean(axis=2)).max(axis=1)  # the worst node of every layer
        assert inside.mean() <= BALANCE_BAR, (path.stem, inside.mean())
        if N == 1:
            assert ratio(load, plan, G).mean() <= BALANCE_BAR, path.stem
            assert ratio(load, deepseek, G).mean() > 1.001, path.stem  # the bar is far below DeepSeek's


# ---- move_aware ---------------------------------------------------------------------------------------------------
QWEN2_DRIFT = pytest.mark.real_data("qwen2_57b_oeplb/counts57b.json", "qwen2_57b_oeplb/counts57b_share.json")


@pytest.fixture(scope="module")
def qwen2_drift(real_data):  # its tests carry QWEN2_DRIFT (the real_data marker of the two dumps it reads)
    a = read_expert_load(real_data / "qwen2_57b_oeplb" / "counts57b.json").expert_load
    b = read_expert_load(real_data / "qwen2_57b_oeplb" / "counts57b_share.json").expert_load
    return a, b, rebalance_experts(a, 72, 1, 1, 8, policy="balanced")


@QWEN2_DRIFT
def test_move_aware_moves_far_less_than_a_fresh_plan(qwen2_drift):
    _, load, old = qwen2_drift
    fresh = rebalance_experts(load, 72, 1, 1, 8, policy="balanced", old_phy2log=old)
    plan = rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old)
    check_invariants(plan, 64, 72)
    assert plan.policy == "move_aware"
    assert (ratio(load, plan, 8) <= reference_ratio(load, 72, 1, 1, 8) + 0.001).all()
    assert moved_experts(old, plan, 8) <= 0.3 * moved_experts(old, fresh, 8)
    # an expert that stays on its GPU keeps its slot
    S = 9
    for layer in range(plan.num_layers):
        for gpu in range(8):
            o, n = old.phy2log[layer, gpu * S:(gpu + 1) * S], plan.phy2log[layer, gpu * S:(gpu + 1) * S]
            for s in range(S):
                if o[s] in n:
                    assert n[s] == o[s] or list(n).count(o[s]) < list(o).count(o[s]) or o[s] in n[:s]


@pytest.mark.parametrize("num_groups, num_nodes", [(1, 1), (8, 2)], ids=["global", "hierarchical"])
def test_move_aware_bulk_replicas_for_a_very_hot_expert(num_groups, num_nodes):
    """Loads like benchmarks/control_plane.py's (sums of zipf(1.5) over 64 ranks: one expert carries ~45x the mean
    GPU load), so rows take the bulk replica counts (fill_rows) before the repair; chained over rounds."""
    from fdeplb.placement.fill import forced_copies
    from fdeplb.placement.move_aware import _BULK_COPIES, LAYER_CAP
    L, E, P, G = 4, 64, 128, 64
    old = initial_placement(L, E, P).phy2log
    for rnd in range(3):
        load = sum(np.random.default_rng([rnd, r]).zipf(1.5, size=(L, E)) * 10 for r in range(64))
        fresh = rebalance_experts(load, P, num_groups, num_nodes, G, policy="balanced")
        if num_nodes == 1:
            cap = (reference_ratio(load, P, 1, 1, G) + LAYER_CAP * 0.0005) * load.sum(axis=1) / G
            assert (forced_copies(old, load.astype(np.float64), cap) >= _BULK_COPIES).any()
        plan = rebalance_experts(load, P, num_groups, num_nodes, G, policy="move_aware", old_phy2log=old)
        check_invariants(plan, E, P)
        excess = ratio(load, plan, G) - reference_ratio(load, P, num_groups, num_nodes, G)
        assert excess.mean() <= 0.0005 + 1e-9 and (excess <= LAYER_CAP * 0.0005 + 1e-9).all()
        assert moved_experts(old, plan, G) < moved_experts(old, fresh, G)
        old = plan.phy2log


#: the drift pairs of benchmarks/placement.py: (folder, load A, load B, EP size); old = "balanced" on A, global,
#: one redundant slot per GPU
DRIFT_PAIRS = [
    ("dsv3_sglang_ep_stats", "prefill_in1024", "decode_in1000out1000", 32),
    ("dsv3_sglang_ep_stats", "prefill_in512", "prefill_in4096", 32),
    ("dsv3_sglang_ep_stats", "decode_in500out1500", "decode_in2000out100", 32),
    ("qwen2_57b_oeplb", "counts57b", "counts57b_share", 8),
]


@pytest.mark.parametrize("folder, a, b, ep", [
    pytest.param(f, a, b, ep, id=b, marks=pytest.mark.real_data(f"{f}/{a}.json", f"{f}/{b}.json"))
    for f, a, b, ep in DRIFT_PAIRS])
def test_move_aware_moves_and_slack_on_the_drift_pairs(real_data, folder, a, b, ep):
    """The move-aware targets: at most 23% of the experts a fresh "balanced" plan moves (issue 33 asks for 10%;
    20.7-21.6% measured), mean max/mean at most 0.0005 (the default tolerance) above the fresh "balanced" plan's and
    above the reference (reference_peak: a lower bound on any plan's), and no layer more than twice that."""
    load_a = read_expert_load(real_data / folder / f"{a}.json").expert_load
    load_b = read_expert_load(real_data / folder / f"{b}.json").expert_load
    P = load_a.shape[1] + ep
    old = rebalance_experts(load_a, P, 1, 1, ep, policy="balanced")
    fresh = rebalance_experts(load_b, P, 1, 1, ep, policy="balanced", old_phy2log=old)
    plan = rebalance_experts(load_b, P, 1, 1, ep, policy="move_aware", old_phy2log=old)
    check_invariants(plan, load_b.shape[1], P)
    excess = ratio(load_b, plan, ep) - bound_ratio(load_b, P, ep)
    assert excess.mean() <= 0.0005 + 1e-12
    assert excess.max() <= 0.001 + 1e-12
    assert (ratio(load_b, plan, ep) - ratio(load_b, fresh, ep)).mean() <= 0.0005
    assert moved_experts(old, plan, ep) <= 0.23 * moved_experts(old, fresh, ep)


@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json", "dsv3_sglang_ep_stats/decode_in1000out1000.json")
def test_move_aware_hierarchical_drift_within_the_tolerance_of_balanced(real_data):
    """DeepSeek-V3 on 4 nodes (288 slots, 8 groups, 32 GPUs), prefill_in1024 -> decode_in1000out1000: measured
    against the node bound (reference_peak), with 2-2 swaps in the node rows, the plan is 0.00044 above the fresh
    "balanced" plan (0.00095 against the 1-1 reference before) at 22.6% of its moves (29.5% when a layer whose old
    group-to-node map was out of reach took the balanced plan's map instead of the nearest map within reach)."""
    folder = real_data / "dsv3_sglang_ep_stats"
    load_a = read_expert_load(folder / "prefill_in1024.json").expert_load
    load_b = read_expert_load(folder / "decode_in1000out1000.json").expert_load
    topo = (288, 8, 4, 32)
    old = rebalance_experts(load_a, *topo, policy="balanced")
    fresh = rebalance_experts(load_b, *topo, policy="balanced", old_phy2log=old)
    plan = rebalance_experts(load_b, *topo, policy="move_aware", old_phy2log=old)
    check_invariants(plan, 256, 288)
    assert groups_on_nodes(plan.phy2log, 256, 8, 4)
    excess = ratio(load_b, plan, 32) - bound_ratio(load_b, 288, 32, 8, 4)
    assert excess.mean() <= 0.0005 + 1e-12
    assert (ratio(load_b, plan, 32) - ratio(load_b, fresh, 32)).mean() <= 0.0005
    assert moved_experts(old, plan, 32) <= 0.23 * moved_experts(old, fresh, 32)


def test_move_aware_replans_only_the_layers_the_mean_needs():
    """Tolerance 1: a layer above the cap (2) is replanned and counts at 1. Excesses 3, 1.5, 1.2, 0.1, 0.7: the
    mean is then 0.9, met. Excesses 3, 1.5, 1.5, 1.25, 0.25: it is 1.1; replanning the first 1.5 layer (-0.5 in
    the sum) is enough (the rule before replanned the three layers above one tolerance)."""
    assert layers_to_replan(np.array([3.0, 1.5, 1.2, 0.1, 0.7]), 1.0).tolist() == [True, False, False, False, False]
    assert layers_to_replan(np.array([3.0, 1.5, 1.5, 1.25, 0.25]), 1.0).tolist() == [True, True, False, False,
                                                                                        False]
    assert not layers_to_replan(np.array([0.5, 1.5]), 1.0).any()  # mean 1.0: met


def test_repair_pair_swaps_reach_what_one_for_one_swaps_cannot():
    """Two GPUs of four slots, eight experts of one replica (no copies, no 3-cycles): the best split puts 114 on
    the heavier GPU; from slots 0-3 / 4-7 the 1-1 swaps stop at 115, a 2-2 swap gets to 114."""
    load = np.array([[5, 39, 16, 15, 41, 46, 53, 13]], dtype=np.float64)
    start = np.arange(8, dtype=np.int64)[None, :]
    peaks = []
    for pair_swaps in (False, True):
        row = start.copy()
        repair_rows(row, load, start, np.array([114.0]), 2, pair_swaps=pair_swaps)
        assert sorted(row[0].tolist()) == list(range(8))
        peaks.append(load[0][row[0]].reshape(2, 4).sum(axis=1).max())
    assert peaks == [115.0, 114.0]


def test_choose_stops_spends_the_tolerance_where_moves_are_dearest():
    """Two layers, one row each; trajectories (moved experts, heaviest GPU) with balanced's peak 1.0, mean 1.0.
    Mean excess <= 0.001: layer 0 must go to 0 (5 moves) so that layer 1 may stop at 0.0006 (1 move) rather than
    go on to 0 (10 moves); stopping layer 0 at 0.002 would need layer 1 at 0 (12 moves in all)."""
    rows = np.array([0, 1])
    points = [(rows, np.array([0, 0]), np.array([1.10, 1.05])),
              (rows, np.array([2, 1]), np.array([1.002, 1.0006])),
              (rows, np.array([5, 10]), np.array([1.0, 1.0]))]
    stops, excess = choose_stops(points, rows, np.ones(2), np.ones(2), 0.001, 0.002)
    assert stops.tolist() == [2, 1]
    assert excess == pytest.approx([0.0, 0.0006])
    # one layer of two node rows: the layer's excess is its heavier row's (0.0006 <= 0.001: row 1 stops at once)
    stops, excess = choose_stops(points, np.array([0, 0]), np.ones(1), np.ones(1), 0.001, 0.002)
    assert stops.tolist() == [2, 1] and excess == pytest.approx([0.0006])
    stops, excess = choose_stops(points, np.array([0, 0]), np.ones(1), np.ones(1), 0.0005, 0.001)
    assert stops.tolist() == [2, 2] and excess == pytest.approx([0.0])


def test_choose_stops_counts_a_layer_out_of_reach_at_the_tolerance():
    """Layer 0 cannot get under the cap (0.002): the caller plans it again within the tolerance, so with
    replanned_at_tolerance it counts at 0.001 and layer 1 may stop at 0.0006 (1 move); counted at its reach (0.05)
    the mean is out of reach and every other layer goes to its lowest point (10 moves)."""
    rows = np.array([0, 1])
    points = [(rows, np.array([0, 0]), np.array([1.10, 1.05])),
              (rows, np.array([2, 1]), np.array([1.05, 1.0006])),
              (rows, np.array([5, 10]), np.array([1.05, 1.0]))]
    stops, excess = choose_stops(points, rows, np.ones(2), np.ones(2), 0.001, 0.002, replanned_at_tolerance=True)
    assert stops[1] == 1 and excess[1] == pytest.approx(0.0006) and excess[0] > 0.002
    stops, excess = choose_stops(points, rows, np.ones(2), np.ones(2), 0.001, 0.002)
    assert stops[1] == 2 and excess[1] == pytest.approx(0.0)


def test_move_aware_refills_a_layer_the_repair_cannot_bring_in():
    """A random lognormal(1) layer (the harness's "random" pair, layer 10) where one expert carries 0.997 x the
    mean GPU load on one replica (0.30 at the best counts): the batched repair gets stuck at +0.03; bulk replica
    counts then the repair again bring it within the tolerance of "balanced" with 75 moved experts (the
    fallback to the balanced plan moved 235 of the 279 a fresh plan moves)."""
    def layer(seed):
        return np.rint(1e4 * np.random.default_rng(seed).lognormal(0.0, 1.0, size=(58, 256)))[10:11].astype(np.int64)
    load_a, load_b = layer(33), layer(34)
    old = rebalance_experts(load_a, 288, 1, 1, 32, policy="balanced")
    fresh = rebalance_experts(load_b, 288, 1, 1, 32, policy="balanced", old_phy2log=old)
    plan = rebalance_experts(load_b, 288, 1, 1, 32, policy="move_aware", old_phy2log=old)
    check_invariants(plan, 256, 288)
    assert (ratio(load_b, plan, 32) <= ratio(load_b, fresh, 32) + 0.0005).all()
    assert moved_experts(old, plan, 32) <= 0.4 * moved_experts(old, fresh, 32)


@QWEN2_DRIFT
def test_move_aware_knobs(qwen2_drift):
    a, load, old = qwen2_drift
    assert moved_experts(old, rebalance_experts(a, 72, 1, 1, 8, policy="move_aware", old_phy2log=old), 8) == 0
    capped = rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, max_moved_experts=20)
    assert moved_experts(old, capped, 8) <= 20
    assert moved_experts(old, rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old,
                                                max_moved_experts=0), 8) == 0
    loose = rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, tolerance=0.01)
    tight = rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, tolerance=0.0)
    assert moved_experts(old, loose, 8) < moved_experts(old, tight, 8)
    with pytest.raises(InputError, match="old_phy2log"):
        rebalance_experts(load, 72, 1, 1, 8, policy="move_aware")
    with pytest.raises(InputError, match="tolerance"):
        rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, tolerance=-1)
    with pytest.raises(InputError, match="max_moved_experts"):
        rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, max_moved_experts=-3)


@QWEN2_DRIFT
def test_move_aware_move_budget_is_a_pareto_option(qwen2_drift):
    """--max-moved-experts: the best balance the budget buys, never worse for a larger budget; the budgeted stops
    of the repair's trajectories beat spending the budget worst layer first (1.054 at 100 moves with the worst-layer-first budget alone)."""
    _, load, old = qwen2_drift
    previous = np.inf
    for cap in (0, 20, 100, 300, 1000):
        plan = rebalance_experts(load, 72, 1, 1, 8, policy="move_aware", old_phy2log=old, max_moved_experts=cap)
        check_invariants(plan, 64, 72)
        assert moved_experts(old, plan, 8) <= cap
        level = ratio(load, plan, 8).mean()
        assert level <= previous + 1e-12, cap
        previous = level
        if cap == 100:
            assert level < 1.02


@pytest.mark.real_data("dsv3_sglang_ep_stats/decode_in2000out100.json")
def test_move_aware_hierarchical_from_the_initial_placement(real_data):
    load = read_expert_load(real_data / "dsv3_sglang_ep_stats" / "decode_in2000out100.json").expert_load[:6]
    old = initial_placement(6, 256, 288, num_gpus=32)  # groups straddle nodes: some experts must move
    plan = rebalance_experts(load, 288, 8, 4, 32, policy="move_aware", old_phy2log=old)
    check_invariants(plan, 256, 288)
    assert (ratio(load, plan, 32) <= reference_ratio(load, 288, 8, 4, 32) + 0.001).all()
    group, node = plan.phy2log // 32, np.arange(288) // 72
    for layer in range(6):
        assert np.unique(np.stack([group[layer], node]), axis=1).shape[1] == 8


def test_align_slots_keeps_staying_experts_in_place():
    old = np.array([[0, 1, 2, 3, 4, 5]])
    new = np.array([[2, 0, 5, 4, 1, 3]])
    assert align_slots(old, new, 2).tolist() == [[0, 5, 2, 3, 4, 1]]
    assert align_slots(old, old, 2).tolist() == old.tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9).flatmap(lambda S: st.tuples(
    st.lists(st.lists(st.integers(0, 5), min_size=S, max_size=S), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(0, 5), min_size=S, max_size=S), min_size=1, max_size=4))))
def test_move_aware_batched_alignment_is_align_slots(pair):
    """The uncapped path's vectorised slot alignment gives align_slots' rows (duplicates on a GPU included)."""
    old, new = (np.array(x, dtype=np.int64) for x in pair)
    k = min(len(old), len(new))
    old, new = old[:k], new[:k]
    assert _align_gpus(old, new).tolist() == align_slots(old, new, 1).tolist()


# ---- properties on random shapes ----------------------------------------------------------------------------------
@st.composite
def problems(draw):
    num_groups = draw(st.sampled_from([1, 2, 4]))
    E = num_groups * draw(st.integers(1, 4))
    num_nodes = draw(st.sampled_from([1, 2, 4]))  # groups % nodes != 0 exercises the global fallback
    num_gpus = num_nodes * draw(st.integers(1, 3))
    P = num_gpus * draw(st.integers(-(-E // num_gpus), -(-E // num_gpus) + 2))
    L = draw(st.integers(1, 3))
    load = np.array(draw(st.lists(st.lists(st.integers(0, 50), min_size=E, max_size=E), min_size=L, max_size=L)))
    old = np.array([draw(st.permutations(list(range(E)) + [draw(st.integers(0, E - 1)) for _ in range(P - E)]))
                    for _ in range(L)])
    return load, (P, num_groups, num_nodes, num_gpus), old


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_policy_gives_a_valid_deterministic_placement(problem):
    load, topo, old = problem
    P, _, _, G = topo
    deepseek = rebalance_experts(load, *topo)
    assert deepseek.phy2log.tolist() == deepseek_reference(load, *topo).tolist()
    fresh = rebalance_experts(load, *topo, policy="balanced")
    assert (ratio(load, fresh, G) <= ratio(load, deepseek, G) + 1e-12).all()
    reference = reference_ratio(load, *topo)
    if topo[1] % topo[2] == 0:  # hierarchical: "balanced" before its 2-2 stage, at most _GOOD_ENOUGH worse
        assert (ratio(load, fresh, G) <= reference + 1e-5 + 1e-12).all()
        # and the node bound move_aware measures against (no cap) is never above "balanced"
        assert (bound_ratio(load, P, G, topo[1], topo[2]) <= ratio(load, fresh, G) + 1e-12).all()
    else:  # global: move_aware's bound is never above any plan's
        assert (bound_ratio(load, P, G) <= ratio(load, fresh, G) + 1e-12).all()
    for policy in POLICIES:
        plan = rebalance_experts(load, *topo, policy=policy, old_phy2log=old)
        check_invariants(plan, load.shape[1], P)
        assert plan == rebalance_experts(load, *topo, policy=policy, old_phy2log=old)
    plan = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old)
    assert (ratio(load, plan, G) <= reference + 0.001 + 1e-12).all()


# ---- move_aware: the move cap in hierarchical mode ----------------------------------------------------------------
@st.composite
def hierarchical_problems(draw):
    num_nodes = draw(st.sampled_from([2, 4]))
    num_groups = num_nodes * draw(st.integers(1, 3))
    E = num_groups * draw(st.integers(1, 4))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    P = num_gpus * draw(st.integers(-(-E // num_gpus), -(-E // num_gpus) + 2))
    L = draw(st.integers(1, 3))
    loads = st.lists(st.lists(st.integers(0, 100), min_size=E, max_size=E), min_size=L, max_size=L)
    before, after = np.array(draw(loads)), np.array(draw(loads))
    # an old layer without load keeps the trivial placement, which spreads groups over nodes (a cap of 0 is then an
    # error: test_move_aware_hierarchical_cap_examples); here every old layer keeps groups on nodes
    assume(before.sum(axis=1).all())
    topo = (P, num_groups, num_nodes, num_gpus)
    old = rebalance_experts(before, *topo, policy=draw(st.sampled_from(["deepseek", "balanced"]))).phy2log
    cap = draw(st.one_of(st.none(), st.integers(0, 3), st.integers(0, 3 * P)))
    return after, topo, old, cap


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hierarchical_problems())
def test_move_aware_cap_holds_in_hierarchical_mode(problem):
    load, topo, old, cap = problem
    P, num_groups, num_nodes, G = topo
    E = load.shape[1]
    plan = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old, max_moved_experts=cap)
    check_invariants(plan, E, P)
    assert groups_on_nodes(plan.phy2log, E, num_groups, num_nodes)
    assert plan == rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old, max_moved_experts=cap)
    if cap is None:
        assert (ratio(load, plan, G) <= reference_ratio(load, *topo) + 0.001 + 1e-12).all()
    else:
        assert moved_experts(old, plan, G) <= cap
        more = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old, max_moved_experts=cap + 3)
        assert (1 + imbalance(load, more, G)).mean() <= (1 + imbalance(load, plan, G)).mean() + 1e-12
    still = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old, max_moved_experts=0)
    assert still.phy2log.tolist() == old.tolist()
    for zero_cap in (None, cap):  # all-zero loads: every GPU load is already 0, nothing needs to move
        idle = rebalance_experts(np.zeros_like(load), *topo, policy="move_aware", old_phy2log=old,
                                 max_moved_experts=zero_cap)
        assert idle.phy2log.tolist() == old.tolist()


def test_move_aware_hierarchical_cap_examples():
    rng = np.random.default_rng(7)
    topo = (24, 4, 2, 8)
    old = rebalance_experts(rng.integers(0, 100, (4, 16)), *topo).phy2log
    load = rng.integers(0, 100, (4, 16))
    free = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old)
    assert moved_experts(old, free, 8) > 5
    for cap in (0, 1, 5):
        capped = rebalance_experts(load, *topo, policy="move_aware", old_phy2log=old, max_moved_experts=cap)
        assert moved_experts(old, capped, 8) <= cap
        assert groups_on_nodes(capped.phy2log, 16, 4, 2)
    # the initial placement spreads groups over nodes: putting them on whole nodes has a price the cap must cover
    initial = initial_placement(2, 16, 24).phy2log
    assert not groups_on_nodes(initial, 16, 4, 2)
    with pytest.raises(InputError, match="max_moved_experts=0 cannot be met.*spreads expert groups over nodes"):
        rebalance_experts(load[:2], *topo, policy="move_aware", old_phy2log=initial, max_moved_experts=0)
    for cap in (16, 20, None):
        plan = rebalance_experts(load[:2], *topo, policy="move_aware", old_phy2log=initial, max_moved_experts=cap)
        check_invariants(plan, 16, 24)
        assert groups_on_nodes(plan.phy2log, 16, 4, 2)
        assert cap is None or moved_experts(initial, plan, 8) <= cap


def test_a_numpy_scalar_tolerance_is_a_number_and_a_bool_is_not():
    # QA: np.float32(0.01) (a numpy reduction's result) was refused as "not a finite number >= 0"; a bool still is
    rng = np.random.default_rng(3)
    load, old = rng.integers(0, 1000, (3, 16)), rebalance_experts(rng.integers(0, 1000, (3, 16)), 24, 1, 1, 4).phy2log
    for policy in ("move_aware", "topology_aware"):
        for tol in (np.float32(0.01), np.float64(0.01), np.int64(0)):
            got = rebalance_experts(load, 24, 1, 1, 4, policy=policy, old_phy2log=old, tolerance=tol)
            want = rebalance_experts(load, 24, 1, 1, 4, policy=policy, old_phy2log=old, tolerance=float(tol))
            assert np.array_equal(got.phy2log, want.phy2log)
        for bad in (True, np.bool_(True), "0.01", np.float32("nan"), -1):
            with pytest.raises(InputError, match="tolerance must be a finite number >= 0"):
                rebalance_experts(load, 24, 1, 1, 4, policy=policy, old_phy2log=old, tolerance=bad)


@pytest.mark.parametrize("policy, kw", [("move_aware", {}), ("move_aware", {"max_moved_experts": 10}),
                                        ("topology_aware", {})])
def test_a_huge_tolerance_is_the_largest_that_means_anything(policy, kw):
    # QA: tolerance=1e308 overflowed float64 (numpy warnings); max/mean never exceeds num_gpus, so it is num_gpus
    rng = np.random.default_rng(4)
    load, old = rng.integers(0, 1000, (3, 16)), rebalance_experts(rng.integers(0, 1000, (3, 16)), 24, 1, 1, 4).phy2log
    with np.errstate(all="raise"):
        huge = rebalance_experts(load, 24, 1, 1, 4, policy=policy, old_phy2log=old, tolerance=1e308, **kw)
    want = rebalance_experts(load, 24, 1, 1, 4, policy=policy, old_phy2log=old, tolerance=4.0, **kw)
    assert np.array_equal(huge.phy2log, want.phy2log)
