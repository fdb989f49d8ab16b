"""benchmarks/control_plane.py runs end to end on a tiny cluster (2 ranks, 2 rounds): the script a reader runs to
check the control-plane figures must not break silently. Its numbers are not asserted (speed is the
script's own business); its JSON line's shape and the accounting that backs its conclusions are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.helpers import wait_for
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.slow  # every test runs benchmarks/control_plane.py as a process

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane.py"


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


def run_script(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=180,
                          **kwargs)


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--ranks", "2", "1"], ["--rounds", "0"], ["--layers", "-1"]])
def test_control_plane_benchmark_refuses_odd_arguments_in_one_line(argv):
    """A rank count below 2 (one rank is always balanced: every round a skip) or a count below 1 is a usage error,
    exit 2, before anything starts (it was a ZeroDivisionError, an UnboundLocalError or a failed round)."""
    out = run_script(*argv)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"control_plane.py: error: {argv[0]}")


def test_control_plane_benchmark_unreachable_redis_is_one_line_and_exit_7():
    out = run_script("--ranks", "2", "--rounds", "2", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert out.returncode == 7 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "is unavailable" in out.stderr.strip().splitlines()[-1]


def test_control_plane_benchmark_redis_lost_mid_run_stops_every_process_and_says_why(tmp_path):
    """Redis dies while rounds run: the script reports that error (not one from its clean-up, which used to hide
    it), exits 7, and leaves no agent process behind (they now see the stop while Redis is away)."""
    server = RedisServer(tmp_path / "redis")
    try:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--ranks", "2", "--rounds", "100000", "--redis-url",
                                 server.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            client = redis.Redis.from_url(server.url)

            def rounds_through() -> bool:  # a few rounds are through: agents and coordinator are at work
                assert proc.poll() is None, "the benchmark stopped before Redis did"
                audits = list(client.scan_iter(match="fdeplb:{cp-2-*}:audit"))
                return bool(audits) and client.xlen(audits[0]) >= 40

            wait_for(rounds_through, 120, what="the benchmark's first rounds")
            server.kill()
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 7 and "Traceback" not in stderr, stderr[-3000:]
        assert "is unavailable" in stderr.strip().splitlines()[-1]
        with pytest.raises(ProcessLookupError):  # nothing is left in the script's process group
            os.killpg(proc.pid, 0)
    finally:
        server.close()
