"""``fdeplb rebalance``'s input checks: an image path that is no image, an option the policy ignores, and loads
too small to balance (1e-300: DeepSeek's float32 arithmetic flushes them to zero), each refused or judged before any
work is wasted or any expert moves for no gain."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdeplb.placement import initial_placement, moved_experts, rebalance_experts
from fdeplb.placement.rebalance import NO_LOAD
from tests.helpers import run_cli


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"counts": [[1e-300 * (1 + e % 3) for e in range(16)] for _ in range(4)]}))
    return path


def rebalance(capsys, load, *extra):
    return run_cli(capsys, "rebalance", "--load", str(load), "--num-replicas", "20", "--num-gpus", "4", *extra)


def test_plot_into_a_text_file_is_refused_before_planning(capsys, tiny, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = rebalance(capsys, tiny, "--plot", str(tmp_path / "x.txt"))
    assert code == 2 and out == "" and err.startswith(f"error: --plot {tmp_path / 'x.txt'}: .txt is not an image")
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("flag", [("--tolerance", "0.01"), ("--max-moved-experts", "3")])
def test_an_option_the_policy_ignores_is_refused(capsys, tiny, flag):
    code, out, err = rebalance(capsys, tiny, "--policy", "deepseek", *flag)
    assert code == 2 and out == "" and f"{flag[0]} applies to the move_aware" in err
    code, _, err = rebalance(capsys, tiny, "--policy", "move_aware", *flag)
    assert code == 0, err


def test_topology_aware_takes_a_tolerance_and_reports_the_cross_node_fraction(capsys, tmp_path):
    """A per-source-rank dump (SGLang's per-rank stack, as `fdeplb load --export` writes): the source ranks of
    node n route most tokens to experts n*8..n*8+7; topology_aware at slack 0.002 keeps more of them on their
    node than balanced's plan of the same load, and both print the fraction before -> after."""
    rng = np.random.default_rng(0)
    stack = rng.integers(1, 50, (4, 2, 16))
    for r in range(4):
        stack[r, :, (r // 2) * 8:(r // 2 + 1) * 8] *= 6
    path = tmp_path / "per_rank.json"
    path.write_text(json.dumps({"logical_count": stack.tolist()}))
    after = {}
    for policy, extra in (("balanced", ()), ("topology_aware", ("--tolerance", "0.002"))):
        code, out, err = rebalance(capsys, path, "--num-nodes", "2", "--policy", policy, *extra)
        line = next((x for x in out.splitlines() if x.startswith("cross-node fraction")), "")
        assert code == 0 and line.endswith("(load per source rank, 2 nodes)"), out + err
        after[policy] = float(line.split()[4])
    assert after["topology_aware"] < after["balanced"]
    code, out, _ = rebalance(capsys, path, "--num-nodes", "1")  # one node: no token leaves it, nothing printed
    assert code == 0 and "cross-node fraction" not in out


@pytest.mark.parametrize("policy", ["balanced", "topology_aware"])
def test_a_per_rank_stack_with_a_negative_count_is_refused_before_planning(capsys, tmp_path, policy):
    """Its sum is positive, so the dump's reader takes it; the stack is checked as it is read, naming the rank."""
    stack = np.full((4, 2, 16), 10)
    stack[1, 1, 3] = -5
    path = tmp_path / "neg.json"
    path.write_text(json.dumps({"logical_count": stack.tolist()}))
    code, out, err = rebalance(capsys, path, "--num-nodes", "2", "--policy", policy, "--out", str(tmp_path / "p.json"))
    assert code == 2 and out == "" and not (tmp_path / "p.json").exists(), out + err
    assert f"error: {path}: logical_count has a negative value -5 at [rank 1, layer 1, expert 3]" in err, err


def test_a_stack_of_another_rank_count_is_named_when_topology_aware_plans_on_its_sum(capsys, tmp_path):
    path = tmp_path / "three.json"
    path.write_text(json.dumps({"logical_count": np.full((3, 2, 16), 10).tolist()}))
    code, out, err = rebalance(capsys, path, "--num-nodes", "2", "--policy", "topology_aware")
    assert code == 0 and "stacks the load of 3 source ranks, not --num-gpus 4: planned on their sum" in err, err


def test_deepseeks_plan_of_loads_too_small_for_float32_is_gated_as_no_gain(capsys, tiny):
    code, out, err = rebalance(capsys, tiny)
    assert code == 0, err
    gate = out.splitlines()[-1]
    assert gate.startswith("gate: skipped: planned gain ") and gate.endswith(
        "<= min_gain 0.0 (a cluster would not run this plan)"), out


@pytest.mark.parametrize("policy", ["balanced", "move_aware"])
@pytest.mark.parametrize("value", [0.0, 1e-300, NO_LOAD / 2])
def test_a_layer_without_load_keeps_its_placement(policy, value):
    load = np.ones((3, 16))
    load[1] = value  # one layer without load between two loaded ones
    old = initial_placement(3, 16, 20).phy2log
    new = rebalance_experts(load, 20, 1, 1, 4, policy=policy, old_phy2log=old).phy2log
    assert np.array_equal(new[1], old[1]) and moved_experts(old[1:2], new[1:2], 4) == 0
    assert moved_experts(old, new, 4) > 0  # the loaded layers are still balanced


def test_a_zero_row_between_moe_rows_is_named_not_silently_dropped(capsys, tmp_path):
    from fdeplb.placement import read_expert_load

    path = tmp_path / "dump.json"
    rows = [[0] * 16, [5] * 16, [0] * 16, [3] * 16, [0] * 16]  # leading dense, MoE, zero inside, MoE, trailing
    path.write_text(json.dumps({"logical_count": rows}))
    dump = read_expert_load(path)
    assert dump.layer_ids.tolist() == [1, 3] and dump.dense_layer_ids == [0, 2, 4]
    assert dump.interleaved_dense == [2]  # leading and trailing zero rows are plain dense layers
    code, _, err = rebalance(capsys, path)
    assert code == 0 and f"note: {path}: rows [2] are all zero between MoE rows" in err
    path.write_text(json.dumps({"logical_count": rows[:2] + rows[3:]}))
    code, _, err = rebalance(capsys, path)
    assert code == 0 and "note:" not in err


def _one_layer_plan(capsys, tmp_path, split, old_row, policy):
    """``rebalance`` of a one-layer per-rank stack ``split`` ([source rank][expert], 4 ranks, 8 experts) from the
    placement ``old_row`` (12 slots) on 4 GPUs in 2 nodes: (exit code, stdout)."""
    from fdeplb.placement import Placement, write_placement

    path = tmp_path / "stack.json"
    path.write_text(json.dumps({"logical_count": [[row] for row in split]}))
    old = write_placement(Placement.from_phy2log(np.array([old_row]), 8, num_gpus=4), tmp_path / "old.json",
                          format="fdeplb")
    code, out, err = run_cli(capsys, "rebalance", "--load", str(path), "--old", str(old), "--num-replicas", "12",
                             "--num-gpus", "4", "--num-nodes", "2", "--policy", policy)
    assert code == 0, out + err
    return out


def test_the_offline_gate_lets_a_plan_through_for_locality_only_under_a_policy_planning_from_the_split(capsys,
                                                                                                   tmp_path):
    """QA: a per-rank stack made ``rebalance`` judge every policy's plan by the locality rule, so a 'balanced' plan
    of no gain that happens to lower the cross-node fraction read 'goes on'; a balanced cluster's round plans on
    the sum and skips it. The fraction is still printed, and a rise reads 'higher by', never 'lower by -0.0717'."""
    out = _one_layer_plan(capsys, tmp_path, [[26, 49, 33, 42, 32, 27, 39, 24], [42, 36, 34, 9, 18, 12, 34, 21],
                                             [41, 24, 33, 35, 15, 23, 42, 31], [8, 29, 24, 35, 25, 33, 5, 21]],
                          [5, 2, 4, 6, 0, 0, 1, 3, 4, 1, 7, 2], "balanced")
    assert "cross-node fraction 0.4878 -> 0.4767" in out, out
    assert out.splitlines()[-1].startswith("gate: skipped: planned gain 0.0000 <= min_gain 0.0"), out
    # a topology_aware plan that goes on for its gain while more tokens cross nodes (from a placement made for
    # another split)
    out = _one_layer_plan(capsys, tmp_path, [[36, 47, 44, 25, 47, 48, 48, 4], [22, 30, 14, 18, 31, 40, 29, 8],
                                             [33, 43, 10, 27, 16, 45, 3, 23], [44, 21, 6, 39, 48, 49, 46, 18]],
                          [2, 0, 7, 4, 1, 5, 3, 3, 0, 1, 6, 7], "topology_aware")
    assert "cross-node fraction 0.4766 -> 0.5483" in out, out
    gate = out.splitlines()[-1]
    assert gate.startswith("gate: goes on: gain +") and ", cross-node fraction higher by 0.0717 with" in gate, out


def test_a_move_cap_the_trivial_start_cannot_meet_names_the_missing_old_placement(capsys, tmp_path):
    # QA: without --old the error spoke of "old_phy2log" spreading groups, a placement the user never gave
    path = tmp_path / "grouped.json"
    path.write_text(json.dumps({"counts": np.random.default_rng(1).integers(1, 100, (2, 16)).tolist()}))
    base = ("rebalance", "--load", str(path), "--num-replicas", "20", "--num-gpus", "4", "--num-groups", "4",
            "--num-nodes", "2", "--policy", "move_aware", "--max-moved-experts", "1")
    code, out, err = run_cli(capsys, *base)
    assert code == 2 and out == ""
    assert "spreads expert groups over nodes" in err and "without --old the old placement is the trivial one" in err
    old = tmp_path / "old.json"
    assert run_cli(capsys, "rebalance", *base[1:11], "--policy", "balanced", "--out", str(old))[0] == 0
    code, _, err = run_cli(capsys, *base, "--old", str(old))
    assert code == 0, err


# ---- --old against --load: rows matched by model layer, never by position (QA) -----------------------------------
def _dense_and_moe(tmp_path):
    """A 5-layer model whose first 2 layers are dense: SGLang's 5-row placement (dense rows trivial) whose MoE rows
    differ, and the load of its 3 MoE layers (one row skewed so that each placement balances it differently)."""
    from fdeplb.placement import Placement, write_placement

    rng = np.random.default_rng(3)
    rows = np.stack([rng.permutation(np.arange(20) % 16) for _ in range(5)])
    old = write_placement(Placement.from_phy2log(rows, 16, num_gpus=4), tmp_path / "old_sg.json", format="sglang")
    load = rng.integers(1, 40, (3, 16)) * np.arange(1, 17)
    return old, rows, load


def _before(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("before (--old)")).split()[2]


def test_a_load_without_model_layers_and_a_placement_with_more_rows_are_refused_not_shifted(capsys, tmp_path):
    """QA: a 58-row `load --export` against SGLang's 61-row placement took the placement's rows 0-57 (every MoE
    layer shifted by the dense ones) and printed a wrong 'before'. Now refused naming both row counts; the load
    with the model's rows (dense rows zero) is matched by layer: 'before' is that of placement rows 2-4."""
    from fdeplb.placement import balancedness

    old, rows, load = _dense_and_moe(tmp_path)
    moe_only = tmp_path / "moe.json"
    moe_only.write_text(json.dumps({"logical_count": load.tolist()}))
    code, out, err = rebalance(capsys, moe_only, "--old", str(old))
    assert code == 2 and out == "", out + err
    assert "has 5 layer rows (model layers 0-4)" in err and "has 3 rows, 3 with load" in err
    assert "cannot be matched layer by layer" in err and "--layer-ids" in err
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"logical_count": [[0] * 16] * 2 + load.tolist()}))
    code, out, err = rebalance(capsys, model, "--old", str(old))
    assert code == 0, out + err
    assert _before(out) == f"{balancedness(load, rows[2:], 4).mean():.4f}"
    assert _before(out) != f"{balancedness(load, rows[:3], 4).mean():.4f}"  # the shifted rows read otherwise


