"""Placement benchmark on every real expert-load dump (../shared/real_data).

For every dump and topology (EP8/16/32/64, one redundant slot per GPU; DeepSeek-V3 dumps with 8 groups,
hierarchical with 8 GPUs per node and global; Qwen dumps global) it times each policy and measures the balance it
reaches. Then issue 33's drift pairs (``placement_drift.py`` beside this script: real DeepSeek-V3 and Qwen2-57B dump
pairs, one at the hierarchical bar topology, a synthetic Qwen3-235B drift, a synthetic random pair): every policy's
moved experts and max/mean, a lower bound on any plan's moves, move_aware's time over balanced's. A
plain-Python-loop DeepSeek EPLB (fdeplb.placement.reference) runs in the same process as the speed reference.

Speed-up of "deepseek" on the DeepSeek-V3 shape (58 layers x 256 experts, 288 slots, 8 groups, 4 nodes, 32 GPUs,
every DeepSeek-V3 dump): against DeepSeek's own ``eplb.py`` when ``--eplb-ref DIR`` names a folder holding it
(run by ``--eplb-python``, a Python with torch, default this one; torch is never a dependency of fdeplb), which also
checks that both give the same phy2log, log2phy and logcnt; always against the plain-loop port
(fdeplb.placement.reference). The table says which baseline each ratio used.

Previous figures, same run: ``--previous REV`` (default ``main``; ``none`` skips it) extracts fdeplb as of that git
revision (``git archive``) into a temporary folder and runs this script's balanced / drift / move_aware timing in a
subprocess on that code (no per-pair timing there); every balance, moves and time figure is printed beside
DeepSeek's and the previous one (a drift pair's only where the previous code ran it).

Topology-aware: no real dump records load per source rank, so each DeepSeek-V3 dump listed in
``TOPOLOGY_DUMPS`` is split over the 32 source ranks by a fixed-seed Dirichlet(0.5) share per (layer, expert, node);
the table gives the cross-node token fraction of "balanced" and "topology_aware" at two slacks, and their max/mean.

Prints tables, the targets of issues #3, #9 and #33 with PASS/FAIL, a last line of JSON; ``--write-results FILE``: the
tables as Markdown too (benchmarks/results/placement.md).

    python benchmarks/placement.py [--real-data DIR] [--eplb-ref DIR [--eplb-python PY]] [--previous REV]
                                   [--write-results benchmarks/results/placement.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fdeplb.placement import balancedness, gpu_loads, read_expert_load, rebalance_experts
from fdeplb.placement.reference import deepseek_reference
from placement_drift import (DRIFT_PAIRS, DRIFT_TIME_REPEATS, DSV3_TOPOLOGY, POLICIES, drift_entry, drift_tables,
                             drift_targets, frontier_rows, limit, move_aware_speed, pair_summary, pareto_rows,
                             previous_drift, ratio, timed)

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # folder -> (model name, num_groups for the hierarchical mode or None)
    "dsv3_sglang_ep_stats": ("DeepSeek-V3", 8),
    "qwen3_235b_oeplb": ("Qwen3-235B", None),
    "qwen3_30b_oeplb": ("Qwen3-30B", None),
    "qwen2_57b_oeplb": ("Qwen2-57B", None),
}
EP_SIZES = (8, 16, 32, 64)
GPUS_PER_NODE = 8
REPEATS = {"deepseek": 5, "greedy": 3, "balanced": 3}
SPEEDUP_TARGET = 50.0
#: issue 33's bar: balanced's worst dump max/mean at the bar topologies
BALANCE_BAR = 1.0003
# Run by --eplb-python: times eplb.rebalance_experts (imported from argv[1]) on every load of argv[2] and saves its
# outputs to argv[3]. Contains no eplb.py code.
EPLB_TIMER = """
import sys, json, time
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
import eplb
loads = np.load(sys.argv[2])
topo = json.loads(sys.argv[4])
eplb.rebalance_experts(torch.tensor(loads[loads.files[0]]), *topo)  # warm-up
out, times = {}, []
for name in loads.files:
    w = torch.tensor(loads[name])
    t = time.perf_counter()
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w, *topo)
    times.append((time.perf_counter() - t) * 1e3)
    for key, arr in (("phy2log", phy2log), ("log2phy", log2phy), ("logcnt", logcnt)):
        out[name + "." + key] = arr.numpy()
