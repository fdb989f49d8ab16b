"""policy="deepseek" against DeepSeek's own eplb.py: phy2log, log2phy and logcnt, element for element.

tests/placement/golden/deepseek_eplb.npz holds what ``eplb.rebalance_experts`` returned under torch 2.13 CPU (made by
golden/make_deepseek_golden.py beside it, which says how): the 16 real dumps at four topologies (loads read from
../shared/real_data, skipped without it), the two small hand-made cases and 300 random cases with many ties.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from fdeplb.placement import Placement, read_expert_load, rebalance_experts
from fdeplb.placement.deepseek import balanced_packing, torch_sort_desc
from fdeplb.placement.reference import _std_sort_desc, deepseek_reference

GOLDEN = Path(__file__).parent / "golden" / "deepseek_eplb.npz"


def _golden():
    with np.load(GOLDEN) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


META, ARRAYS = _golden()
CASES = META["cases"]


def _check(case: dict, load: np.ndarray) -> Placement:
    i = case["id"]
    topo = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    pl = rebalance_experts(load, *topo, policy="deepseek")
    for name in ("phy2log", "log2phy", "logcnt"):
        want = ARRAYS[f"{i}.{name}"].astype(np.int64)
        got = getattr(pl, name)
        assert got.shape == want.shape and np.array_equal(got, want), f"case {i} ({case}): {name} differs"
    return pl


def test_golden_set_is_complete():
    kinds = [c["kind"] for c in CASES]
    assert (kinds.count("real"), kinds.count("small"), kinds.count("random")) == (64, 2, 300)
    long_rows = [c for c in CASES if c["kind"] == "random"
                 and c["num_replicas"] // (c["num_nodes"] if c["num_groups"] % c["num_nodes"] == 0 else 1) > 16]
    assert len(long_rows) >= 150  # most random cases pack rows longer than 16, where torch's sort is not stable


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "small"], ids=lambda c: f"small{c['id']}")
def test_issue_small_cases_match_eplb(case):
    _check(case, ARRAYS[f"{case['id']}.load"])


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "random"], ids=lambda c: f"random{c['id']}")
def test_random_tie_cases_match_eplb(case):
    _check(case, ARRAYS[f"{case['id']}.load"])


@functools.lru_cache(maxsize=None)
def _real_load(path: Path) -> np.ndarray:
    """A real dump's expert_load, read once for its four topologies."""
    return read_expert_load(path).expert_load


@pytest.mark.parametrize("case", [
    pytest.param(c, id=f"real{c['id']}-{Path(c['dump']).stem}", marks=pytest.mark.real_data(c["dump"]))
    for c in CASES if c["kind"] == "real"])
def test_real_dumps_match_eplb(real_data, case):
    load = _real_load(real_data / case["dump"])
    pl = _check(case, load)
    # the plain-loop port (independent std::sort port) agrees on the real dumps too
    topo = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    if case["dump"].startswith("qwen2"):  # smallest model: keeps the pure-Python loop quick
        assert np.array_equal(deepseek_reference(load, *topo), pl.phy2log)


def test_random_cases_match_the_plain_loop_port():
    for case in CASES[::10]:
        if case["kind"] != "real":
            load = ARRAYS[f"{case['id']}.load"]
            topo = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
            want = ARRAYS[f"{case['id']}.phy2log"].astype(np.int64)
            assert np.array_equal(deepseek_reference(load, *topo), want), case


# ---- the sort emulation on its own ----------------------------------------------------------------------------------
def _reference_order(keys: np.ndarray) -> np.ndarray:
    return np.array([_std_sort_desc([np.float32(v) for v in row]) for row in keys], dtype=np.int64).reshape(keys.shape)


@pytest.mark.parametrize("n", [1, 2, 16, 17, 18, 31, 32, 33, 72, 100, 288])
def test_torch_sort_desc_matches_the_scalar_std_sort_port(n):
    rng = np.random.default_rng(n)
    for hi in (1, 2, 3, 7, 1000):
        keys = rng.integers(0, hi, size=(6, n)).astype(np.float32)
        keys[1] = np.sort(keys[1])  # presorted rows (ascending and descending) exercise other partition paths
        keys[2] = np.sort(keys[2])[::-1]
        assert np.array_equal(torch_sort_desc(keys), _reference_order(keys))


def test_torch_sort_desc_is_a_descending_sort_stable_up_to_16():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 4, size=(20, 40)).astype(np.float32)
    order = torch_sort_desc(keys)
    assert (np.diff(np.take_along_axis(keys, order, axis=1), axis=1) <= 0).all()
    assert (np.sort(order, axis=1) == np.arange(40)).all()
    short = keys[:, :16]
    assert np.array_equal(torch_sort_desc(short), np.argsort(-short, axis=1, kind="stable"))
    # ties in a row longer than 16 do not come out in index order (what made the old stable sort differ)
    assert not np.array_equal(order, np.argsort(-keys, axis=1, kind="stable"))


def test_balanced_packing_tie_order_is_checked():
    from fdeplb.errors import InputError

    with pytest.raises(InputError, match="tie_order"):
        balanced_packing(np.ones((1, 4), dtype=np.float32), 2, tie_order="python")


def test_replica_rank_is_checked_and_kept_through_files(tmp_path):
    from fdeplb.errors import InputError
    from fdeplb.placement import read_placement, write_placement
    from fdeplb.placement.core import replica_rank

    case = [c for c in CASES if c["kind"] == "small"][1]  # two layers
    pl = _check(case, ARRAYS[f"{case['id']}.load"])
    rank = replica_rank(pl.log2phy, pl.num_physical_experts)
    again = Placement.from_phy2log(pl.phy2log, pl.num_logical_experts, replica_rank=rank)
    assert np.array_equal(again.log2phy, pl.log2phy)
    bad = rank.copy()
    bad[0, 0] = pl.logcnt[0, pl.phy2log[0, 0]]  # a rank past the expert's count
    with pytest.raises(InputError, match="replica_rank"):
        Placement.from_phy2log(pl.phy2log, pl.num_logical_experts, replica_rank=bad)
    twice = np.zeros_like(rank)  # every replica rank 0: duplicates for experts with several slots
    with pytest.raises(InputError, match="each rank once"):
        Placement.from_phy2log(pl.phy2log, pl.num_logical_experts, replica_rank=twice)
    path = write_placement(pl, tmp_path / "p.json")
    back = read_placement(path)
    assert np.array_equal(back.placement.log2phy, pl.log2phy)
    assert np.array_equal(back.for_layers([1]).log2phy, pl.log2phy[1:, :, : int(pl.logcnt[1].max())])
