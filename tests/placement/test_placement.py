"""Placement policies: golden vectors, invariants on every real dump, determinism, typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.errors import InputError, TopologyError
from fdeplb.placement import Placement, initial_placement, rebalance_experts
from fdeplb.placement.deepseek import balanced_packing, replicate_experts
from fdeplb.placement.reference import deepseek_reference
from tests.placement.helpers import check_invariants, dumps, topologies

# DeepSeek's README example (github.com/deepseek-ai/EPLB), also vLLM's test_basic_rebalance.
README_LOAD = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


# ---- golden vectors -----------------------------------------------------------------------------------------------
def test_deepseek_readme_example_bit_exact():
    pl = rebalance_experts(README_LOAD, 16, 4, 2, 8)
    assert pl.phy2log.tolist() == README_PHY2LOG
    assert pl.logcnt.tolist() == README_LOGCNT
    assert (pl.policy, pl.num_groups, pl.num_nodes, pl.num_gpus) == ("deepseek", 4, 2, 8)
    check_invariants(pl, 12, 16)
    # log2phy lists replicas in replica-rank order, as eplb.py returns it (torch 2.13 CPU)
    assert pl.log2phy[0, 1].tolist() == [15, 13]
    assert pl.log2phy[0, 4].tolist() == [7, 5]
    assert pl.log2phy[0, 7].tolist() == [3, -1]


def test_deepseek_float_and_int_loads_agree():
    a = rebalance_experts(README_LOAD, 16, 4, 2, 8)
    b = rebalance_experts(README_LOAD.astype(np.float64), 16, 4, 2, 8)
    c = rebalance_experts(README_LOAD.astype(np.uint32), 16, 4, 2, 8)
    assert a == b == c


def test_fastdeploy_exact_cases():
    # FastDeploy tests/eplb: one group per pack is the identity; no redundancy keeps every expert in its slot
    pack, rank = balanced_packing(np.array([[1, 2, 3]], dtype=np.float32), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]
    phy2log, phyrank, logcnt = replicate_experts(np.array([[1, 2, 3]], dtype=np.float32), 3)
    assert phy2log.tolist() == [[0, 1, 2]] and phyrank.tolist() == [[0, 0, 0]] and logcnt.tolist() == [[1, 1, 1]]
    phy2log, phyrank, logcnt = replicate_experts(np.array([[3, 1]], dtype=np.float32), 4)
    assert logcnt.tolist() == [[3, 1]] and phy2log.tolist() == [[0, 1, 0, 0]] and phyrank.tolist() == [[0, 0, 1, 2]]


@pytest.mark.parametrize(
    "load, topo",
    [
        ([[10, 20, 30, 40]], (4, 1, 1, 1)),  # vLLM test_single_gpu_case
        ([[50] * 8], (8, 2, 2, 4)),  # test_equal_weights
        ([[1000, 1, 1, 1, 1, 1, 1, 1]], (12, 2, 2, 4)),  # test_extreme_weight_imbalance
        ([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6], (8, 2, 2, 4)),  # test_multiple_layers
        ([[10, 20, 30, 40]], (8, 3, 2, 4)),  # test_parameter_validation: 3 groups on 2 nodes -> global
        ([[100, 50, 200, 75, 150, 25, 300, 80]], (12, 4, 2, 4)),  # test_small_scale_hierarchical
        ([[10, 20, 30, 40, 50, 60]], (8, 3, 2, 4)),  # test_global_load_balance_fallback
        ([[10, 20, 30, 40]], (6, 2, 1, 2)),  # test_device_compatibility
        ([[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]], (24, 8, 4, 8)),
        ([[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]], (10, 3, 1, 2)),
    ],
)
def test_vllm_cases_match_reference(load, topo):
    load = np.array(load)
    pl = rebalance_experts(load, *topo)
    check_invariants(pl, load.shape[1], topo[0])
    assert pl.phy2log.tolist() == deepseek_reference(load, *topo).tolist()


def test_vllm_case_properties():
    assert (rebalance_experts(np.array([[50] * 8]), 8, 2, 2, 4).logcnt == 1).all()
    lc = rebalance_experts(np.array([[1000, 1, 1, 1, 1, 1, 1, 1]]), 12, 2, 2, 4).logcnt
    assert lc[0, 0] > lc[0, 1]
    lc = rebalance_experts(np.array([[100, 50, 200, 75, 150, 25, 300, 80]]), 12, 4, 2, 4).logcnt
    assert lc[0, 6] >= 2
    lc = rebalance_experts(np.array([[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]]), 10, 3, 1, 2).logcnt
    assert lc[0, 0] >= 2 and lc[1, 5] >= 2


def test_ties_go_to_the_lowest_index():
    # all-zero loads: every expert's load per replica stays 0, so expert 0 takes every redundant slot
    pl = rebalance_experts(np.zeros((1, 4)), 6, 1, 1, 2)
    assert pl.logcnt.tolist() == [[3, 1, 1, 1]]
    assert pl.phy2log.tolist() == deepseek_reference(np.zeros((1, 4)), 6, 1, 1, 2).tolist()


def test_initial_placement():
    pl = initial_placement(3, 4, 6, num_gpus=2)
    assert pl.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]] * 3
    assert pl.logcnt.tolist() == [[2, 2, 1, 1]] * 3
    assert pl.log2phy[0].tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert pl.policy == "initial" and pl.slots_per_gpu == 3 and pl.num_redundant_experts == 2
    with pytest.raises(TopologyError):
        initial_placement(1, 8, 4)
    with pytest.raises(TopologyError):
        initial_placement(1, 4, 6, num_gpus=4)


def test_placement_is_read_only_and_compares_by_value():
    pl = rebalance_experts(README_LOAD, 16, 4, 2, 8)
    with pytest.raises(ValueError):
        pl.phy2log[0, 0] = 1
    with pytest.raises(ValueError):
        pl.logcnt[0, 0] = 1
    again = Placement.from_phy2log(pl.phy2log.tolist(), 12, num_groups=4, num_nodes=2, num_gpus=8)
    assert again == pl and again.policy == "unknown"
    assert again != Placement.from_phy2log(pl.phy2log, 12, num_gpus=8)
    with pytest.raises(TypeError):
        hash(pl)


# ---- real dumps ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # every real dump at several topologies
def test_deepseek_invariants_on_every_real_dump(real_data):
    for name, dump in dumps(real_data):
        load = dump.expert_load
        for topo in topologies(load.shape[1]):
            pl = rebalance_experts(load, *topo)
            check_invariants(pl, load.shape[1], topo[0])
            assert rebalance_experts(load, *topo) == pl, (name, topo)  # deterministic
            if topo[2] > 1 and topo[1] % topo[2] == 0:  # hierarchical: a group's replicas stay on one node
                E, N, G = load.shape[1], topo[2], topo[1]
                node_of_slot = np.arange(topo[0]) // (topo[0] // N)
                group_of_slot = pl.phy2log // (E // G)
                for layer in range(pl.num_layers):
                    pairs = np.unique(np.stack([group_of_slot[layer], node_of_slot]), axis=1)
                    assert pairs.shape[1] == G, (name, topo, layer)


@pytest.mark.slow  # the pure-Python port on every real dump
def test_deepseek_matches_plain_python_reference_on_real_dumps(real_data):
    for name, dump in dumps(real_data):
        topo = topologies(dump.num_logical_experts)[0]
        got = rebalance_experts(dump.expert_load, *topo).phy2log
        assert np.array_equal(got, deepseek_reference(dump.expert_load, *topo)), name


# ---- typed errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "load, message",
    [
        (np.ones(12), "2-D"),
        (np.ones((1, 2, 12)), "2-D"),
        (np.ones((0, 12)), "at least one layer"),
        (np.array([["a"] * 12]), "dtype"),
        (np.ones((1, 12), dtype=bool), "dtype"),
        (np.ones((1, 12), dtype=complex), "dtype"),
        (np.array([[np.nan] + [1.0] * 11]), "NaN"),
        (np.array([[np.inf] + [1.0] * 11]), "inf"),
        (np.array([[-1] + [1] * 11]), "negative"),
        ([[1] * 12, [1] * 11], "rectangular"),
    ],
)
def test_bad_load_raises_input_error(load, message):
    with pytest.raises(InputError, match=message):
        rebalance_experts(load, 16, 4, 2, 8)


@pytest.mark.parametrize(
    "topo, error, message",
    [
        ((15, 4, 2, 8), TopologyError, "multiple of num_gpus"),
        ((8, 4, 2, 8), TopologyError, "num_logical_experts"),
        ((16, 4, 3, 8), TopologyError, "multiple of num_nodes"),
        ((16, 5, 1, 8), TopologyError, "multiple of num_groups"),
        ((0, 4, 2, 8), InputError, "num_replicas"),
        ((16.0, 4, 2, 8), InputError, "integer"),
        ((16, 4, True, 8), InputError, "integer"),
        ((16, 4, 2, -8), InputError, "num_gpus"),
    ],
)
def test_bad_topology_raises_typed_error(topo, error, message):
    with pytest.raises(error, match=message):
        rebalance_experts(README_LOAD, *topo)


def test_unknown_policy_and_bad_old_placement():
    with pytest.raises(InputError, match="unknown placement policy"):
        rebalance_experts(README_LOAD, 16, 4, 2, 8, policy="magic")
    with pytest.raises(InputError, match="shape"):
        rebalance_experts(README_LOAD, 16, 4, 2, 8, old_phy2log=np.zeros((2, 12), dtype=np.int64))
    with pytest.raises(InputError, match="no slot"):
        rebalance_experts(README_LOAD, 16, 4, 2, 8, old_phy2log=np.zeros((2, 16), dtype=np.int64))
    with pytest.raises(InputError, match="logical expert id"):
        rebalance_experts(README_LOAD, 16, 4, 2, 8, old_phy2log=np.full((2, 16), 12))
