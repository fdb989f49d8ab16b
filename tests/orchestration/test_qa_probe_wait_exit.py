"""QA finding: ``fdeplb rearrange --wait`` exits 0 with "round N: rearranged ... (gain ...)" for a round whose swap
failed its output probe (audited ``probe_mismatch``, ``/health`` 503, rolled back by the next round): a script
gating on the exit code takes a swap that broke the model's outputs for a success. Expected: a non-zero exit and a
message naming the probe mismatch (and the rollback)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.orchestration.helpers import probed_cluster

pytestmark = pytest.mark.slow  # a thread cluster


def test_rearrange_wait_does_not_report_success_for_a_round_whose_probe_mismatched(redis_url, cluster_id, tmp_path):
    calls = {r: 0 for r in range(4)}

    def probe_of(r):
        def probe():  # rank 1's outputs change with every call: its swap's probe mismatches
            calls[r] += 1
            return {0: np.full(3, float(calls[r]) if r == 1 else 1.0, np.float32)}
        return probe

    with probed_cluster(redis_url, cluster_id, tmp_path, probe_of) as tc:
        done = subprocess.run([sys.executable, "-m", "fdeplb", "rearrange", "--redis-url", redis_url, "--cluster",
                               cluster_id, "--wait", "--timeout", "60"], capture_output=True, text=True, timeout=120)
        swapped = [a for a in tc.store().iter_audit() if a["machine"] == "cluster" and a["trigger"] == "swapped"]
        assert swapped and "probe_mismatch" in swapped[0]["reason"]  # the round's swap did mismatch
        said = done.stdout + done.stderr
        assert done.returncode != 0 and "probe" in said, (done.returncode, said)
