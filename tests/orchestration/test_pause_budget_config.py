"""the pause budget of a cluster when init-cluster meets an existing cluster."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.errors import StateError
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Store
from tests.helpers import run_cli

BASE = dict(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3)
PHY2LOG = np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64)


@pytest.mark.parametrize("kw", [dict(max_pause_bytes=2000), dict(layers_per_safe_point=3)],
                         ids=["max_pause_bytes", "layers_per_safe_point"])
def test_init_cluster_refuses_another_pause_budget_for_an_existing_cluster(redis_url, cluster_id, kw):
    """init_cluster's contract: an existing cluster with other settings is refused with StateError naming each
    difference. The pause budget is left out of the comparison (_compared uses flat_settings, i.e. SETTABLE, which
    does not hold it): asking for another budget returns False ("exists already, left as it is") and the cluster
    keeps its old one, which `fdeplb config set` cannot change either."""
    store = Store(redis_url, cluster_id)
    try:
        assert init_cluster(store, ClusterConfig(**BASE, max_pause_bytes=1000), PHY2LOG)
        with pytest.raises(StateError, match=next(iter(kw))):
            init_cluster(store, ClusterConfig(**{**BASE, "max_pause_bytes": 1000, **kw}), PHY2LOG)
    finally:
        store.delete_cluster()


def test_init_cluster_cli_exits_non_zero_for_another_pause_budget(redis_url, cluster_id, capsys, tmp_path):
    from fdeplb.weights import write_synthetic_checkpoint

    ckpt = str(write_synthetic_checkpoint(tmp_path / "ckpt", 2, 8))
    args = ("init-cluster", "--redis-url", redis_url, "--cluster", cluster_id, "--num-layers", "2",
            "--num-logical-experts", "8", "--num-redundant-experts", "4", "--ep-size", "4", "--checkpoint", ckpt)
    try:
        code, out, _ = run_cli(capsys, *args, "--max-pause-bytes", "1000")
        assert code == 0 and "created" in out
        code, out, err = run_cli(capsys, *args, "--max-pause-bytes", "2000")
        assert code != 0 and "max_pause_bytes" in err, f"exit {code}: {out.strip()}"
    finally:
        Store(redis_url, cluster_id).delete_cluster()
    assert Store(redis_url, cluster_id).key_count() == 0
