"""The drift pairs of ``benchmarks/placement.py`` (issue 33 items 2 and 5): what they are, what is measured on them,
their targets and their Markdown tables.

A drift pair: old placement = "balanced" on load A at the pair's topology, new loads B. On every pair: each policy's
moved experts (:func:`fdeplb.placement.moved_experts`) and mean max/mean on B, every policy given the old placement;
a lower bound on any plan's moves (:mod:`fdeplb.placement.move_bound`, where it solves; at several nodes on any
plan that keeps every group on one node); move_aware's time over
"balanced"'s (interleaved runs, medians). Issue 33's targets per pair: moved share (move_aware's moves / fresh
balanced's) <= 0.10, slack (mean max/mean of move_aware - fresh balanced's) <= 0.0005, time ratio <= 1.2. Also the
1- and 4-node speed table and the move budget (Pareto) table. Pairs, seeds and synthetic loads are those of issue 33's
shared harness, so figures agree. Imported by ``placement.py`` (run as a script: this folder is on ``sys.path``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from fdeplb.errors import FdeplbError
from fdeplb.placement import imbalance, moved_experts, read_expert_load, rebalance_experts

POLICIES = ("deepseek", "greedy", "balanced")
#: issue 9's bound on move_aware's time as a multiple of balanced's; the mean max/mean excess over fresh balanced
#: (issue 33's). Issue 9's moved share (<= 0.20) was against a looser reference (balanced with 1-1 swaps only) that
#: issue 33 replaced by "balanced" itself: its rows are gone, issue 33's (<= 0.10) measure the same share
MOVE_AWARE_TIME_RATIO, MOVE_AWARE_SLACK = 2.0, 0.0005
#: issue 33's bounds on move_aware's moved share and time ratio
MOVED_SHARE_33, TIME_RATIO_33 = 0.10, 1.2
#: interleaved (balanced, move_aware) runs per drift pair for its time ratio; per topology of the speed table
DRIFT_TIME_REPEATS, SPEED_REPEATS = 5, 11
#: move budgets of the Pareto table, as shares of the moves of a fresh "balanced" plan
PARETO_SHARES = (0.05, 0.10, 0.20)
#: tolerances of the frontier table: the moves move_aware (no cap) needs for each balance slack
FRONTIER_TOLERANCES = (0.0005, 0.001, 0.002, 0.004, 0.008)


def timed(fn, repeats: int):
    """(result of the last call, list of wall times in ms)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return out, times


def ratio(load, placement, num_gpus) -> np.ndarray:
    """Per-layer max/mean of the GPU loads: float64 [L]."""
    return 1.0 + imbalance(load, placement, num_gpus)


