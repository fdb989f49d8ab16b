"""benchmarks/control_plane.py runs end to end on a tiny cluster (2 ranks, 2 rounds): the script a reader runs to
check issue #9's control-plane figures must not break silently. Its numbers are not asserted (speed is the
script's own business); its JSON line's shape and the accounting that backs its conclusions are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "control_plane.py"


@pytest.mark.parametrize("agents", ["processes", "threads"])
def test_control_plane_benchmark_prints_rounds_and_their_cpu(redis_url, agents):
    out = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--rounds", "2", "--agents", agents,
                          "--redis-url", redis_url], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("| 2 | 66 |") for line in lines), out.stdout  # the table's row for 2 ranks
    result = json.loads(lines[-1])
    assert result["benchmark"] == "control_plane" and result["ranks"] == 2
    assert result["target_ok"] is None  # the target is stated at 64 ranks only
    run = result["runs"][0]
    assert run["agents"] == agents and run["rounds"] == 2
    assert set(run["phase_ms"]) == {"collect", "plan", "load", "commit", "swap", "release"}
    assert run["redis_commands_per_round"] > 0 and run["tail_ms"] >= 0
    cpu, floor = run["cpu_ms_per_round"], run["floor_cpu_ms_per_round"]
    # every part was metered: agents (shared memory or thread clocks), the coordinator's thread, the server
    assert cpu["agents"] > 0 and cpu["coordinator"] > 0 and cpu["redis"] > 0
    assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"), abs=0.2)
    assert floor["agents"] > 0 and floor["coordinator"] == 0
    assert result["cpu_ms_per_round"] == cpu["total"] and result["floor_cpu_ms_per_round"] == floor["total"]
