"""Swap benchmark: one EP rank moves from a DeepSeek-V3 prefill placement to a decode placement.

Real drift pair: SGLang's DeepSeek-V3 expert-load dumps (../shared/real_data/dsv3_sglang_ep_stats), placed with
DeepSeek's EPLB (fdeplb.placement.rebalance_experts) on 32 GPUs / 4 nodes / 288 slots (32 redundant experts).
Expert tensors have DeepSeek-V3's shapes (hidden 7168, moe_intermediate 2048, ERNIE/FastDeploy layout
up_gate_proj [hidden, 2*inter] + down_proj [inter, hidden]) divided by --scale to fit memory; the synthetic checkpoint
holds only the experts the measured rank holds before or after.

Measures: bytes read from the checkpoint, bytes copied locally, peak staging bytes, and the swap's copy throughput as
a ratio of a plain memcpy (numpy.copyto between pre-faulted buffers) of the same number of bytes, measured in the
same run. Checkpoint files were just written, so "read" is from the page cache: the read time is not a disk speed.

    python benchmarks/swap.py [--scale 8] [--dtype bfloat16] [--rank R] [--repeats 3] [--device cpu]

Prints a table, then one machine-readable JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fdeplb.placement import read_expert_load, rebalance_experts  # noqa: E402
from fdeplb.weights import (  # noqa: E402
    CheckpointReader,
    LiveExperts,
    plan_transfer,
    stage_experts,
    write_synthetic_checkpoint,
)

REAL_DATA = Path(os.environ.get("FDEPLB_REAL_DATA", REPO.parent / "shared" / "real_data")) / "dsv3_sglang_ep_stats"
DSV3 = {"hidden": 7168, "intermediate": 2048, "num_replicas": 288, "num_groups": 8, "num_nodes": 4, "num_gpus": 32}


def placements(old_file: str, new_file: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(old phy2log, new phy2log, num_logical_experts) of the DeepSeek-V3 drift pair."""
    topo = {k: DSV3[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    old_load = read_expert_load(REAL_DATA / old_file)
    new_load = read_expert_load(REAL_DATA / new_file)
    old = rebalance_experts(old_load.expert_load, **topo).phy2log
    new = rebalance_experts(new_load.expert_load, **topo).phy2log
    return np.asarray(old), np.asarray(new), old_load.num_logical_experts


def cluster_totals(old: np.ndarray, new: np.ndarray, ep_size: int) -> tuple[dict[str, int], list[int]]:
    """Plan counts summed over every rank, and each rank's disk count."""
    totals = {"keep": 0, "local": 0, "disk": 0}
    per_rank = []
    for rank in range(ep_size):
        counts = plan_transfer(old, new, rank, ep_size).counts
        per_rank.append(counts["disk"])
        for k, v in counts.items():
            totals[k] += v
    return totals, per_rank


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds of numpy.copyto of ``nbytes`` between two pre-faulted buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_swaps(live: LiveExperts, reader: CheckpointReader, old: np.ndarray, new: np.ndarray, repeats: int, device: str):
    """Swap old -> new and back ``repeats`` times; return the forward (old -> new) plans, stagings and reports."""
    out = []
    for _ in range(repeats):
        for src, dst, keep in ((old, new, True), (new, old, False)):
            plan = plan_transfer(src, dst, live.ep_rank, live.ep_size)
            staged = stage_experts(plan, reader, device=device)
            report = live.swap(plan, staged, dst)
            if keep:
                out.append((plan, staged.nbytes, staged.read_seconds, report))
            staged.release()
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="prefill_in1024.json")
    ap.add_argument("--new", default="decode_in1000out1000.json")
    ap.add_argument("--scale", type=int, default=8, help="divide DeepSeek-V3 hidden and intermediate sizes by this")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=None, help="EP rank to measure (default: the one reading most)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default=None, help="where to write the synthetic checkpoint (default: a temp dir)")
    args = ap.parse_args(argv)
    if not REAL_DATA.is_dir():
        print(f"real data not found at {REAL_DATA} (set FDEPLB_REAL_DATA)", file=sys.stderr)
        raise SystemExit(2)

    old, new, num_experts = placements(args.old, args.new)
    ep_size = DSV3["num_gpus"]
    totals, disk_per_rank = cluster_totals(old, new, ep_size)
    rank = int(np.argmax(disk_per_rank)) if args.rank is None else args.rank
    hidden, inter = DSV3["hidden"] // args.scale, DSV3["intermediate"] // args.scale
    per_rank = old.shape[1] // ep_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    needed = {(layer, int(e)) for p in (old, new) for layer in range(p.shape[0]) for e in p[layer, sl]}

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        write_synthetic_checkpoint(tmp, old.shape[0], num_experts, hidden=hidden, intermediate=inter,
                                   dtype=args.dtype, experts=needed, experts_per_shard=256)
        write_s = time.perf_counter() - t0
        reader = CheckpointReader(tmp)
        t0 = time.perf_counter()
        live = LiveExperts.from_checkpoint(reader, old, rank, ep_size, device=args.device)
        load_s = time.perf_counter() - t0
        runs = run_swaps(live, reader, old, new, args.repeats, args.device)
        verified, total = live.verify(reader)

    plan, staged_bytes, read_s, _ = runs[0]
    reports = [r for *_, r in runs]
    moved = reports[0].bytes_from_staging + reports[0].bytes_local + reports[0].bytes_snapshot
    copy_s = statistics.median(r.copy_seconds for r in reports)
    verify_s = statistics.median(r.verify_seconds for r in reports)
    memcpy_s = memcpy_seconds(moved, max(3, args.repeats))
    expert_nbytes = reader.expert_nbytes
    nbytes = plan.nbytes(expert_nbytes)
    result = {
        "benchmark": "swap",
        "device": args.device,
        "drift": f"{args.old} -> {args.new}",
        "topology": {k: DSV3[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")},
        "num_layers": int(old.shape[0]),
        "ep_rank": rank,
        "expert_shapes": {"hidden": hidden, "intermediate": inter, "dtype": args.dtype, "scale": args.scale},
        "expert_nbytes": expert_nbytes,
        "live_nbytes": live.nbytes,
        "counts": plan.counts,
        "disk_slots": plan.disk_slots,
        "snapshots": plan.num_snapshots,
        "cluster_counts": totals,
        "bytes_read_from_disk": nbytes["disk"],
        "bytes_copied_locally": nbytes["local"],
        "peak_staging_bytes": staged_bytes,
        "bytes_written_by_swap": moved,
        "stage_seconds": read_s,
        "swap_copy_seconds": copy_s,
        "swap_verify_seconds": verify_s,
        "memcpy_seconds": memcpy_s,
        "swap_gbps": moved / copy_s / 1e9,
        "memcpy_gbps": moved / memcpy_s / 1e9,
        "swap_vs_memcpy": memcpy_s / copy_s,
        "verify_gbps": moved / verify_s / 1e9 if verify_s else None,
        "slots_verified": verified,
        "slots_total": total,
        "checkpoint_write_seconds": write_s,
        "initial_load_seconds": load_s,
    }
    rows = [
        ("drift", result["drift"]),
        ("topology", "32 GPUs, 4 nodes, 288 slots (256 experts + 32 redundant), 58 MoE layers"),
        ("measured rank", f"{rank} (reads most; cluster max disk experts {max(disk_per_rank)})"),
        ("expert", f"{mib(expert_nbytes)} ({args.dtype}, DeepSeek-V3 shapes / {args.scale})"),
        ("live slots on rank", f"{per_rank * old.shape[0]} ({mib(live.nbytes)})"),
        ("keep / local / disk", f"{plan.counts['keep']} / {plan.counts['local']} / {plan.counts['disk']} "
                                f"(disk slots {plan.disk_slots}, snapshots {plan.num_snapshots})"),
        ("cluster keep / local / disk", f"{totals['keep']} / {totals['local']} / {totals['disk']}"),
        ("bytes read from disk", mib(nbytes["disk"])),
        ("bytes copied locally", mib(nbytes["local"])),
        ("peak staging", mib(staged_bytes)),
        ("bytes written by swap", mib(moved)),
        ("stage (read+checksum)", f"{read_s * 1e3:,.1f} ms (page cache)"),
        ("swap copy", f"{copy_s * 1e3:,.1f} ms = {result['swap_gbps']:.2f} GB/s"),
        ("memcpy same bytes", f"{memcpy_s * 1e3:,.1f} ms = {result['memcpy_gbps']:.2f} GB/s"),
        ("swap / memcpy", f"{result['swap_vs_memcpy']:.0%}"),
        ("verify changed slots", f"{verify_s * 1e3:,.1f} ms (CRC-32)"),
        ("all slots verified", f"{verified} / {total}"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
