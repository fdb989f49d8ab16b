"""Transfer plans (pure numpy): classification, read-once, copy ordering, routing tables."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.errors import InputError, TopologyError
from fdeplb.weights.plan import DISK, KEEP, LOCAL, plan_transfer, routing_tables


def apply_steps(plan, old_rank: np.ndarray) -> np.ndarray:
    """Run the plan's steps on a model of the rank's slots (one logical id per slot), as the swap does."""
    slots = old_rank.copy()
    snapshots = {}
    for step in plan.steps:
        row = slots[step.layer]
        if step.kind == "snapshot":
            snapshots[(step.layer, step.slot)] = row[step.slot]
        elif step.kind == "local":
            row[step.slot] = row[step.source]
        elif step.kind == "from_snapshot":
            row[step.slot] = snapshots[(step.layer, step.source)]
        else:
            assert step.kind == "disk"
            layer, expert = plan.disk[step.source]
            assert layer == step.layer
            row[step.slot] = expert
    return slots


def test_keep_local_disk_on_hand_made_layer():
    # rank 0 of 2 owns slots 0..3; rank 1 owns 4..7
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = np.array([[0, 2, 9, 1, 4, 5, 6, 7]])
    plan = plan_transfer(old, new, 0, 2)
    assert plan.action.tolist() == [[KEEP, LOCAL, DISK, LOCAL]]
    assert plan.disk == ((0, 9),)
    assert plan.counts == {"keep": 1, "local": 2, "disk": 1}
    assert plan.nbytes(100) == {"keep": 100, "local": 200, "disk": 100}
    other = plan_transfer(old, new, 1, 2)
    assert other.counts == {"keep": 4, "local": 0, "disk": 0} and other.steps == ()


def test_expert_new_to_rank_in_two_slots_is_read_once():
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = np.array([[7, 7, 2, 3], [0, 1, 5, 5]])
    plan = plan_transfer(old, new, 0, 1)
    assert plan.disk == ((0, 7), (1, 5))
    assert plan.counts["disk"] == 2 and plan.disk_slots == 4
    assert (apply_steps(plan, plan.old) == new).all()


def test_duplicate_of_an_expert_already_on_the_rank_is_a_local_copy():
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[0, 1, 2, 0]])
    plan = plan_transfer(old, new, 0, 1)
    assert plan.action.tolist() == [[KEEP, KEEP, KEEP, LOCAL]]
    assert plan.steps[0].kind == "local" and plan.steps[0].source == 0
    assert plan.num_snapshots == 0


def test_local_copy_prefers_a_kept_source():
    # expert 0 sits in slots 0 and 2; slot 0 is overwritten, slot 2 kept: copy from 2, no snapshot needed
    old = np.array([[0, 1, 0, 3]])
    new = np.array([[1, 0, 0, 0]])
    plan = plan_transfer(old, new, 0, 1)
    sources = {s.slot: s.source for s in plan.steps if s.kind == "local"}
    assert sources[1] == 2 and sources[3] == 2
    assert plan.num_snapshots == 0
    assert (apply_steps(plan, plan.old) == new).all()


def test_exchanging_two_slots_reads_before_writing():
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[1, 0, 2, 3]])
    plan = plan_transfer(old, new, 0, 1)
    assert plan.counts == {"keep": 2, "local": 2, "disk": 0}
    assert plan.num_snapshots == 1  # a 2-cycle needs one expert of scratch
    assert (apply_steps(plan, plan.old) == new).all()


def test_source_overwritten_from_disk_is_read_first():
    # slot 0's expert 0 moves to slot 1 while slot 0 is loaded from disk: the copy must run before the disk write
    old = np.array([[0, 1]])
    new = np.array([[9, 0]])
    plan = plan_transfer(old, new, 0, 1)
    assert [s.kind for s in plan.steps] == ["local", "disk"]
    assert plan.num_snapshots == 0
    assert (apply_steps(plan, plan.old) == new).all()


def test_cycle_reuses_an_already_written_copy_instead_of_a_snapshot():
    old = np.array([[0, 1, 2, -1]])
    new = np.array([[2, 0, 1, 0]])
    plan = plan_transfer(old, new, 0, 1)
    assert plan.num_snapshots == 0 and plan.counts == {"keep": 0, "local": 4, "disk": 0}
    assert (apply_steps(plan, plan.old) == new).all()


def test_empty_old_slots_load_everything_once():
    new = np.array([[3, 3, 1, 2], [0, 1, 2, 3]])
    plan = plan_transfer(np.full_like(new, -1), new, 0, 1)
    assert plan.counts == {"keep": 0, "local": 0, "disk": 7}
    assert plan.disk_slots == 8


@pytest.mark.parametrize("seed", range(25))
def test_random_placements_end_in_the_new_placement(seed):
    rng = np.random.default_rng(seed)
    num_layers, num_experts, ep_size, per_rank = 3, 8, 2, 6
    num_phy = ep_size * per_rank
    old = rng.integers(0, num_experts, size=(num_layers, num_phy))
    new = rng.integers(0, num_experts, size=(num_layers, num_phy))
    new[0] = np.roll(old[0], 1)  # at least one layer full of cycles and chains
    for rank in range(ep_size):
        plan = plan_transfer(old, new, rank, ep_size)
        assert (apply_steps(plan, plan.old) == plan.new).all()
        counts = plan.counts
        assert counts["keep"] + counts["local"] + plan.disk_slots == num_layers * per_rank
        for layer, expert in plan.disk:  # read only what the rank does not have, each once
            assert expert not in plan.old[layer]
        assert len(set(plan.disk)) == len(plan.disk)
        assert plan.key == plan_transfer(old, new, rank, ep_size).key


def test_plan_input_errors():
    good = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(InputError):
        plan_transfer(good, np.zeros((2, 6), dtype=np.int64), 0, 2)
    with pytest.raises(InputError):
        plan_transfer(good, good - 1, 0, 2)
    with pytest.raises(InputError):
        plan_transfer(good.astype(float), good, 0, 2)
    with pytest.raises(TopologyError):
        plan_transfer(good, good, 0, 3)
    with pytest.raises(TopologyError):
        plan_transfer(good, good, 2, 2)


def test_routing_tables():
    phy2log = np.array([[0, 1, 2, 0, 1, 0]])
    log2phy, logcnt = routing_tables(phy2log, 3, 4)
    assert logcnt.tolist() == [[3, 2, 1]]
    assert log2phy.tolist() == [[[0, 3, 5, -1], [1, 4, -1, -1], [2, -1, -1, -1]]]
    with pytest.raises(InputError, match="no replica"):
        routing_tables(np.array([[0, 0, 2]]), 3, 3)
    with pytest.raises(InputError, match="max_replicas"):
        routing_tables(phy2log, 3, 2)
