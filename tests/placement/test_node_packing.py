"""Hierarchical node packings: "balanced"'s lighter packing of groups onto nodes never costs a layer balance nor lifts
"move_aware"'s reference above the "balanced" plan, and "move_aware" stays valid where the "balanced" plan keeps
DeepSeek's packing instead of its start's."""

from __future__ import annotations

import numpy as np

from fdeplb.placement import balanced as balanced_module
from fdeplb.placement import rebalance_experts
from fdeplb.placement.balanced import balanced_plan, balanced_start
from fdeplb.placement.metrics import raw_gpu_loads
from fdeplb.placement.move_aware import reference_peak
from tests.placement.helpers import check_invariants, groups_on_nodes

#: 8 one-expert groups on 2 nodes of 4 GPUs, 2 slots a GPU: the lightest node packing (2155 / 2156 tokens) packs
#: its replicas onto GPUs worse (575) than DeepSeek's greedy packing's do after the search (556.67)
LIGHTER_PACKS_WORSE = np.array([[822, 237, 42, 513, 533, 884, 524, 756]])


def test_a_lighter_node_packing_never_ends_above_the_search_from_deepseeks(monkeypatch):
    """Per layer, "balanced" with the lighter node packings is never heavier than "balanced" searched from DeepSeek's
    packing alone (the plan before the lighter packings existed)."""
    rng = np.random.default_rng(7)
    loads = [LIGHTER_PACKS_WORSE] + [np.round(rng.lognormal(0.0, 1.0, (6, 16)) * 100) for _ in range(4)]
    for load in loads:
        topo = (16, 8, 2, 8)
        start, _, deepseek, _ = balanced_start(load, *topo)
        ours = balanced_plan(load, *topo)[1]
        monkeypatch.setattr(balanced_module, "lightest_maps", lambda *_: None)
        theirs = balanced_plan(load, *topo)[1]
        monkeypatch.undo()
        assert (ours <= theirs * (1 + 1e-12)).all()
    assert (start != deepseek).any()  # the lighter packing is taken somewhere
    load = LIGHTER_PACKS_WORSE.astype(np.float64)
    start, _, deepseek, _ = balanced_start(load, *topo)
    assert not (start == deepseek).all()
    assert raw_gpu_loads(load, rebalance_experts(load, *topo, policy="balanced").phy2log, 8).max() < 575


#: 8 groups of 2 experts on 2 nodes of 4 GPUs, no redundant slot; the old placement keeps groups on nodes, its
#: heaviest node is out of reach, and the "balanced" plan keeps DeepSeek's node packing (its start's lighter one
#: packs worse onto GPUs)
NO_REDUNDANCY_LOAD = np.array([[764, 898, 695, 877, 282, 872, 835, 475, 431, 642, 179, 444, 687, 34, 446, 485]])
NO_REDUNDANCY_OLD = np.array([[12, 13, 0, 1, 6, 10, 11, 7, 4, 3, 8, 14, 5, 15, 2, 9]])


def test_move_aware_where_balanced_keeps_deepseeks_packing():
    """The layer is planned again from the "balanced" plan (its excess is above the layer cap): every expert keeps a
    slot and every group stays on one node (the balanced map used to come from the start's packing while the plan
    had DeepSeek's: 'logical expert 0 has no slot')."""
    topo = (16, 8, 2, 8)
    plan = rebalance_experts(NO_REDUNDANCY_LOAD, *topo, policy="move_aware", old_phy2log=NO_REDUNDANCY_OLD)
    check_invariants(plan, 16, 16)
    assert groups_on_nodes(plan.phy2log, 16, 8, 2)


#: 8 groups of 2 experts on 2 nodes of 3 GPUs, 18 slots: the lighter node packing leaves expert 13 (800 tokens) one
#: replica, so the bound at it (800) is above the "balanced" plan, which ends on DeepSeek's packing (773.5)
BOUND_ABOVE_LIGHTER = np.array([[67, 1131, 45, 200, 82, 684, 161, 738, 113, 3, 19, 8, 15, 800, 212, 65]])


def test_move_aware_reference_never_above_the_balanced_plan():
    """"move_aware"'s reference (its tolerance is measured against it) is never above the "balanced" plan's heaviest
    GPU, also where the lighter node packing's bound is (random layers of 8 groups on 2 nodes besides)."""
    rng = np.random.default_rng(3)
    cases = [(BOUND_ABOVE_LIGHTER, (18, 8, 2, 6))] + [(rng.lognormal(0.0, 1.5, (8, 16)) * 100, (18, 8, 2, 6))
                                                      for _ in range(3)]
    for load, topo in cases:
        assert (reference_peak(load, *topo) <= balanced_plan(load, *topo)[1] * (1 + 1e-12)).all()
    start, _, deepseek, _ = balanced_start(BOUND_ABOVE_LIGHTER, 18, 8, 2, 6)
    assert (start != deepseek).any()
