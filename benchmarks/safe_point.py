"""Cost of a no-op ``at_safe_point()`` (nothing to apply: the common case, once per forward step) and of
``record()`` on a DeepSeek-V3-sized [58, 256] int32 count array, against an empty Python method call measured in the
same run. Target: no-op at_safe_point < 20 us. Also the cost of one *armed* safe point (a rank with a change pending:
one ``lua/switch.lua`` call, :meth:`fdeplb.store.Store.arm_switch`) on an embedded Redis over a unix socket, paid
only between a rank's staging and its switch step. Prints a table and a last JSON line.

    PYTHONPATH=. python benchmarks/safe_point.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

# benchmarks/transitions.py would shadow the `transitions` package: drop this folder from the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.load_window import ExpertLoadWindow
from fdeplb.orchestration.safe_points import SafePointSwitch


class _Backend:
    cleared = False
    phy2log = np.zeros((58, 288), np.int64)


def _per_call_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    agent = RankAgent.__new__(RankAgent)  # the worker-side state only: no Redis needed for the no-op path
    agent.switch = SafePointSwitch(None, 0, "bench", None, safe_points=True, switch_margin_steps=1,
                                   applied=lambda: None)
    agent.backend, agent._live_phy2log = _Backend(), _Backend.phy2log
    agent.window = ExpertLoadWindow(58, 256, steps=1000)

    class Empty:
        def call(self) -> bool:
            return False

    empty = Empty()
    baseline = _per_call_us(empty.call, 200_000)
    noop = _per_call_us(agent.at_safe_point, 200_000)
    counts = np.random.default_rng(0).integers(0, 1000, (58, 256)).astype(np.int32)
    physical = np.random.default_rng(0).integers(0, 1000, (58, 288)).astype(np.int32)
    rec = _per_call_us(lambda: agent.record(counts), 2_000)
    rec_phy = _per_call_us(lambda: agent.record(physical), 500)
    armed = _armed_us()
    rows = [("empty method call (baseline)", baseline), ("at_safe_point, nothing to apply", noop),
            ("record [58, 256] int32 logical", rec), ("record [58, 288] int32 physical (folded)", rec_phy),
            ("armed safe point (arm_switch, 8 ranks)", armed)]
    print(f"{'operation':<44}{'us/call':>10}")
    for name, us in rows:
        print(f"{name:<44}{us:>10.3f}")
    print(json.dumps({"at_safe_point_noop_us": round(noop, 3), "baseline_call_us": round(baseline, 3),
                      "ratio_vs_baseline": round(noop / baseline, 2), "record_logical_us": round(rec, 1),
                      "record_physical_us": round(rec_phy, 1), "armed_safe_point_us": round(armed, 1),
                      "target_us": 20, "ok": noop < 20}))


def _armed_us() -> float:
    """One armed safe point's Redis call (waiting for the other ranks: the common armed case), us."""
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import ClusterConfig, EmbeddedRedis, Store

    with EmbeddedRedis() as server:
        store = Store(server.url, "bench-safe-point")
        init_cluster(store, ClusterConfig(num_layers=58, num_logical_experts=256, num_physical_experts=288,
                                          ep_size=8), initial_placement(58, 256, 288).phy2log)
        n = store.request_weights("clear", "bench")
        step = iter(range(10**9))
        us = _per_call_us(lambda: store.arm_switch(0, f"weights:{n}", next(step), "weights_switch_step",
                                                   {"weights_request": n}), 500)
        store.close()
        return us


if __name__ == "__main__":
    main()
