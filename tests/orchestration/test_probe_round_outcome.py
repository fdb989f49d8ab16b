"""The outcome of a round whose swap failed its output probe (``reasons.round_outcome``: ``probe_mismatch``, never
"rearranged"), and ``fdeplb rearrange --wait`` on one: exit 4 (a weights error) naming the ranks, layers and the
rollback round, so a script gating on the exit code does not take a swap that broke the model's outputs for a
success (a QA finding: it exited 0 "rearranged")."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fdeplb.api.prometheus import ClusterCollector
from fdeplb.recording import audit_dict
from fdeplb.rounds import reasons
from fdeplb.rounds.reasons import RoundOutcome, round_outcome
from fdeplb.ui.view_model import timeline
from tests.orchestration.helpers import probed_cluster

MISMATCH = reasons.probe_mismatch([{"ep_rank": 1, "outcome": "mismatch", "layers": [3], "message": "layer 3: x"}])
RELEASED = {"from": "DONE", "to": "FREE", "trigger": "release", "reason": "", "round": "5"}


def test_a_swap_whose_probe_failed_is_a_probe_mismatch_naming_its_rollback():
    outcome, reason = round_outcome(RELEASED, {"trigger": "swapped", "reason": MISMATCH.text})
    assert outcome is RoundOutcome.PROBE_MISMATCH
    assert reason.startswith("rank 1 layers [3] (layer 3: x); rollback: round 6 goes back"), reason


def test_a_rollback_whose_probe_failed_again_is_not_rolled_back_once_more():
    load = {"trigger": "load", "detail": json.dumps(reasons.supplied_round("rollback", 4, "p0", "probe_mismatch")
                                                    .detail)}
    outcome, reason = round_outcome(RELEASED, {"trigger": "swapped", "reason": MISMATCH.text}, load)
    assert outcome is RoundOutcome.PROBE_MISMATCH
    assert "rollback of round 4: not rolled back again" in reason and "round 6" not in reason


@pytest.mark.parametrize("swapped", [None, {"trigger": "swapped", "reason": ""}])
def test_a_swap_whose_probes_agreed_or_are_unknown_is_rearranged(swapped):
    assert round_outcome(RELEASED, swapped) == (RoundOutcome.REARRANGED, "")


@pytest.mark.slow  # a thread cluster


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
        assert done.returncode == 4, (done.returncode, said)  # a weights error (fdeplb.errors.ERROR_TABLE)
        assert "round 1: probe_mismatch: rank 1 layers [0]" in said and "rollback: round 2 goes back" in said, said
        store = tc.store()  # /ui's timeline and /metrics read the same outcome
        records = [audit_dict(a) for a in store.iter_audit()]
        rounds = timeline(records, store.read_config(), now_ms=int(records[-1]["ts_ms"]))["rounds"]
        assert [r["outcome"] for r in rounds if r["round"] == 1] == ["probe_mismatch"]
        families = {f.name: f for f in ClusterCollector(store).collect()}
        assert families["fdeplb_rounds_probe_mismatch"].samples[0].value >= 1  # round 1 (its rollback may also fail)
