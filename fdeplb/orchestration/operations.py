"""Cluster set-up: what an operator (CLI, API, demo) does to create a cluster before anything runs it."""

from __future__ import annotations

import numpy as np

from fdeplb.errors import TopologyError
from fdeplb.placement import check_phy2log
from fdeplb.store import ClusterConfig, Store


def init_cluster(store: Store, config: ClusterConfig, initial_phy2log: np.ndarray) -> bool:
    """Create a cluster: its configuration, initial placement, and a record per machine (cluster FREE, every
    rank IDLE, every weight status NORMAL), all at version 0, in one MULTI/EXEC (a crash leaves all or nothing).

    Idempotent: an existing cluster is left as it is (returns False); a different topology for an existing
    cluster is refused with :class:`TopologyError`. ``initial_phy2log`` is int [num_layers, num_physical_experts]
    holding expert ids in [0, num_logical_experts) (:class:`InputError` otherwise; nothing is written then).
    """
    phy2log = check_phy2log(initial_phy2log, config.num_logical_experts, name="initial phy2log",
                            shape=(config.num_layers, config.num_physical_experts))
    if store.create_cluster(config, phy2log):
        return True
    existing = store.read_config()
    if existing.topology() != config.topology():
        raise TopologyError(f"cluster {store.cluster!r} exists with topology {existing.topology()}")
    return False
