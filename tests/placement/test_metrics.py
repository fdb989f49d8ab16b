"""Placement metrics and load readers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdeplb.errors import InputError, LoadFileError
from fdeplb.placement import (
    balancedness,
    gpu_loads,
    imbalance,
    initial_placement,
    load_digest,
    moved_bytes,
    moved_experts,
    read_expert_load,
    rebalance_experts,
)


# ---- metrics ------------------------------------------------------------------------------------------------------
def test_gpu_loads_split_replicas_evenly():
    load = np.array([[8.0, 2.0, 6.0, 4.0]])
    phy2log = np.array([[0, 1, 0, 2, 3, 2]])  # experts 0 and 2 have two replicas
    assert gpu_loads(load, phy2log, 3).tolist() == [[4.0 + 2.0, 4.0 + 3.0, 3.0 + 4.0]]
    assert gpu_loads(load, phy2log, 1).tolist() == [[20.0]]
    np.testing.assert_allclose(balancedness(load, phy2log, 3), [(20 / 3) / 7])
    np.testing.assert_allclose(imbalance(load, phy2log, 3), [(7 - 20 / 3) / (20 / 3)])


def test_metrics_accept_placements_and_define_zero_layers():
    load = np.array([[0, 0, 0, 0], [1, 1, 1, 1]])
    pl = initial_placement(2, 4, 4, num_gpus=2)
    assert balancedness(load, pl, 2).tolist() == [1.0, 1.0]
    assert imbalance(load, pl, 2).tolist() == [0.0, 0.0]
    b = balancedness(np.array([[4, 0, 0, 0]]), initial_placement(1, 4, 4).phy2log, 2)
    assert b.tolist() == [0.5] and (b > 0).all()


def test_balancedness_over_members_ignores_the_other_ranks_slots():
    # 3 ranks of 2 slots; rank 2 is excluded: its replicas of experts 0 and 1 serve nothing
    load = np.array([[30, 10, 20, 20]])
    phy2log = np.array([[0, 1, 2, 3, 0, 1]])
    # every rank: 0 and 1 split over two ranks, rank 2 counted -> [20, 40, 20]: 26.67 / 40
    np.testing.assert_allclose(balancedness(load, phy2log, 3), [(80 / 3) / 40])
    # over members 0 and 1 (the engine routes with live_maps): 0 and 1 have one live replica each -> [40, 40]
    assert gpu_loads(load, phy2log, 3, [0, 1]).tolist() == [[40.0, 40.0, 0.0]]
    assert balancedness(load, phy2log, 3, [0, 1]).tolist() == [1.0]
    assert imbalance(load, phy2log, 3, np.array([True, True, False])).tolist() == [0.0]
    # an expert with no replica on a member reaches no GPU: members 1 and 2 hold 2, 3, 0, 1 (all)...
    assert gpu_loads(load, phy2log, 3, [1, 2]).tolist() == [[0.0, 40.0, 40.0]]
    # ...members 0 and 2 miss experts 2 and 3, whose load is counted on no GPU
    assert gpu_loads(load, phy2log, 3, [0, 2]).tolist() == [[20.0, 0.0, 20.0]]
    # every rank a member (mask, list or set): exactly today's figure, bit for bit
    rng = np.random.default_rng(3)
    big_load, big = rng.integers(0, 1000, (5, 16)), rebalance_experts(rng.integers(1, 1000, (5, 16)), 24, 1, 1, 4)
    for every in (None, [0, 1, 2, 3], {0, 1, 2, 3}, np.ones(4, dtype=bool)):
        assert balancedness(big_load, big, 4, every).tobytes() == balancedness(big_load, big, 4).tobytes()
        assert imbalance(big_load, big, 4, every).tobytes() == imbalance(big_load, big, 4).tobytes()
    with pytest.raises(InputError, match="no rank is live"):
        balancedness(load, phy2log, 3, np.zeros(3, dtype=bool))
    with pytest.raises(InputError, match="outside"):
        balancedness(load, phy2log, 3, [0, 3])


def test_moved_experts_is_a_multiset_difference_per_gpu():
    old = np.array([[0, 1, 2, 3, 0, 1]])
    assert moved_experts(old, old, 2) == 0
    assert moved_experts(old, np.array([[1, 0, 2, 3, 1, 0]]), 2) == 0  # reordering inside a GPU costs nothing
    assert moved_experts(old, np.array([[0, 0, 1, 3, 2, 1]]), 2) == 2  # GPU0 gains a 2nd copy of 0, GPU1 gains 2
    assert moved_experts(old, np.array([[3, 2, 1, 0, 1, 2]]), 2) == 2  # GPU0 gains 3, GPU1 gains 2
    assert moved_experts(old, np.array([[3, 2, 1, 0, 1, 2]]), 6) == 6
    assert moved_experts(np.vstack([old, old]), np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 1, 2]]), 2,
                         per_layer=True).tolist() == [0, 2]
    assert moved_bytes(old, np.array([[3, 2, 1, 0, 1, 2]]), 2, expert_nbytes=1000) == 2000


def test_metric_errors():
    with pytest.raises(InputError):
        gpu_loads(np.ones((2, 4)), np.zeros((1, 4), dtype=np.int64), 2)
    with pytest.raises(InputError):
        gpu_loads(np.ones((1, 4)), np.array([[0, 1, 2, 3]]), 3)
    with pytest.raises(InputError):
        moved_experts(np.zeros((1, 4), dtype=int), np.zeros((1, 6), dtype=int), 2)
    with pytest.raises(InputError):
        moved_experts(np.zeros((1, 4), dtype=int), np.zeros((1, 4), dtype=int), 3)
    with pytest.raises(InputError):
        moved_bytes(np.zeros((1, 4), dtype=int), np.zeros((1, 4), dtype=int), 2, expert_nbytes=-1)


@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json")
def test_deepseek_beats_initial_placement_on_real_dumps(real_data):
    dump = read_expert_load(real_data / "dsv3_sglang_ep_stats" / "prefill_in1024.json")
    load = dump.expert_load
    before = balancedness(load, initial_placement(dump.num_layers, 256, 288), 32)
    after = balancedness(load, rebalance_experts(load, 288, 8, 4, 32), 32)
    assert after.mean() > before.mean()
    assert ((0 < after) & (after <= 1)).all()


# ---- load readers -------------------------------------------------------------------------------------------------
@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json")
def test_read_sglang_dump_drops_dense_layers(real_data):
    dump = read_expert_load(real_data / "dsv3_sglang_ep_stats" / "prefill_in1024.json")
    assert dump.expert_load.shape == (58, 256) and dump.format == "sglang"
    assert dump.layer_ids.tolist() == list(range(3, 61))
    assert (dump.expert_load.sum(axis=1) == 67_108_864).all()
    assert dump.digest == load_digest(dump.expert_load) and len(dump.digest) == 64


@pytest.mark.real_data("qwen3_30b_oeplb/counts30b.json")
def test_read_counts_dumps(real_data):
    shapes = {"counts57b": (28, 64), "counts57b_share": (28, 64), "counts235b": (94, 128), "counts30b": (48, 128)}
    for path in real_data.glob("qwen*/*.json"):
        dump = read_expert_load(path)
        assert dump.expert_load.shape == shapes[path.stem] and dump.format == "counts"
        assert dump.layer_ids.tolist() == list(range(dump.num_layers))
    assert read_expert_load(real_data / "qwen3_30b_oeplb" / "counts30b.json").expert_load.dtype == np.int64


def test_read_per_rank_stack_is_summed(tmp_path):
    f = tmp_path / "stack.json"
    f.write_text(json.dumps({"logical_count": [[[0, 0], [1, 2]], [[0, 0], [3, 4]]]}))
    dump = read_expert_load(f)
    assert dump.expert_load.tolist() == [[4, 6]] and dump.layer_ids.tolist() == [1]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"weights": [[1]]}', "no 'logical_count' or 'counts'"),
        ('{"counts": []}', "non-empty"),
        ('{"counts": [[1, 2], [3]]}', "ragged"),
        ('{"counts": [[1, "a"]]}', "numbers"),
        ('{"counts": [[1, true]]}', "booleans"),
        ('{"counts": [[1, NaN]]}', "NaN"),
        ('{"counts": [[1, -2]]}', "negative"),
        ('{"logical_count": [[0, 0], [0, 0]]}', "every row"),
        ('{"counts": [1, 2, 3]}', "2-D"),
    ],
)
def test_bad_load_files_raise_load_file_error(tmp_path, content, message):
    f = tmp_path / "load.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(LoadFileError, match=message) as info:
        read_expert_load(f)
    assert str(f) in str(info.value)