def test_a_load_naming_layers_the_placement_lacks_is_refused_with_both_row_counts(capsys, tmp_path):
    from fdeplb.placement import Placement, write_placement

    _, rows, load = _dense_and_moe(tmp_path)
    old = write_placement(Placement.from_phy2log(rows[:3], 16, num_gpus=4), tmp_path / "three.json",
                          format="sglang")
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"logical_count": [[0] * 16] * 2 + load.tolist()}))
    code, _, err = rebalance(capsys, model, "--old", str(old))
    assert code == 2 and "has 3 layer rows (model layers 0-2)" in err and "has 5 rows, 3 with load" in err, err
    assert "no --old row for model layers [3, 4]" in err


# ---- the gate line: the cluster's threshold (QA) ------------------------------------------------------------------
def test_the_gate_line_judges_with_min_gain_default_the_clusters(capsys, tmp_path):
    """QA: the threshold was a hard-coded 0.0. --min-gain defaults to a new cluster's min_gain (one source) and a
    cluster's own threshold changes the verdict; the header counts nodes and groups in words."""
    import dataclasses

    from fdeplb.cli import build_parser
    from fdeplb.store import ClusterConfig

    default = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}["min_gain"]
    args = build_parser().parse_args(["rebalance", "--load", "x", "--num-replicas", "20", "--num-gpus", "4"])
    assert args.min_gain == default
    path = tmp_path / "skewed.json"
    path.write_text(json.dumps({"counts": [[100 * (e + 1) ** 2 for e in range(16)]] * 2}))
    code, out, _ = rebalance(capsys, path, "--policy", "balanced")
    gain = float(out.splitlines()[-1].split("gain ")[1].split()[0])
    assert code == 0 and out.splitlines()[-1].startswith("gate: goes on") and gain > 0.1, out
    assert "(1 node, 1 group)" in out.splitlines()[0]
    code, out, _ = rebalance(capsys, path, "--policy", "balanced", "--min-gain", f"{gain + 0.01:.4f}")
    assert code == 0 and out.splitlines()[-1].startswith(
        f"gate: skipped: planned gain {gain:.4f} <= min_gain {gain + 0.01:.4f}"), out
    code, out, err = rebalance(capsys, path, "--min-gain", "1.5")
    assert code == 2 and out == "" and "min_gain must be a finite number in [0, 1]" in err


def test_an_old_placement_cut_short_is_refused_by_its_shape(capsys, tmp_path):
    # QA: a --old cut to 288 of 320 slots was refused as "logical expert 41 has no slot in layer 0"
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"counts": np.random.default_rng(2).integers(1, 100, (2, 16)).tolist()}))
    base = ("rebalance", "--load", str(path), "--num-replicas", "20", "--num-gpus", "4")
    out = ("--policy", "balanced", "--format", "sglang", "--out", str(tmp_path / "p.json"))  # no header to check
    assert run_cli(capsys, *base, *out)[0] == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    key = next(k for k, v in doc.items() if isinstance(v, list))
    doc[key] = [row[:16] for row in doc[key]]
    (tmp_path / "cut.json").write_text(json.dumps(doc))
    code, out, err = run_cli(capsys, *base, "--old", str(tmp_path / "cut.json"))
    assert code == 2 and out == "" and "rows of 16 slots" in err and "20 slots per layer" in err
