"""The replay reads a swap's probe_mismatch from its detail: the text must be the one the detail gives and the ranks
must be the cluster's (records committed through the real commit script, so only these checks can catch them)."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.rounds import reasons
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.recording import export_recording
from fdeplb.replay import ReplayError, replay_file
from fdeplb.store import ClusterConfig, Store
from tests.replay.helpers import fire_round

MISMATCH = reasons.probe_mismatch([{"ep_rank": 0, "outcome": "mismatch", "layers": [0], "message": "layer 0: x"}])


def _replayed(redis_url, cluster_id, tmp_path, swapped):
    """Fire one round whose cluster ``swapped`` says ``swapped``, export it (with its header: the cluster's ranks)
    and replay the recording."""
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=1),
                 np.arange(4, dtype=np.int64).reshape(1, 4))
    try:
        fire_round(store, swapped)
        export_recording(store, tmp_path / "audit.jsonl")
        return replay_file(tmp_path / "audit.jsonl")
    finally:
        store.delete_cluster()


def test_a_probe_mismatch_replays(redis_url, cluster_id, tmp_path):
    report = _replayed(redis_url, cluster_id, tmp_path, {"reason": MISMATCH.text, "detail": MISMATCH.detail})
    assert report.final["cluster"].state == "FREE"


@pytest.mark.parametrize("swapped, message", [
    ({"reason": MISMATCH.text + "!", "detail": MISMATCH.detail}, "is not what its detail says"),
    ({"reason": reasons.probe_mismatch([{"ep_rank": 3, "outcome": "failed", "layers": [], "message": "E"}]).text,
      "detail": reasons.probe_mismatch([{"ep_rank": 3, "outcome": "failed", "layers": [], "message": "E"}]).detail},
     r"probe_mismatch names ranks \[3\]; the cluster has ranks 0..0"),
    ({"reason": "probe_mismatch: ?", "detail": {"probe_mismatch": [{"ep_rank": 0, "outcome": "mismatch",
                                                                    "layers": ["one"], "message": ""}]}},
     "detail is not what a swapped record carries"),
])
def test_a_forged_probe_mismatch_fails_naming_the_line(redis_url, cluster_id, tmp_path, swapped, message):
    with pytest.raises(ReplayError, match=r"line \d+ .*" + message):
        _replayed(redis_url, cluster_id, tmp_path, swapped)
