"""GPU swap benchmark: host-to-device swap throughput against a raw host-to-device copy of the same bytes.

Same drift pair, topology and synthetic checkpoint as benchmarks/swap.py (DeepSeek-V3 prefill -> decode placements,
expert shapes divided by --scale), with the live experts on a CUDA device and staging in pinned host memory. The
baseline is one pinned-host-to-device copy (paddle ``Tensor.copy_``) of the bytes the swap moves from staging,
measured in the same run; the target is a swap at >= 80% of it. The swap also does its device-to-device local copies
inside the timed region, so the ratio is slightly pessimistic.

Also the pauses of benchmarks/swap.py on the device: the same plan at one safe point and in chunks
within the default pause budget, each chunk's experts moved to the device buffer before its step, so the pause is a
device-to-device copy checked on the device; ``pause_vs_memcpy`` against a device-to-device copy of each pause's
bytes.

Needs a CUDA build of paddle (paddlepaddle-gpu) and a visible GPU; without one it prints why and exits 0. Not run in
CI.

    python benchmarks/swap_gpu.py [--scale 4] [--dtype bfloat16] [--repeats 5] [--device gpu:0]

Prints a table, then one machine-readable JSON line (the last line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import swap as cpu_bench  # benchmarks/swap.py (same folder): drift pair, checkpoint, swap loop; puts the repo on sys.path


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


class RawH2DBaseline(cpu_bench.MemcpyBaseline):
    """One pinned-host -> device copy (paddle ``copy_``, then synchronize) of the bytes the swap moved from staging."""

    def __init__(self, device: str) -> None:
        self.device = device

    def nbytes(self, report) -> int:
        return report.bytes_from_staging

    def allocate(self, nbytes: int) -> None:
        import paddle

        self.host = paddle.ones([nbytes], dtype="uint8").pin_memory()
        paddle.device.set_device(self.device)
        self.dev = paddle.empty([nbytes], dtype="uint8")

    def copy(self) -> None:
        import paddle

        self.dev.copy_(self.host, False)
        paddle.device.synchronize(self.device)


class D2DMemcpy:
    """A plain device-to-device copy (paddle ``copy_``, then synchronize) of any byte count up to the largest asked
    for: the baseline of one pause on the device."""

    def __init__(self, device: str) -> None:
        self.device, self.size = device, 0

    def __call__(self, nbytes: int) -> float:
        import time

        import paddle

        if nbytes > self.size:
            paddle.device.set_device(self.device)
            self.src, self.dst, self.size = paddle.ones([nbytes], dtype="uint8"), paddle.ones([nbytes], "uint8"), nbytes
        src, dst = self.src[:nbytes], self.dst[:nbytes]
        dst.copy_(src, False)
        paddle.device.synchronize(self.device)
        t0 = time.perf_counter()
        dst.copy_(src, False)
        paddle.device.synchronize(self.device)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    args = cpu_bench.parser(__doc__, scale=4, device="gpu:0").parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"swap_gpu: skipped, {reason}.")
        result = {"benchmark": "swap_gpu", "skipped": reason}
        print(json.dumps(result, sort_keys=True))
        return result

    m = cpu_bench.measure(args, RawH2DBaseline(args.device), D2DMemcpy(args.device))
    plan, first = m.plan, m.reports[0]
    h2d_bytes = first.bytes_from_staging
    copy_s, verify_s, raw_s = m.copy_seconds, m.verify_seconds, m.baseline
    result = {
        **cpu_bench.common_fields("swap_gpu", args, m),
        "h2d_bytes": h2d_bytes,
        "d2d_bytes": first.bytes_local + first.bytes_snapshot,
        "raw_h2d_seconds": raw_s,
        "swap_h2d_gbps": h2d_bytes / copy_s / 1e9,
        "raw_h2d_gbps": h2d_bytes / raw_s / 1e9,
        "swap_vs_raw_h2d": raw_s / copy_s,
        "target": 0.8,
    }
    counts = plan.counts
    rows = [
        ("drift", result["drift"]),
        ("device / rank", f"{args.device} / {m.rank}"),
        ("expert", f"{cpu_bench.mib(m.expert_nbytes)} ({args.dtype}, DeepSeek-V3 shapes / {args.scale})"),
        ("keep / local / disk", f"{counts['keep']} / {counts['local']} / {counts['disk']}"),
        ("host -> device bytes", f"{cpu_bench.mib(h2d_bytes)} (pinned staging)"),
        ("swap copy", f"{copy_s * 1e3:,.1f} ms = {result['swap_h2d_gbps']:.2f} GB/s"),
        ("raw H2D same bytes", f"{raw_s * 1e3:,.1f} ms = {result['raw_h2d_gbps']:.2f} GB/s"),
        ("swap / raw H2D", f"{result['swap_vs_raw_h2d']:.0%} (target >= 80%)"),
        ("verify changed slots", f"{verify_s * 1e3:,.1f} ms (device -> host + CRC-32)"),
        ("all slots verified", f"{m.slots_verified} / {m.slots_total}"),
        *cpu_bench.pause_rows(m, result),
    ]
    result["pause_targets"] = cpu_bench.pause_targets(result)
    cpu_bench.print_table(rows, result)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
