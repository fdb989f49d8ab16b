"""``fdeplb demo`` end to end: real Redis, one OS process per rank, a real DeepSeek-V3 dump."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("paddle")


@pytest.mark.slow
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
    assert summary["experts_loaded_from_disk"] <= summary["slots_from_disk"]
    # 7 cluster transitions + 5 per rank
    assert summary["audit_records"] == 7 + 5 * 4
    assert "DONE -> FREE" in proc.stdout and "verified     16704/16704" in proc.stdout
    # the demo's recording replays with no Redis (the demo's own cluster is deleted by now); tampering is exit 1
    replay = [sys.executable, "-m", "fdeplb", "replay", str(recording)]
    proc = subprocess.run(replay, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "chain verified over 27 records, 1 plans recomputed and identical" in proc.stdout
    lines = recording.read_text().splitlines()
    recording.write_text("\n".join(lines[:5] + lines[6:]) + "\n")  # one record dropped
    proc = subprocess.run(replay, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "error: line 6 " in proc.stderr, proc.stderr[-2000:]


def test_demo_bad_trace_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "fdeplb", "demo", "--trace", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad.json" in proc.stderr
