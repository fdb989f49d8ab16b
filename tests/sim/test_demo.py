"""``fdeplb demo`` end to end: real Redis, one OS process per rank, a real DeepSeek-V3 dump."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # every test runs `fdeplb demo` processes

pytest.importorskip("paddle")


def test_demo_cli_four_ranks_on_real_dump(real_data, redis_url, tmp_path):
    trace = real_data / "dsv3_sglang_ep_stats" / "decode_in1000out1000.json"
    recording = tmp_path / "run.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "fdeplb", "demo", "--trace", str(trace), "--ranks", "4", "--json",
         "--redis-url", redis_url, "--timeout", "120", "--export-audit", str(recording)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_state"] == "FREE" and summary["done_then_free"]
    assert summary["rounds"] == 1
    assert summary["slots_total"] == 58 * 288
    assert summary["slots_verified"] == summary["slots_total"]
    assert summary["balancedness_after"] > summary["balancedness_before"]
    assert summary["moved_experts"] > 0
    # every slot is kept, copied locally or written from staging (an expert read once may fill two slots)
    assert (summary["experts_kept"] + summary["experts_copied_locally"] + summary["slots_from_disk"]
            == summary["slots_total"])
    assert summary["experts_loaded_from_disk"] + summary["experts_from_peers"] <= summary["slots_from_disk"]
    # every moved expert is live on another rank: taken from peers, none read from disk
    assert summary["peer_bytes"] > 0 and summary["experts_from_peers"] > 0 and summary["disk_bytes"] == 0
    # 7 cluster transitions + 5 per rank
    assert summary["audit_records"] == 7 + 5 * 4
    assert "DONE -> FREE" in proc.stdout and "verified     16704/16704" in proc.stdout
    assert summary["outcome"] == "rearranged" and summary["reason"] == ""
    # the moved line adds up, with the JSON's numbers
    assert (f"{summary['slots_from_disk']} written from staging + {summary['experts_copied_locally']} copied locally + "
            f"{summary['experts_kept']} kept = {summary['slots_total']}") in proc.stdout
    # the demo's recording replays with no Redis (the demo's own cluster is deleted by now); tampering is exit 1
    replay = [sys.executable, "-m", "fdeplb", "replay", str(recording)]
    proc = subprocess.run(replay, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "chain verified over 27 records, 1 plans recomputed and identical" in proc.stdout
    lines = recording.read_text().splitlines()
    recording.write_text("\n".join(lines[:5] + lines[6:]) + "\n")  # one record dropped
    proc = subprocess.run(replay, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "error: line 6 " in proc.stderr, proc.stderr[-2000:]


def demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fdeplb", "demo", *args]


def test_demo_without_trace_or_shared_runs_on_the_bundled_dump(tmp_path):
    """A plain clone: run from a directory with no ../shared; the bundled DeepSeek-V3 dump is the trace."""
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(demo_cmd("--ranks", "2", "--json", "--timeout", "120"), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["trace"] == "bundled:decode_in1000out1000.json"
    assert summary["outcome"] == "rearranged"
    assert summary["slots_total"] == 58 * 288 and summary["slots_verified"] == summary["slots_total"]
    assert "ranks ready 2/2" in proc.stdout


def test_all_zero_trace_is_a_skip_with_its_reason(tmp_path, redis_url):
    zeros = tmp_path / "zeros.json"
    zeros.write_text(json.dumps({"counts": [[0] * 16] * 2}))
    proc = subprocess.run(demo_cmd("--trace", str(zeros), "--ranks", "2", "--json", "--redis-url", redis_url),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["outcome"] == "skipped"
    assert summary["reason"].startswith("planned gain 0.0000 <= min_gain 0.0")
    assert summary["slots_verified"] == summary["slots_total"] == 2 * 18  # the live (initial) placement
    assert "outcome      skipped: planned gain 0.0000 <= min_gain 0.0" in proc.stdout


def test_demo_refuses_more_ranks_than_the_machine_holds():
    proc = subprocess.run(demo_cmd("--ranks", "1000"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--ranks 1000" in proc.stderr and "at most" in proc.stderr


def test_demo_refuses_an_export_into_a_missing_folder_before_running(tmp_path):
    """Not after a whole round: nothing is started, nothing printed on stdout."""
    target = tmp_path / "missing" / "run.jsonl"
    proc = subprocess.run(demo_cmd("--ranks", "2", "--export-audit", str(target)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--export-audit {target}: folder {target.parent} does not exist" in proc.stderr


def start_demo_until_ranks_ready(tmp_path) -> tuple[subprocess.Popen, list, Path]:
    """A demo with its own TMPDIR, read until both ranks are ready; returns it, its descendants and TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    small = tmp_path / "small.json"  # a small trace: a small checkpoint, a quick start
    small.write_text(json.dumps({"counts": [[(7 * i + 3 * e) % 11 + 1 for e in range(16)] for i in range(2)]}))
    proc = subprocess.Popen(demo_cmd("--ranks", "2", "--trace", str(small)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))
    for line in proc.stdout:
        if line.startswith("ranks ready 2/2"):
            break
    else:
        pytest.fail(f"demo ended before its ranks were ready: {proc.wait()} {proc.stderr.read()[-3000:]}")
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert {k.name() for k in kids} >= {"redis-server", "python"} and os.listdir(tmp)
    return proc, kids, tmp


def assert_nothing_left(kids: list, tmp: Path) -> None:
    _, alive = psutil.wait_procs(kids, timeout=10)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running 10 s later: {alive}"
    assert os.listdir(tmp) == []


def test_sigkill_of_the_demo_leaves_no_process_and_no_temp_dir(tmp_path):
    proc, kids, tmp = start_demo_until_ranks_ready(tmp_path)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert_nothing_left(kids, tmp)


def test_two_sigterms_stop_the_demo_once_and_cleanly(tmp_path):
    proc, kids, tmp = start_demo_until_ranks_ready(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # during the clean-up: ignored, the clean-up completes
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    err = proc.stderr.read()
    assert err.strip().splitlines()[-1].startswith("fdeplb demo: interrupted by SIGTERM"), err[-3000:]
    assert_nothing_left(kids, tmp)


def test_demo_bad_trace_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "fdeplb", "demo", "--trace", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad.json" in proc.stderr


def test_sigkill_of_a_demo_on_an_external_redis_leaves_none_of_its_keys(tmp_path, redis_url):
    """``fdeplb demo --redis-url``: the reaper deletes the cluster's keys however the demo ends, SIGKILL too."""
    import redis as redis_py

    small = tmp_path / "small.json"
    small.write_text(json.dumps({"counts": [[(7 * i + 3 * e) % 11 + 1 for e in range(16)] for i in range(2)]}))
    proc = subprocess.Popen(demo_cmd("--ranks", "2", "--trace", str(small), "--redis-url", redis_url),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cluster = None
    for line in proc.stdout:
        if line.startswith("redis "):
            cluster = line.rsplit("cluster ", 1)[1].strip()
        if line.startswith("ranks ready 2/2"):
            break
    assert cluster, proc.stderr.read()[-2000:]
    client = redis_py.Redis.from_url(redis_url)
    pattern = f"fdeplb:[{{]{cluster}[}}]:*"
    assert list(client.scan_iter(match=pattern))
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while list(client.scan_iter(match=pattern)):
        assert time.monotonic() < deadline, "the demo's keys are still there 30 s after its SIGKILL"
        time.sleep(0.1)