np.savez(sys.argv[3], **out)
print(json.dumps({"ms": times, "torch": torch.__version__, "threads": torch.get_num_threads()}))
"""


def deepseek_speedup(real_data: Path, eplb_ref: Path | None, eplb_python: str) -> dict:
    """Median ms of "deepseek" vs eplb.py (when given) and vs the plain-loop port on every DeepSeek-V3 dump."""
    paths = sorted((real_data / "dsv3_sglang_ep_stats").glob("*.json"))
    loads = {p.stem: read_expert_load(p).expert_load for p in paths}

    def ours() -> tuple[dict, list]:
        plans, times = {}, []
        for name, load in loads.items():
            plans[name], t = timed(lambda: rebalance_experts(load, *DSV3_TOPOLOGY, policy="deepseek"), 5)
            times += t
        return plans, times

    plans, fd_ms = ours()
    _, loop_ms = zip(*[timed(lambda: deepseek_reference(load, *DSV3_TOPOLOGY), 1) for load in loads.values()])
    out = {"dumps": len(loads), "fdeplb_ms": statistics.median(fd_ms),
           "python_loop_ms": statistics.median(t[0] for t in loop_ms)}
    if eplb_ref is not None:
        with tempfile.TemporaryDirectory() as tmp:
            np.savez(Path(tmp) / "loads.npz", **loads)
            res = subprocess.run([eplb_python, "-c", EPLB_TIMER, str(eplb_ref), str(Path(tmp) / "loads.npz"),
                                  str(Path(tmp) / "out.npz"), json.dumps(DSV3_TOPOLOGY)],
                                 capture_output=True, text=True, check=True)
            info = json.loads(res.stdout.strip().splitlines()[-1])
            with np.load(Path(tmp) / "out.npz") as ref:
                exact = sum(all(np.array_equal(getattr(plans[n], f), ref[f"{n}.{f}"])
                                for f in ("phy2log", "log2phy", "logcnt")) for n in loads)
        _, fd_after = ours()  # fdeplb timed before and after eplb.py, so a change of machine load shows
        out.update(eplb_ms=statistics.median(info["ms"]), torch=info["torch"], torch_threads=info["threads"],
                   fdeplb_ms=statistics.median(fd_ms + fd_after), exact_dumps=exact)
    return out


def configs(model: str, groups: int | None, num_experts: int):
    """(mode, EP, slots, num_groups, num_nodes) to run for a model."""
    for ep in EP_SIZES:
        slots = num_experts + ep
        if groups is None:
            yield "global", ep, slots, 1, 1
            continue
        yield "global", ep, slots, groups, 1
        if ep > GPUS_PER_NODE:
            yield "hierarchical", ep, slots, groups, ep // GPUS_PER_NODE


def run(real_data: Path, eplb_ref: Path | None = None, eplb_python: str = sys.executable,
        previous: str | None = "main") -> dict:
    """Run everything; returns the results (rows, drift, speed-up, previous figures, topology, targets)."""
    prev = previous_figures(real_data, previous) if previous else None
    rows = balance_rows(real_data, POLICIES)
    drift = [drift_entry(real_data, pair, DRIFT_TIME_REPEATS, bound=True) for pair in DRIFT_PAIRS]
    speed = deepseek_speedup(real_data, eplb_ref, eplb_python)
    ma_speed = move_aware_speed(real_data)
    topo, pareto = topology_rows(real_data), pareto_rows(real_data)
    return {"rows": rows, "drift": drift, "speedup": speed, "move_aware_speed": ma_speed, "previous": prev,
            "topology": topo, "pareto": pareto, "frontier": frontier_rows(real_data), "hot_expert": hot_expert_rows(),
            "targets": targets(rows, drift, speed, ma_speed, topo, pareto)}


def lower_bound(load: np.ndarray, slots: int, ep: int, groups: int = 1, nodes: int = 1) -> np.ndarray:
    """Per-layer max/mean no plan can beat: the larger of 1 and DeepSeek's replica counts' largest per-replica load
    over the mean GPU load (those counts minimise the largest per-replica load; a GPU holds at least one replica);
    hierarchical (groups kept on nodes): also the lightest packing's heaviest node over its GPUs, over the mean GPU
    load (every packing tried, fdeplb.placement.node_maps.lightest_maps; one group a node: the heaviest group)."""
    from fdeplb.placement.deepseek import replicate_experts

    load = load.astype(np.float64)
    _, _, cnt = replicate_experts(load, slots)
    mean = load.sum(axis=1) / ep
    safe = np.where(mean > 0, mean, 1.0)
    bound = np.maximum(1.0, (load / cnt).max(axis=1) / safe)
    if nodes > 1 and groups % nodes == 0:
        from fdeplb.placement.node_maps import lightest_maps

        group_load = load.reshape(load.shape[0], groups, -1).sum(axis=2)
        if groups == nodes:
            heaviest = group_load.max(axis=1)
        else:
            lightest = lightest_maps(group_load, nodes)
            heaviest = None if lightest is None else lightest[1]
        if heaviest is not None:
            bound = np.maximum(bound, heaviest / (ep // nodes) / safe)
    return bound


#: shares of a layer's load on one expert in the synthetic hot-expert rows
HOT_SHARES = (0.5, 0.8, 0.93, 0.99)


def hot_expert_rows() -> list[dict]:
    """Synthetic (no real dump is like it): one expert carrying a share of every layer's load (4 layers, the other
    255 uniform in [100, 1000), numpy default_rng(0)), DeepSeek-V3's 288 slots on 32 GPUs, global and 4 nodes;
    "deepseek" and "balanced": mean max/mean over the GPUs (global) or inside the worst node (4 nodes), and the
    hot expert's replicas."""
    out = []
    for share in HOT_SHARES:
        load = np.random.default_rng(0).integers(100, 1000, size=(4, 256)).astype(np.int64)
        load[:, 0] = (load[:, 1:].sum(axis=1) * share / (1 - share)).astype(np.int64)
        for nodes in (1, 4):
            for policy in ("deepseek", "balanced"):
                plan = rebalance_experts(load, 288, 8, nodes, 32, policy=policy)
                gpu = gpu_loads(load, plan, 32).reshape(4, nodes, 32 // nodes)
                inside = (gpu.max(axis=2) / gpu.mean(axis=2)).max(axis=1)
                out.append({"share": share, "nodes": nodes, "policy": policy, "max_over_mean": float(inside.mean()),
                            "replicas": int(plan.logcnt[:, 0].max())})
    return out


def balance_rows(real_data: Path, policies: tuple, python_loop: bool = True) -> list[dict]:
    """Balance and time of ``policies`` (and the plain-loop DeepSeek, and the lower bound) on every dump and
    config."""
    rebalance_experts(np.ones((2, 16)), 20, 4, 2, 4, policy="balanced")  # warm-up (imports, caches)
    cells: dict[tuple, dict] = {}
    for folder, (model, groups) in MODELS.items():
        for path in sorted((real_data / folder).glob("*.json")):
            load = read_expert_load(path).expert_load
            for mode, ep, slots, g, n in configs(model, groups, load.shape[1]):
                runs = {p: timed(lambda p=p: rebalance_experts(load, slots, g, n, ep, policy=p), REPEATS[p])
                        for p in policies}
                if python_loop:
                    runs["python-loop deepseek"] = timed(lambda: deepseek_reference(load, slots, g, n, ep), 1)
                for policy, (plan, times) in runs.items():
                    cell = cells.setdefault((model, mode, ep, slots, policy), {"ms": [], "bal": [], "ratio": [],
                                                                              "per_dump_ratio": {}})
                    cell["ms"] += times
                    cell["bal"].append(balancedness(load, plan, ep).mean())
                    r = ratio(load, plan, ep).mean()
                    cell["ratio"].append(r)
                    cell["per_dump_ratio"][path.stem] = r
                    if n > 1:  # worst node of every layer: heaviest GPU over the node's mean GPU load
                        gpu = gpu_loads(load, plan, ep).reshape(load.shape[0], n, -1)
                        inside = float((gpu.max(axis=2) / gpu.mean(axis=2)).max(axis=1).mean())
                        cell["inside"] = max(cell.get("inside", 0.0), inside)
                if policies == POLICIES:
                    lb = cells.setdefault((model, mode, ep, slots, "lower bound"), {"ms": [0.0], "bal": [], "ratio": [],
                                                                                    "per_dump_ratio": {}})
                    bound = lower_bound(load, slots, ep, g, n)
                    lb["ratio"].append(float(bound.mean()))
                    lb["bal"].append(float((1 / bound).mean()))
    return [
        {"model": k[0], "mode": k[1], "ep": k[2], "slots": k[3], "policy": k[4],
         "median_ms": statistics.median(v["ms"]), "balancedness": float(np.mean(v["bal"])),
         "max_over_mean": float(np.mean(v["ratio"])), "worst_dump_max_over_mean": float(np.max(v["ratio"])),
         "worst_inside_node": v.get("inside"), "dumps": len(v["ratio"])}
        for k, v in cells.items()
    ]


def as_previous(real_data: Path) -> dict:
    """The previous code's figures: run by ``--as-previous`` in a subprocess whose ``fdeplb`` is the previous
    revision's (drift pairs without per-pair timing or move bound)."""
    return {"rows": balance_rows(real_data, ("balanced",), python_loop=False), "drift": previous_drift(real_data),
            "move_aware_speed": move_aware_speed(real_data), "pareto": pareto_rows(real_data)}


def previous_figures(real_data: Path, rev: str) -> dict | None:
    """:func:`as_previous` on fdeplb as of git revision ``rev`` (``git archive``), in a subprocess; None (and a
    note on stderr) when git or the revision is not available."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fdeplb"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            env = {**os.environ, "PYTHONPATH": tmp}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--as-previous", "--real-data",
                                  str(real_data)], capture_output=True, text=True, check=True, env=env)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"previous figures ({rev}) not measured: {exc}", file=sys.stderr)
            return None
    prev = json.loads(out.stdout.strip().splitlines()[-1])
    prev["rev"] = rev
    return prev


#: DeepSeek-V3 dumps split per source rank for the topology-aware table, and the slacks it is run at
TOPOLOGY_DUMPS = ("decode_in1000out1000", "prefill_in1024")
TOPOLOGY_SLACKS = (0.0005, 0.002)


def topology_rows(real_data: Path) -> list[dict]:
    """Cross-node token fraction and max/mean of "balanced" and "topology_aware" (DeepSeek-V3, 288 slots, 32 GPUs,
    4 nodes) on the synthetic per-source-rank split of every dump of :data:`TOPOLOGY_DUMPS`."""
    from fdeplb.placement import cross_node_fraction

    P, G, N = 288, 32, 4
    out = []
    for name in TOPOLOGY_DUMPS:
        load = read_expert_load(real_data / "dsv3_sglang_ep_stats" / f"{name}.json").expert_load.astype(np.float64)
        L, E = load.shape
        share = np.random.default_rng(33).dirichlet(np.full(N, 0.5), size=(L, E))  # [L, E, node]
        source = np.repeat((load[:, :, None] * share).transpose(0, 2, 1)[:, :, None, :] / (G // N), G // N,
                           axis=2).reshape(L, G, E)
        summed = source.sum(axis=1)
        plans = {"balanced": timed(lambda: rebalance_experts(summed, P, 1, N, G, policy="balanced"), 1)}
        for tol in TOPOLOGY_SLACKS:
            plans[f"topology_aware, slack {tol}"] = timed(
                lambda t=tol: rebalance_experts(source, P, 1, N, G, policy="topology_aware", tolerance=t), 1)
        for policy, (plan, ms) in plans.items():
            out.append({"dump": name, "policy": policy, "ms": ms[0],
                        "cross_node": float(cross_node_fraction(source, plan, G, N).mean()),
                        "max_over_mean": float(ratio(summed, plan, G).mean())})
    return out


def targets(rows: list[dict], drift: list[dict], speed: dict | None = None,
            ma_speed: list[dict] = (), topology: list[dict] = (), pareto: list[dict] = ()) -> list[dict]:
    """The targets of issues #3, #9 and #33, measured (the eplb.py ones only when eplb.py ran)."""
    def row(**kw):
        return next(r for r in rows if all(r[k] == v for k, v in kw.items()))

    ds = row(model="DeepSeek-V3", mode="hierarchical", ep=32, policy="deepseek")
    balanced_rows = [row(model="DeepSeek-V3", mode="global", ep=32, policy="balanced"),
                     *[row(model=m, mode="global", ep=16, policy="balanced") for m in ("Qwen3-235B", "Qwen3-30B")]]
    out = [
        {"target": "deepseek, DeepSeek-V3 shape (58x256 -> 288 slots, 8 groups, 4 nodes, 32 GPUs): median ms",
         "value": round(ds["median_ms"], 2), "limit": 6.0, "ok": ds["median_ms"] <= 6.0},
        {"target": "balanced, global: worst dump mean max/mean (DeepSeek EP32, Qwen3 EP16)",
         "value": round(max(r["worst_dump_max_over_mean"] for r in balanced_rows), 6), "limit": 1.0005,
         "ok": all(r["worst_dump_max_over_mean"] <= 1.0005 for r in balanced_rows)},
        {"target": "balanced, global: median ms (DeepSeek EP32, Qwen3 EP16)",
         "value": round(max(r["median_ms"] for r in balanced_rows), 2), "limit": 50.0,
         "ok": all(r["median_ms"] <= 50.0 for r in balanced_rows)},
    ]
    if speed and "eplb_ms" in speed:
        ratio_ = speed["eplb_ms"] / speed["fdeplb_ms"]
        out.append({"target": "deepseek vs DeepSeek's eplb.py (torch CPU), DeepSeek-V3 shape: speed-up",
                    "value": round(ratio_, 1), "limit": SPEEDUP_TARGET, "ok": ratio_ >= SPEEDUP_TARGET})
        out.append({"target": "deepseek vs eplb.py: DeepSeek-V3 dumps with identical phy2log, log2phy, logcnt",
                    "value": speed["exact_dumps"], "limit": speed["dumps"],
                    "ok": speed["exact_dumps"] == speed["dumps"]})
    bars = [*balanced_rows, row(model="Qwen2-57B", mode="global", ep=8, policy="balanced")]
    worst = max(r["worst_dump_max_over_mean"] for r in bars)
    inside = row(model="DeepSeek-V3", mode="hierarchical", ep=32, policy="balanced")["worst_inside_node"]
    beaten = [r for r in rows if r["policy"] == "balanced" and r["worst_dump_max_over_mean"] > row(
        model=r["model"], mode=r["mode"], ep=r["ep"], policy="deepseek")["worst_dump_max_over_mean"] + 1e-12]
    out += [limit("#33 balanced: worst dump max/mean, global (DeepSeek-V3 EP32, Qwen3 EP16, Qwen2 EP8)", worst,
                  BALANCE_BAR),
            limit("#33 balanced: worst dump, worst node's max/mean inside the node (DeepSeek-V3 EP32, 4 nodes)",
                  inside, BALANCE_BAR),
            limit("#33 balanced: cases (model, mode, EP) where its worst dump is worse than deepseek's", len(beaten), 0)]
    out += drift_targets(drift, ma_speed, pareto)
    for t in topology:
        if t["policy"].startswith("topology_aware"):
            base = next(b for b in topology if b["dump"] == t["dump"] and b["policy"] == "balanced")
            out.append({"target": f"#33 {t['policy']}, {t['dump']}: cross-node fraction below balanced's "
                                  f"({base['cross_node']:.4f})", "value": round(t["cross_node"], 4),
                        "limit": round(base["cross_node"], 4), "ok": t["cross_node"] < base["cross_node"]})
    return out


def tables(result: dict) -> list[str]:
    """Markdown tables (also printed)."""
    prev = result.get("previous")
    tag = f"balanced ({prev['rev']})" if prev else None
    rows = list(result["rows"])
    if prev:  # the previous code's balanced rows, next to today's
        rows += [{**r, "policy": tag} for r in prev["rows"]]
    lines = ["| model | mode | EP | slots | policy | median ms | balancedness | max/mean | worst dump | worst node inside |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    order = {p: i for i, p in enumerate((*POLICIES, tag, "lower bound", "python-loop deepseek"))}
    for r in sorted(rows, key=lambda r: (list(MODELS.values()).index(next(v for v in MODELS.values()
                                                                          if v[0] == r["model"])),
                                         r["mode"], r["ep"], order[r["policy"]])):
        inside = "" if r.get("worst_inside_node") is None else f"{r['worst_inside_node']:.5f}"
        ms = "" if r["policy"] == "lower bound" else f"{r['median_ms']:.1f}"
        lines.append(f"| {r['model']} | {r['mode']} | {r['ep']} | {r['slots']} | {r['policy']} | "
                     f"{ms} | {r['balancedness']:.4f} | {r['max_over_mean']:.5f} | "
                     f"{r['worst_dump_max_over_mean']:.5f} | {inside} |")
    lines += ["", "Lower bound: max(1, largest per-replica load of DeepSeek's replica counts / mean GPU load) per layer,"
              " hierarchical also the lightest packing of groups onto nodes' heaviest node over its GPUs (all packings"
              " tried; one group a node: the heaviest group) / mean GPU load;"
              " worst node inside: the worst dump's mean over layers of the worst node's heaviest GPU over that node's"
              " mean GPU load (hierarchical only)."]
    if result.get("hot_expert"):
        lines += ["", "Synthetic hot expert (no real dump is like it): one expert carrying a share of every layer's load, "
                  "288 slots on 32 GPUs; max/mean over the GPUs (1 node) or inside the worst node (4 nodes); "
                  "\"balanced\" re-counts a row whose replica counts force an excess (placement/recount.py).", "",
                  "| hot share | nodes | policy | max/mean | hot expert's replicas |", "|---:|---:|---|---:|---:|"]
        lines += [f"| {h['share']} | {h['nodes']} | {h['policy']} | {h['max_over_mean']:.5f} | {h['replicas']} |"
                  for h in result["hot_expert"]]
    lines += drift_tables(result)
    if result.get("topology"):
        lines += ["", "Topology-aware: DeepSeek-V3, 288 slots, 32 GPUs, 4 nodes; synthetic per-source-rank split "
                  "(Dirichlet(0.5) node shares, seed 33); cross-node = share of tokens whose replica is on another "
                  "node than their source rank (even split over replicas).", "",
                  "| dump | policy | cross-node fraction | max/mean | ms |", "|---|---|---:|---:|---:|"]
        for t in result["topology"]:
            lines.append(f"| {t['dump']} | {t['policy']} | {t['cross_node']:.4f} | {t['max_over_mean']:.5f} | "
                         f"{t['ms']:.0f} |")
    sp = result.get("speedup")
    if sp:
        lines += ["", "Speed-up of \"deepseek\" on the DeepSeek-V3 shape (58x256 -> 288 slots, 8 groups, 4 nodes, "
                  f"32 GPUs), median over {sp['dumps']} dumps, same run:", "",
                  "| baseline | baseline ms | fdeplb deepseek ms | speed-up | same output |",
                  "|---|---:|---:|---:|---|"]
        if "eplb_ms" in sp:
            lines.append(f"| DeepSeek eplb.py, torch {sp['torch']} CPU ({sp['torch_threads']} threads) | "
                         f"{sp['eplb_ms']:.0f} | {sp['fdeplb_ms']:.1f} | {sp['eplb_ms'] / sp['fdeplb_ms']:.0f}x | "
                         f"{sp['exact_dumps']}/{sp['dumps']} dumps |")
        else:
            lines.append("| DeepSeek eplb.py | not run (no --eplb-ref) | | | |")
        lines.append(f"| plain-loop port (fdeplb.placement.reference) | {sp['python_loop_ms']:.0f} | "
                     f"{sp['fdeplb_ms']:.1f} | {sp['python_loop_ms'] / sp['fdeplb_ms']:.0f}x | phy2log (tests) |")
    lines += ["", "| target | measured | limit | |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {t['value']} | {t['limit']} | {'PASS' if t['ok'] else 'FAIL'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-data", type=Path,
                        default=Path(os.environ.get("FDEPLB_REAL_DATA", ROOT.parent / "shared" / "real_data")))
    parser.add_argument("--write-results", type=Path, metavar="FILE", help="also write the tables as Markdown")
    parser.add_argument("--eplb-ref", type=Path, metavar="DIR",
                        help="folder holding DeepSeek's eplb.py: time it (and compare outputs) against 'deepseek'")
    parser.add_argument("--eplb-python", default=sys.executable, metavar="PY",
                        help="Python with torch that runs eplb.py (default: this one)")
    parser.add_argument("--previous", default="main", metavar="REV",
                        help="git revision whose figures are measured in the same run (default main; 'none': skip)")
    parser.add_argument("--as-previous", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_previous:  # run by previous_figures() with the previous revision's fdeplb on PYTHONPATH
        print(json.dumps(as_previous(args.real_data)))
        return 0
    if args.eplb_ref is not None and not (args.eplb_ref / "eplb.py").is_file():
        print(f"no eplb.py in {args.eplb_ref}", file=sys.stderr)
        return 2
    if not args.real_data.is_dir():
        print(f"real data not found at {args.real_data}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    result = run(args.real_data, args.eplb_ref, args.eplb_python,
                 None if args.previous.lower() == "none" else args.previous)
    total = time.perf_counter() - start
    lines = tables(result)
    print("\n".join(lines))
    print(f"\ntotal {total:.0f} s on {os.cpu_count()} CPUs, numpy {np.__version__}, python {platform.python_version()}")
    if args.write_results:
        header = ["# Placement benchmark", "",
                  f"`python benchmarks/placement.py` on {os.cpu_count()} CPUs ({platform.machine()}, "
                  f"Python {platform.python_version()}, numpy {np.__version__}); whole run {total:.0f} s. "
                  "Slots = experts + one redundant per GPU; hierarchical = 8 GPUs per node. Balance columns are means "
                  "over layers and dumps (max/mean = 1 + imbalance); times are medians over dumps and repeats "
                  "(deterministic balance, timings vary by machine load).", ""]
        args.write_results.write_text("\n".join(header + lines) + "\n")
    summary = {
        "benchmark": "placement",
        "seconds": round(total, 1),
        "all_targets_ok": all(t["ok"] for t in result["targets"]),
        "targets": {t["target"]: t["value"] for t in result["targets"]},
        "deepseek_speedup": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in result["speedup"].items()},
        "move_aware": {
            "time_ratio_vs_balanced": {f"{sp['nodes']}_nodes": round(sp["ratio"], 3) for sp in result["move_aware_speed"]},
            "drift_pairs": {d["pair"]: pair_summary(d) for d in result["drift"]},
            "ok_33": all(pair_summary(d)["ok_33"] for d in result["drift"]),
            "ok": all(t["ok"] for t in result["targets"] if t["target"].startswith("move_aware")),
            "tolerance_frontier": {f"{f['pair']} @ {f['tolerance']}": round(f["moved_share"], 4)
                                   for f in result["frontier"]},
        },
        "previous": None if result["previous"] is None else result["previous"]["rev"],
        "topology_cross_node": {f"{t['dump']}: {t['policy']}": round(t["cross_node"], 4) for t in result["topology"]},
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["all_targets_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
