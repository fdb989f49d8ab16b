"""Placement over a live-rank mask (fdeplb.placement.live_ranks): property tests over random placements and masks,
plus the fail-closed refusal and the policies' ``live_ranks`` argument."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdeplb.errors import InputError, RedundancyError
from fdeplb.placement import POLICIES, check_live_ranks, initial_placement, live_maps, moved_experts, \
    orphaned_experts, rebalance_experts, replace_orphans


@st.composite
def cases(draw):
    """(phy2log int64 [L, P], E, ep_size, live mask, load [L, E]): every expert placed at least once."""
    ep_size = draw(st.integers(2, 6))
    per = draw(st.integers(1, 5))
    P = ep_size * per
    E = draw(st.integers(1, P))
    L = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(L):
        row = np.concatenate([np.arange(E), rng.integers(0, E, P - E)])
        rows.append(rng.permutation(row))
    live = np.array(draw(st.lists(st.booleans(), min_size=ep_size, max_size=ep_size)))
    if not live.any():
        live[draw(st.integers(0, ep_size - 1))] = True
    load = rng.integers(0, 1000, (L, E))
    return np.array(rows, dtype=np.int64), E, ep_size, live, load


def _dead_slots(P, ep_size, live):
    return ~np.repeat(live, P // ep_size)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_replace_orphans_covers_every_expert_or_refuses_and_moves_only_orphans(case):
    phy2log, E, ep_size, live, load = case
    orphans = orphaned_experts(phy2log, E, ep_size, live)
    dead = _dead_slots(phy2log.shape[1], ep_size, live)
    try:
        new = replace_orphans(phy2log, E, ep_size, live, load)
    except RedundancyError as err:
        assert err.orphans and set(err.orphans) <= set(orphans)
        for layer in {l for l, _ in err.orphans}:  # refused only where the redundant live replicas run out
            live_row = phy2log[layer, ~dead]
            redundant = live_row.size - np.unique(live_row).size
            assert redundant < sum(1 for l, _ in orphans if l == layer)
        return
    assert orphaned_experts(new, E, ep_size, live) == []
    changed = np.argwhere(new != phy2log)
    assert len(changed) == len(orphans)  # one slot per orphan, nothing else moves
    assert not dead[changed[:, 1]].any()  # only live slots change; a lost rank's slots keep their entries
    assert sorted((int(l), int(new[l, p])) for l, p in changed) == sorted(orphans)
    assert np.array_equal(new[:, dead], phy2log[:, dead])
    assert np.array_equal(replace_orphans(phy2log, E, ep_size, live, load), new)  # deterministic


@settings(max_examples=300, deadline=None)
@given(cases())
def test_live_maps_never_route_to_a_lost_rank(case):
    phy2log, E, ep_size, live, load = case
    try:
        phy2log = replace_orphans(phy2log, E, ep_size, live, load)
    except RedundancyError:
        with pytest.raises(RedundancyError):
            live_maps(phy2log, E, ep_size, live)
        return
    log2phy, logcnt = live_maps(phy2log, E, ep_size, live)
    dead = _dead_slots(phy2log.shape[1], ep_size, live)
    routed = log2phy[log2phy >= 0]
    assert not dead[routed].any()
    assert (logcnt >= 1).all() and logcnt.sum() == phy2log.shape[0] * int((~dead).sum())
    for l in range(phy2log.shape[0]):
        for e in range(E):
            slots = log2phy[l, e, :logcnt[l, e]]
            assert (log2phy[l, e, logcnt[l, e]:] == -1).all()
            assert (phy2log[l, slots] == e).all() and list(slots) == sorted(slots)


def test_a_lost_rank_without_redundancy_fails_closed_naming_the_experts():
    old = initial_placement(2, 8, 8, num_gpus=4).phy2log  # no redundant slot
    live = check_live_ranks([0, 1, 3], 4)
    with pytest.raises(RedundancyError, match="redundancy insufficient") as err:
        replace_orphans(old, 8, 4, live)
    assert err.value.orphans == [(0, 4), (0, 5), (1, 4), (1, 5)]
    with pytest.raises(RedundancyError):
        rebalance_experts(np.ones((2, 8)), 8, 1, 1, 4, policy="move_aware", old_phy2log=old, live_ranks=live)


def test_the_least_loaded_redundant_replica_gives_up_its_slot():
    # 4 experts on 6 slots over 3 ranks: [0 1 | 2 3 | 0 2]; rank 1 is lost: 3 is orphaned (2 keeps slot 5)
    old = np.array([[0, 1, 2, 3, 0, 2]])
    load = np.array([[10, 50, 40, 99]])
    new = replace_orphans(old, 4, 3, check_live_ranks([0, 2], 3), load)
    # donors: expert 0 (two live replicas, 10/2 = 5 per replica): its lower slot 0 goes to expert 3
    assert new.tolist() == [[3, 1, 2, 3, 0, 2]]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_takes_a_live_rank_mask(policy):
    rng = np.random.default_rng(7)
    load = rng.integers(0, 10_000, (3, 16))
    old = initial_placement(3, 16, 32, num_groups=4, num_nodes=2, num_gpus=8).phy2log
    full = rebalance_experts(load, 32, 4, 2, 8, policy=policy, old_phy2log=old)
    same = rebalance_experts(load, 32, 4, 2, 8, policy=policy, old_phy2log=old, live_ranks=[True] * 8)
    assert np.array_equal(full.phy2log, same.phy2log) and np.array_equal(full.log2phy, same.log2phy)
    live = check_live_ranks([0, 1, 2, 4, 5, 6, 7], 8)
    masked = rebalance_experts(load, 32, 4, 2, 8, policy=policy, old_phy2log=old, live_ranks=live)
    dead = _dead_slots(32, 8, live)
    assert np.array_equal(masked.phy2log[:, dead], old[:, dead])
    assert orphaned_experts(masked.phy2log, 16, 8, live) == []
    again = rebalance_experts(load, 32, 4, 2, 8, policy=policy, old_phy2log=old, live_ranks=live)
    assert np.array_equal(again.phy2log, masked.phy2log)
    assert moved_experts(old, masked.phy2log, 8) > 0


@pytest.mark.parametrize("bad", [[True, False], [0, 0], [0, 9], [0.5, 1.0], "01", [False] * 4, []])
def test_bad_live_rank_masks_are_input_errors(bad):
    with pytest.raises(InputError):
        check_live_ranks(bad, 4)


def test_move_aware_cap_counts_the_orphans_re_placement():
    """``moved_experts(old, plan) <= max_moved_experts`` holds with ranks excluded too: the moves that give the
    excluded ranks' experts a live slot are charged to the cap, and a cap below them is refused (QA: 6 ranks of 8
    live, cap 5, moved 11)."""
    rng = np.random.default_rng(1)
    old = rebalance_experts(rng.integers(0, 1000, (4, 16)), 32, 4, 2, 8, policy="deepseek").phy2log
    load = rng.integers(0, 1000, (4, 16))
    live = [0, 1, 2, 3, 4, 5]
    lost = moved_experts(old, replace_orphans(old, 16, 8, check_live_ranks(live, 8), load), 8)
    assert lost > 0
    for cap in (lost, lost + 5, 10**6):
        plan = rebalance_experts(load, 32, 4, 2, 8, policy="move_aware", old_phy2log=old, live_ranks=live,
                                 max_moved_experts=cap)
        assert moved_experts(old, plan, 8) <= cap
    with pytest.raises(InputError, match=f"max_moved_experts={lost - 1} cannot be met"):
        rebalance_experts(load, 32, 4, 2, 8, policy="move_aware", old_phy2log=old, live_ranks=live,
                          max_moved_experts=lost - 1)
    # hierarchical: the re-placement spread a group over nodes; the refusal names the whole cap and its use
    with pytest.raises(InputError, match=r"max_moved_experts=14: 13 of it give the experts of the ranks not live"):
        rebalance_experts(load, 32, 4, 2, 8, policy="move_aware", old_phy2log=old, live_ranks=[0, 2, 4, 6],
                          max_moved_experts=14)
