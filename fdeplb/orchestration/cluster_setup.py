"""Cluster set-up: what an operator (CLI, API, demo) does to create a cluster before anything runs it, or again
over ranks that kept running when Redis lost its data (the placement they hold live is adopted)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fdeplb.errors import NotFoundError, StateError, TopologyError
from fdeplb.orchestration.recovery import adopted_placement, await_live_reports
from fdeplb.placement import check_phy2log
from fdeplb.store import ClusterConfig, Store


def init_cluster(store: Store, config: ClusterConfig, initial_phy2log: np.ndarray, *, adopt: bool = True,
                 adopt_wait_ms: int = 0, since_start: bool = False, say: Callable[[str], Any] | None = None) -> bool:
    """Create a cluster: its configuration, initial placement, and a record per machine (cluster FREE, every
    rank IDLE, every weight status NORMAL), all at version 0, in one MULTI/EXEC (a crash leaves all or nothing).

    Idempotent: an existing cluster with the same configuration is left as it is (returns False); a different
    topology for an existing cluster is refused with :class:`TopologyError`, other settings (or checkpoint, layer
    ids, pause budget) with :class:`StateError` naming each difference and ``fdeplb config set`` (nothing written).
    ``initial_phy2log`` is int [num_layers, num_physical_experts]
    holding expert ids in [0, num_logical_experts) (:class:`InputError` otherwise; nothing is written then).

    Over live ranks (a cluster whose records Redis lost while its agents kept serving): when the ranks that
    reported their live placement (:func:`~fdeplb.orchestration.recovery.adopted_placement`) agree, that placement
    and its plan_id are written instead of ``initial_phy2log`` (the placement record then names that plan); when they
    disagree, :class:`~fdeplb.errors.StateError` names them and nothing is written. ``adopt_wait_ms``: how long to
    wait for the live ranks' reports first, from now or with ``since_start`` from the Redis server's start
    (:func:`~fdeplb.orchestration.recovery.await_live_reports`; ``init-cluster``'s ``--adopt-wait-ms``, by default
    the agents' heartbeat TTL + TTL/4 since Redis started); ``adopt`` False writes ``initial_phy2log`` whatever
    the live ranks hold (every live rank then loads it and registers). ``say``: told how many ranks reported and
    which did not.
    """
    phy2log = check_phy2log(initial_phy2log, config.num_logical_experts, name="initial phy2log",
                            shape=(config.num_layers, config.num_physical_experts))
    plan_id = ""
    try:
        store.read_config(fresh=True)
        adopted = None  # it exists: left as it is (below)
    except NotFoundError:
        adopted = _adopted(store, config, adopt_wait_ms, since_start, say or (lambda _text: None)) if adopt else None
    if adopted is not None:
        live, plan_id, _ = adopted
        phy2log = check_phy2log(live, config.num_logical_experts, name="live ranks' phy2log",
                                shape=(config.num_layers, config.num_physical_experts))
    if store.create_cluster(config, phy2log, plan_id):
        return True
    existing = store.read_config()
    if existing.topology() != config.topology():
        raise TopologyError(f"cluster {store.cluster!r} exists with topology {existing.topology()} (asked "
                            f"{config.topology()}); nothing changed. A topology is fixed at creation: use another "
                            f"--cluster id, or delete this one first (`fdeplb cluster delete`)")
    ours, theirs = _compared(config), _compared(existing)
    differ = [f"{k} {theirs.get(k)!r} (asked {ours.get(k)!r})" for k in sorted(ours) if ours.get(k) != theirs.get(k)]
    if differ:
        raise StateError(f"cluster {store.cluster!r} exists with other settings: {'; '.join(differ)}; nothing "
                         f"changed. Change settings with `fdeplb config set --redis-url URL --cluster "
                         f"{store.cluster} ...` (checkpoint, layer ids and the pause budget are fixed at creation)")
    return False


def _adopted(store: Store, config: ClusterConfig, wait_ms: int, since_start: bool, say: Callable[[str], Any]
             ) -> tuple[np.ndarray, str, list[int]] | None:
    """The live ranks' placement to adopt (:func:`adopted_placement`), after waiting up to ``wait_ms`` for their
    reports; ``say`` tells who reported."""
    if wait_ms > 0:
        reported, waited_s = await_live_reports(store, config.ep_size, wait_ms, since_start=since_start)
        missing = sorted(set(range(config.ep_size)) - set(reported))
        if reported:
            said = f"; ranks {missing} did not (they load the cluster's placement when they do)" if missing else ""
            say(f"cluster {store.cluster}: {len(reported)} of {config.ep_size} ranks reported the placement they hold "
                f"live (waited {waited_s:.1f} s){said}")
        elif waited_s >= 0.05:
            say(f"cluster {store.cluster}: no live rank reported a placement within {waited_s:.1f} s of waiting")
    return adopted_placement(store, config)


def _compared(config: ClusterConfig) -> dict:
    """What init-cluster compares with an existing cluster: every setting (deadlines one by one), the checkpoint,
    the model layers and the pause budget (the topology is compared first)."""
    flat = config.flat_settings()
    flat.update(checkpoint=config.checkpoint, layer_ids=config.model_layer_ids, num_model_layers=config.model_layers,
                max_pause_bytes=config.max_pause_bytes, layers_per_safe_point=config.layers_per_safe_point)
    return flat