def lognormal_drift(load: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    """Synthetic drift: int64 [L, E] = ``load`` times exp(sigma z), z ~ N(0, 1) per (layer, expert) from
    ``numpy.random.default_rng(seed)``, each layer rescaled to ``load``'s total, rounded (issue 33's harness)."""
    b = load * np.exp(sigma * np.random.default_rng(seed).standard_normal(load.shape))
    return np.rint(b * (load.sum(axis=1, keepdims=True) / b.sum(axis=1, keepdims=True))).astype(np.int64)


def random_load(seed: int, layers: int = 58, experts: int = 256) -> np.ndarray:
    """Synthetic loads: int64 [layers, experts] = round(1e4 x lognormal(0, 1)) from ``default_rng(seed)``."""
    return np.rint(1e4 * np.random.default_rng(seed).lognormal(0.0, 1.0, (layers, experts))).astype(np.int64)


Loads = Callable[[Path], tuple[np.ndarray, np.ndarray]]  # real-data folder -> (load A, load B), int [L, E] each


def dumps(folder: str, a: str, b: str) -> Loads:
    """(load A, load B): two dumps of a real-data folder."""
    return lambda real_data: tuple(read_expert_load(real_data / folder / f"{n}.json").expert_load for n in (a, b))


def drifted(folder: str, a: str, sigma: float, seed: int) -> Loads:
    """(load A, load B): a dump and its :func:`lognormal_drift`."""
    def loads(real_data: Path) -> tuple[np.ndarray, np.ndarray]:
        load = read_expert_load(real_data / folder / f"{a}.json").expert_load
        return load, lognormal_drift(load, sigma, seed)
    return loads


class DriftPair(NamedTuple):
    """A drift pair: old placement = "balanced" on load A at ``topology``, new loads B."""
    model: str
    a: str  # what load A is
    b: str  # what load B is
    topology: tuple[int, int, int, int]  # num_replicas, num_groups, num_nodes, num_gpus
    loads: Loads

    @property
    def name(self) -> str:
        groups, nodes = self.topology[1:3]
        return f"{self.model} {self.a} -> {self.b}" + (f", {groups} groups, {nodes} nodes" if nodes > 1 else "")


DS, DSV3_TOPOLOGY = "dsv3_sglang_ep_stats", (288, 8, 4, 32)  # num_replicas, num_groups, num_nodes, num_gpus
#: issue 33's drift pairs, defined and seeded as its shared harness defines them (the first four are issue 9's)
DRIFT_PAIRS = [
    DriftPair("DeepSeek-V3", "prefill_in1024", "decode_in1000out1000", (288, 1, 1, 32),
              dumps(DS, "prefill_in1024", "decode_in1000out1000")),
    DriftPair("DeepSeek-V3", "prefill_in512", "prefill_in4096", (288, 1, 1, 32),
              dumps(DS, "prefill_in512", "prefill_in4096")),
    DriftPair("DeepSeek-V3", "decode_in500out1500", "decode_in2000out100", (288, 1, 1, 32),
              dumps(DS, "decode_in500out1500", "decode_in2000out100")),
    DriftPair("Qwen2-57B", "counts57b", "counts57b_share", (72, 1, 1, 8),
              dumps("qwen2_57b_oeplb", "counts57b", "counts57b_share")),
    DriftPair("DeepSeek-V3", "prefill_in1024", "decode_in1000out1000", DSV3_TOPOLOGY,
              dumps(DS, "prefill_in1024", "decode_in1000out1000")),
    DriftPair("Qwen3-235B", "counts235b", "its lognormal(0.5) drift (synthetic, seed 33)", (144, 1, 1, 16),
              drifted("qwen3_235b_oeplb", "counts235b", 0.5, 33)),
    DriftPair("random", "58x256 lognormal(0,1) x 1e4, seed 33", "seed 34 (synthetic)", (288, 1, 1, 32),
              lambda _: (random_load(33), random_load(34))),
]
#: the pairs issue 9's moved-share bound was set on; those of the move budget (Pareto) table
PARETO_PAIRS = (DRIFT_PAIRS[0], DRIFT_PAIRS[3])


def drift_inputs(real_data: Path, pair: DriftPair) -> tuple[np.ndarray, object]:
    """A drift pair's (load B, old placement = "balanced" on load A at the pair's topology)."""
    load_a, load_b = pair.loads(real_data)
    return load_b, rebalance_experts(load_a, *pair.topology, policy="balanced")


def interleaved(run: Callable[[str], object], repeats: int) -> tuple[float, float]:
    """Median ms of ``run("balanced")`` and ``run("move_aware")`` over ``repeats`` interleaved calls of each."""
    ms = {"balanced": [], "move_aware": []}
    for _ in range(repeats):
        for policy in ms:
            ms[policy] += timed(lambda: run(policy), 1)[1]
    return statistics.median(ms["balanced"]), statistics.median(ms["move_aware"])


def move_bound(load: np.ndarray, old: object, topology: tuple[int, int, int, int], level: float) -> int | None:
    """fdeplb.placement.move_bound's lower bound on any plan's moves to reach ``level``; at several nodes the larger
    of it and the bound on plans that keep every group on one node (what the hierarchical policies place); None (and
    a note on stderr) where that module is missing or a linear program fails."""
    _, groups, nodes, ep = topology
    try:
        from fdeplb.placement import move_bound as bounds
        bound = bounds.moved_experts_lower_bound(load, old, ep, level)
        if nodes > 1 and groups % nodes == 0:
            bound = max(bound, bounds.groups_on_nodes_lower_bound(load, old, groups, nodes, ep, level))
        return bound
    except (ImportError, AttributeError, FdeplbError) as exc:
        print(f"move lower bound not computed: {exc}", file=sys.stderr)
        return None


def drift_entry(real_data: Path, pair: DriftPair, time_repeats: int = 0, bound: bool = False) -> dict:
    """One drift pair: every policy's moves, max/mean on B and ms (one run each, given the old placement);
    ``time_repeats``: also move_aware's time over balanced's (:func:`interleaved`); ``bound``: the bound on any
    plan's moves at fresh balanced + MOVE_AWARE_SLACK (:func:`move_bound`)."""
    load_b, old = drift_inputs(real_data, pair)
    ep = pair.topology[3]

    def run(policy: str):
        return rebalance_experts(load_b, *pair.topology, policy=policy, old_phy2log=old)

    entry = {"pair": pair.name, "ep": ep, "slots": pair.topology[0], "nodes": pair.topology[2],
             "old_max_over_mean": float(ratio(load_b, old, ep).mean())}
    for policy in (*POLICIES, "move_aware"):
        plan, times = timed(lambda: run(policy), 1)
        entry[policy] = {"moved": moved_experts(old, plan, ep), "max_over_mean": float(ratio(load_b, plan, ep).mean()),
                         "ms": times[0]}
    if time_repeats:
        bal, mov = interleaved(run, time_repeats)
        entry["time"] = {"balanced_ms": bal, "move_aware_ms": mov, "ratio": mov / bal}
    if bound:
        level = entry["balanced"]["max_over_mean"] + MOVE_AWARE_SLACK
        entry["move_bound"] = move_bound(load_b, old, pair.topology, level)
    return entry


def move_aware_speed(real_data: Path, repeats: int = SPEED_REPEATS) -> list[dict]:
    """Median ms of "balanced" and "move_aware" on the first drift pair's loads (288 slots, 8 groups, 32 GPUs) with
    1 and 4 nodes, old = "balanced" on A with the same topology, both given ``old_phy2log``; interleaved runs."""
    load_a, load_b = DRIFT_PAIRS[0].loads(real_data)
    out = []
    for nodes in (1, 4):
        topo = (288, 8, nodes, 32)
        old = rebalance_experts(load_a, *topo, policy="balanced")
        bal, mov = interleaved(lambda p: rebalance_experts(load_b, *topo, policy=p, old_phy2log=old), repeats)
        out.append({"nodes": nodes, "balanced_ms": bal, "move_aware_ms": mov, "ratio": mov / bal})
    return out


def pareto_rows(real_data: Path) -> list[dict]:
    """move_aware with ``max_moved_experts`` at :data:`PARETO_SHARES` of a fresh plan's moves on the drift pairs
    :data:`PARETO_PAIRS`: moved experts and mean max/mean."""
    out = []
    for pair in PARETO_PAIRS:
        load_b, old = drift_inputs(real_data, pair)
        ep = pair.topology[3]
        fresh = moved_experts(old, rebalance_experts(load_b, *pair.topology, policy="balanced", old_phy2log=old), ep)
        for share in PARETO_SHARES:
            cap = int(share * fresh)
            plan, ms = timed(lambda: rebalance_experts(load_b, *pair.topology, policy="move_aware", old_phy2log=old,
                                                       max_moved_experts=cap), 1)
            out.append({"pair": pair.name, "share": share, "cap": cap, "moved": moved_experts(old, plan, ep),
                        "max_over_mean": float(ratio(load_b, plan, ep).mean()), "ms": ms[0]})
    return out


def frontier_rows(real_data: Path) -> list[dict]:
    """move_aware without a cap at each of :data:`FRONTIER_TOLERANCES` on the drift pairs :data:`PARETO_PAIRS`:
    moved share of a fresh "balanced" plan's moves and slack (mean max/mean over fresh balanced's)."""
    out = []
    for pair in PARETO_PAIRS:
        load_b, old = drift_inputs(real_data, pair)
        ep = pair.topology[3]
        fresh = rebalance_experts(load_b, *pair.topology, policy="balanced", old_phy2log=old)
        fresh_moved, fresh_level = moved_experts(old, fresh, ep), float(ratio(load_b, fresh, ep).mean())
        for tol in FRONTIER_TOLERANCES:
            plan = rebalance_experts(load_b, *pair.topology, policy="move_aware", old_phy2log=old, tolerance=tol)
            out.append({"pair": pair.name, "tolerance": tol, "moved_share": moved_experts(old, plan, ep) / fresh_moved,
                        "slack": float(ratio(load_b, plan, ep).mean()) - fresh_level})
    return out


def previous_drift(real_data: Path) -> list[dict]:
    """:func:`drift_entry` of every pair the code on ``sys.path`` places (the previous revision's, under
    ``--as-previous``): a pair it refuses is left out, with a note on stderr."""
    drift = []
    for pair in DRIFT_PAIRS:
        try:
            drift.append(drift_entry(real_data, pair))
        except FdeplbError as exc:
            print(f"{pair.name}: not run by the previous code: {exc}", file=sys.stderr)
    return drift


def moved_share(d: dict) -> float:
    """A drift entry's move_aware moved experts over fresh balanced's (both given the old placement)."""
    return d["move_aware"]["moved"] / max(d["balanced"]["moved"], 1)


def slack_33(d: dict) -> float:
    """A drift entry's mean max/mean of move_aware minus fresh balanced's."""
    return d["move_aware"]["max_over_mean"] - d["balanced"]["max_over_mean"]


def pair_summary(d: dict) -> dict:
    """A drift entry's issue 33 figures for the JSON line, and whether all three meet their bounds."""
    bound = d["move_bound"]
    return {"moved_share": round(moved_share(d), 4), "slack": round(slack_33(d), 6),
            "time_ratio": round(d["time"]["ratio"], 3),
            "lower_bound_share": None if bound is None else round(bound / max(d["balanced"]["moved"], 1), 4),
            "ok_33": (moved_share(d) <= MOVED_SHARE_33 and slack_33(d) <= MOVE_AWARE_SLACK
                      and d["time"]["ratio"] <= TIME_RATIO_33)}

def limit(name: str, value: float, bound: float, digits: int = 6) -> dict:
    """A target row: ``value`` (rounded to ``digits``) must be at most ``bound``."""
    return {"target": name, "value": round(value, digits), "limit": bound, "ok": value <= bound}


def drift_targets(drift: list[dict], ma_speed: list[dict], pareto: list[dict]) -> list[dict]:
    """The move_aware targets of issues #9 and #33 on the drift entries, the speed table and the Pareto rows."""
    out = []
    for d in drift:
        share, slack = moved_share(d), slack_33(d)
        out += [limit(f"#33 move_aware {d['pair']}: moved / fresh balanced moved", share, MOVED_SHARE_33, 4),
                limit(f"#33 move_aware {d['pair']}: max/mean - fresh balanced", slack, MOVE_AWARE_SLACK)]
        if "time" in d:
            out.append(limit(f"#33 move_aware / balanced time, {d['pair']} (median of {DRIFT_TIME_REPEATS})",
                             d["time"]["ratio"], TIME_RATIO_33, 2))
    for sp in ma_speed:
        name = f"move_aware / balanced time, {DRIFT_PAIRS[0].name}, 288 slots, 8 groups, {sp['nodes']} node(s), 32 GPUs"
        out += [limit(name, sp["ratio"], MOVE_AWARE_TIME_RATIO, 2), limit("#33 " + name, sp["ratio"], TIME_RATIO_33, 2)]
    for pair in dict.fromkeys(p["pair"] for p in pareto):
        levels = [p["max_over_mean"] for p in pareto if p["pair"] == pair]
        out.append(limit(f"#33 move_aware move budget, {pair}: budgets where a larger one balances worse",
                         sum(y > x + 1e-12 for x, y in zip(levels, levels[1:])), 0))
    return out


def _this_and_previous(result: dict, key: str) -> list[tuple[str, list]]:
    """(code, rows) of ``result[key]`` for this code, then for the previous revision when it ran."""
    prev = result.get("previous")
    return [("this", result[key])] + ([(prev["rev"], prev[key])] if prev else [])


def _code_table(result: dict, key: str, intro: str, header: str, rule: str, row: Callable[[str, dict], str]
                ) -> list[str]:
    """A markdown table of ``result[key]``'s rows, this code's then the previous code's (a first column naming it)."""
    return ["", intro, "", header, rule] + [row(code, r) for code, rows in _this_and_previous(result, key)
                                             for r in rows]


def drift_tables(result: dict) -> list[str]:
    """Markdown lines: the drift table (with the previous code's rows where it ran the pair), issue 33's per-pair
    targets, the 1- and 4-node speed table, the move budget table."""
    prev = result.get("previous")
    lines = ["", "Drift pairs (issue 33): old = \"balanced\" on A at the pair's topology; moved experts and mean "
             "max/mean on B (over all GPUs), every policy given the old placement; \"lower bound, any plan\": no plan "
             "reaching fresh balanced + 0.0005 moves fewer (fdeplb.placement.move_bound, LP relaxations; at 4 "
             "nodes: no plan that keeps every expert group on one node, as the hierarchical policies do). Synthetic "
             "(no such dump exists): Qwen3-235B's B = counts235b x exp(0.5 z), z ~ N(0, 1) per (layer, expert) from "
             "numpy default_rng(33), each layer rescaled to A's total, rounded; random: A and B = round(1e4 x "
             "lognormal(0, 1)), 58 x 256, default_rng(33) and (34). The rest are real dumps; \"8 groups, 4 nodes\": "
             "the hierarchical bar topology, old placement made with it.", "",
             "| pair | EP | slots | nodes | old max/mean | policy | moved experts | max/mean | ms |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    prev_drift = {d["pair"]: d for d in prev["drift"]} if prev else {}
    for d in result["drift"]:
        entries = [(p, d[p]) for p in (*POLICIES, "move_aware")]
        if d["pair"] in prev_drift:
            entries += [(f"{p} ({prev['rev']})", prev_drift[d["pair"]][p]) for p in ("balanced", "move_aware")]
        head = f"| {d['pair']} | {d['ep']} | {d['slots']} | {d['nodes']} | {d['old_max_over_mean']:.4f} | "
        lines += [head + f"{policy} | {e['moved']:,} | {e['max_over_mean']:.5f} | {e['ms']:.0f} |"
                  for policy, e in entries]
        bound = "not computed" if d["move_bound"] is None else f"{d['move_bound']:,}"
        level = d["balanced"]["max_over_mean"] + MOVE_AWARE_SLACK
        lines.append(head + f"lower bound, any plan | {bound} | {level:.5f} | |")
    lines += ["", f"Issue 33's move targets per drift pair (this code): moved share = move_aware moved / fresh "
              f"balanced moved (<= {MOVED_SHARE_33}); slack = mean max/mean of move_aware - fresh balanced's (<= "
              f"{MOVE_AWARE_SLACK}); time = median ms of {DRIFT_TIME_REPEATS} interleaved runs each, old given to both "
              f"(ratio <= {TIME_RATIO_33}).", "",
              "| pair | moved share | slack | balanced ms | move_aware ms | time ratio | lower bound share |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for d in result["drift"]:
        bound = "" if d["move_bound"] is None else f"{d['move_bound'] / max(d['balanced']['moved'], 1):.4f}"
        lines.append(f"| {d['pair']} | {moved_share(d):.4f} | {slack_33(d):.6f} | {d['time']['balanced_ms']:.0f} | "
                     f"{d['time']['move_aware_ms']:.0f} | {d['time']['ratio']:.2f} | {bound} |")
    lines += _code_table(result, "move_aware_speed", "move_aware vs balanced, same input, interleaved runs (median ms):",
                         "| code | nodes | balanced ms | move_aware ms | ratio |", "|---|---:|---:|---:|---:|",
                         lambda code, sp: f"| {code} | {sp['nodes']} | {sp['balanced_ms']:.1f} | "
                                          f"{sp['move_aware_ms']:.1f} | {sp['ratio']:.2f} |")
    lines += _code_table(result, "pareto", "Move budget (Pareto option): move_aware with max_moved_experts = a share of "
                         "a fresh balanced plan's moves (old = balanced on A, global).",
                         "| pair | code | budget share | cap | moved | max/mean | ms |", "|---|---|---:|---:|---:|---:|---:|",
                         lambda code, p: f"| {p['pair']} | {code} | {p['share']:.2f} | {p['cap']:,} | {p['moved']:,} | "
                                         f"{p['max_over_mean']:.5f} | {p['ms']:.0f} |")
    lines += ["", "Moves against balance (this code): move_aware without a cap at each tolerance; moved share of a fresh "
              "balanced plan's moves, slack = mean max/mean over fresh balanced's.", "",
              "| pair | tolerance | moved share | slack |", "|---|---:|---:|---:|"]
    lines += [f"| {f['pair']} | {f['tolerance']} | {f['moved_share']:.4f} | {f['slack']:.6f} |"
              for f in result.get("frontier", [])]
    return lines
