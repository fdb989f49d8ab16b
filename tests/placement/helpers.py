"""What the placement tests share: the real dumps and topologies they sweep, and the invariants every placement
keeps."""

from __future__ import annotations

import numpy as np

from fdeplb.placement import Placement, read_expert_load


def dumps(real_data):
    """(name, ExpertLoad) of every real dump."""
    return [(p.stem, read_expert_load(p)) for p in sorted(real_data.glob("*/*.json"))]


def topologies(num_experts: int):
    """(num_replicas, num_groups, num_nodes, num_gpus) exercised on a dump with ``num_experts`` experts."""
    if num_experts == 256:  # DeepSeek-V3: 8 groups; EP32 hierarchical and global, EP64, EP16 on 2 nodes
        return [(288, 8, 4, 32), (288, 8, 1, 32), (320, 8, 8, 64), (272, 8, 2, 16)]
    return [(num_experts + num_experts // 8, 1, 1, 8), (num_experts + num_experts // 4, 4, 2, 16)]


def check_invariants(pl: Placement, num_experts: int, num_replicas: int) -> None:
    L = pl.num_layers
    assert pl.phy2log.dtype == np.int64 and pl.phy2log.shape == (L, num_replicas)
    assert pl.logcnt.dtype == np.int64 and pl.logcnt.shape == (L, num_experts)
    assert (pl.logcnt >= 1).all()
    assert (pl.logcnt.sum(axis=1) == num_replicas).all()
    for layer in range(L):
        assert (np.bincount(pl.phy2log[layer], minlength=num_experts) == pl.logcnt[layer]).all()
    # log2phy lists each expert's slots, -1 padded: in ascending phy_id order except for "deepseek", which lists
    # them in replica-rank order like eplb.py (checked against eplb.py's own output in test_golden.py)
    assert pl.log2phy.shape == (L, num_experts, int(pl.logcnt.max()))
    valid = pl.log2phy >= 0
    assert (valid.sum(axis=2) == pl.logcnt).all()
    layers, experts, _ = np.nonzero(valid)
    assert (pl.phy2log[layers, pl.log2phy[valid]] == experts).all()
    padded = np.where(valid, pl.log2phy, np.iinfo(np.int64).max)
    if pl.policy != "deepseek":
        assert ((np.diff(padded, axis=2) > 0) | ~valid[:, :, 1:]).all()
    assert (valid[:, :, :-1] | ~valid[:, :, 1:]).all()  # padding only at the end


def groups_on_nodes(phy2log, num_experts, num_groups, num_nodes):
    """Every group's experts on one node, in every layer."""
    P = phy2log.shape[1]
    group, node = phy2log // (num_experts // num_groups), np.arange(P) // (P // num_nodes)
    return all(np.unique(np.stack([group[layer], node]), axis=1).shape[1] == num_groups for layer in range(len(group)))
