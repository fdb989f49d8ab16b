"""GPU swap benchmark: host-to-device swap throughput against a raw host-to-device copy of the same bytes.

Same drift pair, topology and synthetic checkpoint as benchmarks/swap.py (DeepSeek-V3 prefill -> decode placements,
expert shapes divided by --scale), with the live experts on a CUDA device and staging in pinned host memory. The
baseline is one pinned-host-to-device copy (paddle ``Tensor.copy_``) of the bytes the swap moves from staging,
measured in the same run; the target is a swap at >= 80% of it. The swap also does its device-to-device local copies
inside the timed region, so the ratio is slightly pessimistic.

Needs a CUDA build of paddle (paddlepaddle-gpu) and a visible GPU; without one it prints why and exits 0. Not run in
CI.

    python benchmarks/swap_gpu.py [--scale 4] [--dtype bfloat16] [--repeats 3] [--device gpu:0]

Prints a table, then one machine-readable JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np

import swap as cpu_bench  # benchmarks/swap.py: placements, drift pair, swap loop (same folder)
from fdeplb.weights import CheckpointReader, LiveExperts, write_synthetic_checkpoint


def no_gpu_reason() -> str | None:
    """Why no GPU run is possible here, or None."""
    try:
        import paddle
    except ImportError:
        return "paddle is not installed (pip install 'fdeplb[paddle]', or paddlepaddle-gpu for GPUs)"
    if not paddle.is_compiled_with_cuda():
        return f"paddle {paddle.__version__} is a CPU build (install paddlepaddle-gpu from Paddle's index)"
    if paddle.device.cuda.device_count() < 1:
        return "paddle sees no CUDA device"
    return None


def raw_h2d_seconds(nbytes: int, device: str, repeats: int) -> float:
    """Median seconds of one pinned-host -> device copy of ``nbytes`` (paddle copy_, then synchronize)."""
    import paddle

    host = paddle.ones([nbytes], dtype="uint8").pin_memory()
    paddle.device.set_device(device)
    dev = paddle.empty([nbytes], dtype="uint8")
    dev.copy_(host, False)
    paddle.device.synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev.copy_(host, False)
        paddle.device.synchronize(device)
        times.append(time.perf_counter() - t0)
    del host, dev
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="prefill_in1024.json")
    ap.add_argument("--new", default="decode_in1000out1000.json")
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="gpu:0")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    reason = no_gpu_reason()
    if reason is not None:
        print(f"swap_gpu: skipped, {reason}.")
        result = {"benchmark": "swap_gpu", "skipped": reason}
        print(json.dumps(result, sort_keys=True))
        return result

    old, new, num_experts = cpu_bench.placements(args.old, args.new)
    ep_size = cpu_bench.DSV3["num_gpus"]
    _, disk_per_rank = cpu_bench.cluster_totals(old, new, ep_size)
    rank = int(np.argmax(disk_per_rank)) if args.rank is None else args.rank
    hidden, inter = cpu_bench.DSV3["hidden"] // args.scale, cpu_bench.DSV3["intermediate"] // args.scale
    per_rank = old.shape[1] // ep_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    needed = {(layer, int(e)) for p in (old, new) for layer in range(p.shape[0]) for e in p[layer, sl]}

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        write_synthetic_checkpoint(tmp, old.shape[0], num_experts, hidden=hidden, intermediate=inter,
                                   dtype=args.dtype, experts=needed, experts_per_shard=256)
        reader = CheckpointReader(tmp)
        live = LiveExperts.from_checkpoint(reader, old, rank, ep_size, device=args.device)
        runs = cpu_bench.run_swaps(live, reader, old, new, args.repeats, args.device)
        verified, total = live.verify(reader)

    plan, staged_bytes, read_s, _ = runs[0]
    reports = [r for *_, r in runs]
    h2d_bytes = reports[0].bytes_from_staging
    copy_s = statistics.median(r.copy_seconds for r in reports)
    verify_s = statistics.median(r.verify_seconds for r in reports)
    raw_s = raw_h2d_seconds(h2d_bytes, args.device, max(3, args.repeats))
    result = {
        "benchmark": "swap_gpu",
        "device": args.device,
        "drift": f"{args.old} -> {args.new}",
        "ep_rank": rank,
        "expert_nbytes": reader.expert_nbytes,
        "expert_shapes": {"hidden": hidden, "intermediate": inter, "dtype": args.dtype, "scale": args.scale},
        "counts": plan.counts,
        "disk_slots": plan.disk_slots,
        "peak_staging_bytes": staged_bytes,
        "h2d_bytes": h2d_bytes,
        "d2d_bytes": reports[0].bytes_local + reports[0].bytes_snapshot,
        "stage_seconds": read_s,
        "swap_copy_seconds": copy_s,
        "swap_verify_seconds": verify_s,
        "raw_h2d_seconds": raw_s,
        "swap_h2d_gbps": h2d_bytes / copy_s / 1e9,
        "raw_h2d_gbps": h2d_bytes / raw_s / 1e9,
        "swap_vs_raw_h2d": raw_s / copy_s,
        "target": 0.8,
        "slots_verified": verified,
        "slots_total": total,
    }
    rows = [
        ("drift", result["drift"]),
        ("device / rank", f"{args.device} / {rank}"),
        ("expert", f"{reader.expert_nbytes / 2**20:.1f} MiB ({args.dtype}, DeepSeek-V3 shapes / {args.scale})"),
        ("keep / local / disk", f"{plan.counts['keep']} / {plan.counts['local']} / {plan.counts['disk']}"),
        ("host -> device bytes", f"{h2d_bytes / 2**20:,.1f} MiB (pinned staging)"),
        ("swap copy", f"{copy_s * 1e3:,.1f} ms = {result['swap_h2d_gbps']:.2f} GB/s"),
        ("raw H2D same bytes", f"{raw_s * 1e3:,.1f} ms = {result['raw_h2d_gbps']:.2f} GB/s"),
        ("swap / raw H2D", f"{result['swap_vs_raw_h2d']:.0%} (target >= 80%)"),
        ("verify changed slots", f"{verify_s * 1e3:,.1f} ms (device -> host + CRC-32)"),
        ("all slots verified", f"{verified} / {total}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
