"""Hierarchical node packings: "balanced"'s lighter packing of groups onto nodes never costs a layer balance."""

from __future__ import annotations

import numpy as np

from fdeplb.placement import balanced as balanced_module
from fdeplb.placement import rebalance_experts
from fdeplb.placement.balanced import balanced_plan, balanced_start
from fdeplb.placement.metrics import raw_gpu_loads

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
        start, _, deepseek = balanced_start(load, *topo)
        ours = balanced_plan(load, *topo)[1]
        monkeypatch.setattr(balanced_module, "lightest_maps", lambda *_: None)
        theirs = balanced_plan(load, *topo)[1]
        monkeypatch.undo()
        assert (ours <= theirs * (1 + 1e-12)).all()
    assert (start != deepseek).any()  # the lighter packing is taken somewhere
    load = LIGHTER_PACKS_WORSE.astype(np.float64)
    start, _, deepseek = balanced_start(load, *topo)
    assert not (start == deepseek).all()
    assert raw_gpu_loads(load, rebalance_experts(load, *topo, policy="balanced").phy2log, 8).max() < 575

