"""The status read model: a cluster's machine records as they stand now, as JSON-ready data.

One reader for every view of "now": ``fdeplb status`` (over Redis), ``GET /v1/state`` (which ``fdeplb status --url``
prints) and ``GET /health``. It sits below the API and the command line, which both import it; it reads
through :class:`~fdeplb.store.Store` only and writes nothing.

Staleness has one rule, the coordinator's (:func:`fdeplb.store.liveness.stale_of`): a registered rank is stale
once its heartbeat is older than the TTL its agent wrote with it (``RankRecord.heartbeat_ttl_ms``; no TTL written:
never stale); ``/health`` and the start guard also count every member rank that is not registered. Ages and TTLs
are milliseconds of the Redis server's clock.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fdeplb.errors import CorruptRecordError, NotFoundError, StateError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, WEIGHTS, ClusterState, MemberState, RankState
from fdeplb.store import MemberRecord, RankRecord
from fdeplb.store.liveness import NOT_REGISTERED, stale_of

__all__ = ["CORRUPT", "cluster_status", "commit_command", "degraded_experts", "heartbeats_of", "member_states",
           "source_load", "unhealthy_ranks"]

#: how ``status`` shows a record that does not parse (in place of its state)
CORRUPT = "CORRUPT"


def placement_file(store, fmt: str) -> str:
    """The cluster's current placement as the text of a placement file in ``fmt`` (one of
    :data:`fdeplb.placement.FORMATS`), with the model's layers (:attr:`~fdeplb.store.ClusterConfig.layer_ids`):
    SGLang and FastDeploy one row per model layer, the dense layers with the trivial placement as in SGLang's own
    files (DeepSeek-V3: 61 rows, as ``fdeplb rebalance --format sglang`` writes); TensorRT-LLM keyed by model layer
    (DeepSeek-V3: 3..60); fdeplb with its ``layer_ids``. What ``GET /v1/placement?format=`` serves and ``fdeplb
    status --placement-out`` writes. :class:`InputError` for another format."""
    from fdeplb.errors import InputError
    from fdeplb.placement import FORMATS
    from fdeplb.placement.core import Placement
    from fdeplb.placement.files import render_placement

    if fmt not in FORMATS:
        raise InputError(f"format must be one of {', '.join(FORMATS)}, got {str(fmt)[:40]!r}")
    cfg = store.read_config()
    current = store.current_placement()
    pl = Placement.from_phy2log(current.phy2log, cfg.num_logical_experts, policy=cfg.policy,
                                num_groups=cfg.num_groups, num_nodes=cfg.num_nodes, num_gpus=cfg.ep_size)
    return render_placement(pl, fmt, layer_ids=cfg.model_layer_ids, num_model_layers=cfg.model_layers,
                            meta_file_name="placement.json")


def source_load(store) -> tuple[np.ndarray, list[int], list[int]]:
    """The load per source rank as the ranks published it (a rank's window counts the tokens it routed): (int64
    [ep_size, L, E], the last windows of the ranks the placement is routed over, zeros for every other rank; the
    ranks it holds; the routed ranks with no window yet). ``fdeplb load --export`` writes it, ``/metrics`` measures
    the cross-node fraction on it. :class:`StateError` when no routed rank published one;
    :class:`CorruptRecordError` for a window that does not parse."""
    cfg = store.read_config()
    routed = store.current_placement().live_ranks(cfg.ep_size)
    windows = {r: store.read_load(r) for r in routed}
    summed = [r for r, w in windows.items() if w is not None]
    if not summed:
        raise StateError(f"no rank of cluster {store.cluster} the placement is routed over ({list(routed)}) has "
                         f"published a load window yet: nothing to export")
    stack = np.zeros((cfg.ep_size, cfg.num_layers, cfg.num_logical_experts), dtype=np.int64)
    for r in summed:
        stack[r] = windows[r].expert_load
    return stack, summed, [r for r in routed if windows[r] is None]


def commit_command(redis_url: str, cluster: str, plan_id: str) -> str:
    """The command that commits a cordoned cluster's staged plan ``plan_id``."""
    return f"fdeplb rearrange --redis-url {redis_url} --cluster {cluster} --commit {plan_id}"


def heartbeats_of(records: Sequence[Any], now_ms: int, registered=None) -> dict[int, tuple[int, int]]:
    """:meth:`Store.heartbeats`' answer, ``ep_rank -> (ms since the heartbeat, its TTL in ms)``, from rank
    records already read (``records`` in ep_rank order, as :meth:`Store.read_each` gives them) at server time
    ``now_ms``: every rank in ``registered`` (None: every rank) whose record parses and that has beaten at least
    once. Feed it to ``stale_of`` for the stale ones."""
    return {r: (max(0, now_ms - rec.heartbeat_ms), rec.heartbeat_ttl_ms) for r, rec in enumerate(records)
            if isinstance(rec, RankRecord) and rec.heartbeat_ms and (registered is None or r in registered)}


def member_states(store, members: Sequence[Any]) -> list[Any]:
    """Each rank's membership state as every reader shows it (``fdeplb status``, ``GET /v1/state``, the UI,
    ``/metrics``, ``/health``), from its member record as read (``members``, ep_rank order: a :class:`MemberRecord`,
    None when missing, anything else, e.g. a :class:`CorruptRecordError`, kept as it is): the record's state; for a
    missing record, by the coordinator's own rule (:meth:`~fdeplb.store.Store.to_restore`), the state it restores
    the record to at its next pass (:meth:`~fdeplb.store.Store.restored_members`: the rank's last audited
    membership record, the initial ACTIVE when the audit is whole and holds none, else EXCLUDED; a
    CorruptRecordError when that audit record does not give one), or the initial ACTIVE in a cluster made before
    membership (no member record at all, generation 0: nothing walked). So a deleted record is never shown ACTIVE
    unless the coordinator restores it so. One walk back through the audit while a record is missing (until that
    pass), none otherwise."""
    restored = store.restored_members(store.to_restore(members))
    states = []
    for r, m in enumerate(members):
        m = restored.get(r, MEMBERSHIP.initial) if m is None else m
        states.append(m.state if isinstance(m, MemberRecord) else m)
    return states


def unhealthy_ranks(store) -> tuple[int, dict[int, str]]:
    """(number of registered ranks, ``{ep_rank: why}`` for every member rank (all of ``ep_size`` but EXCLUDED ones)
    without a live heartbeat): not registered (e.g. Redis lost its data and the agent has not registered again;
    with the agent's reason when it refuses the cluster created again: a topology it does not serve), never beat
    (or no rank record), or stale by the TTL rule. Four round trips whatever the number of ranks (registry, server
    time, every rank record in one pipeline, membership), a fifth when a rank is not registered (live reports).
    :class:`CorruptRecordError` for a registered rank's record, a registry, a member record or a live report that
    does not parse; :class:`NotFoundError` without a cluster; Redis errors as the store raises them."""
    ep_size = store.ep_size()
    registered = store.rank_info()
    now = store.now_ms()
    records = store.read_each(RANK)
    for r in sorted(registered):
        if r < len(records) and isinstance(records[r], CorruptRecordError):
            raise records[r]
    excluded = {r for r, st in enumerate(store.restored_view().states()) if st is MemberState.EXCLUDED}
    beats = heartbeats_of(records, now, registered)
    out = {r: "never beat" for r in registered if r not in beats and r not in excluded}
    for r, age in stale_of(beats, ep_size).items():
        if r in excluded:
            continue
        if r not in registered:
            out[r] = "not registered"
        elif age != NOT_REGISTERED:
            out[r] = f"last beat {age / 1000:.1f} s ago, past its {beats[r][1] / 1000:g} s TTL"
    if "not registered" in out.values():  # an agent refusing the cluster created again says why in its live report
        for r, rep in store.live_reports(ep_size).items():
            if rep.refused and out.get(r) == "not registered":
                out[r] = f"not registered: {rep.refused}"
    return len(registered), dict(sorted(out.items()))


def cluster_status(store, redis_url: str = "URL") -> dict[str, Any]:
    """Every machine record of the cluster now, as a JSON-ready dict (times from the Redis server's clock).
    A registered rank whose heartbeat outlived its TTL is ``stale`` (the coordinator's rule, see the module); a
    cordoned round in LOAD_SUCC comes with its staged plan (``staged``: balancedness before/after, moved experts,
    the command that commits it).

    Routing: each rank's ``routing`` compares the digest of the routing tables it reported holding
    (``routing_digest``, written when it loads or swaps) with the current placement's
    (``placement.routing_digest``, :func:`fdeplb.placement.routing_digest` of its phy2log): ``match``,
    ``mismatch`` (listed in ``routing_mismatches``: the rank dispatches tokens differently from the others),
    ``swap_pending`` (the cluster is SWAPPING and the rank has not swapped yet: its old tables are expected),
    ``not_reported`` (no digest yet), ``not_member`` (an EXCLUDED rank: nobody routes to it, whatever it holds), or
    None (no rank record or no placement).

    Membership: ``generation`` (the cluster's membership generation), ``live_ranks`` (the ACTIVE members), each
    rank's ``membership`` (ACTIVE, SUSPECT, DRAINING, EXCLUDED, REJOINING; a missing record as
    :func:`member_states` says: as the coordinator will restore it) and ``degraded``
    (None, or the experts left with no replica on a member).

    Corrupt values: each record is read on its own, and one that does not parse (a value fdeplb did not write that
    way, :class:`~fdeplb.errors.CorruptRecordError`) is listed in ``corrupt`` (``[{"key", "error"}]``, the error
    naming the key and the field) and shown as ``CORRUPT`` while every other record is shown as usual: the
    cluster record as ``rearrange.state`` ``CORRUPT`` (its other fields None), a rank or weight-status record as
    that rank's ``state`` / ``weights`` ``CORRUPT``, the placement as ``placement.corrupt`` true (its fields None),
    a corrupt rank registry as every rank's ``registered`` None, a corrupt staged plan as ``staged`` None. A corrupt
    configuration raises :class:`~fdeplb.errors.CorruptRecordError` (without it nothing can be laid out); so do
    :class:`~fdeplb.errors.NotFoundError` (no cluster) and Redis errors."""
    from fdeplb.placement import routing_digest

    config = store.read_config(fresh=True)  # its settings change (`fdeplb config set`); a served store is long-lived
    corrupt: list[dict[str, str]] = []

    def parsed(value):
        """``value`` unless it is a CorruptRecordError, which is listed in ``corrupt`` (then CORRUPT)."""
        if isinstance(value, CorruptRecordError):
            corrupt.append({"key": value.key or "", "error": str(value)})
            return CORRUPT
        return value

    def read(fn, *args):
        try:
            return fn(*args)
        except CorruptRecordError as err:
            return parsed(err)

    now = store.now_ms()
    rec = read(store.read_cluster)
    cluster_state = None if rec is CORRUPT else rec.state
    lease = store.lease_info()
    try:
        placement = read(store.current_placement)
    except NotFoundError:
        placement = None
    expected = routing_digest(placement.phy2log) if placement not in (None, CORRUPT) else None
    registered = read(store.rank_info)
    rank_records = [parsed(x) for x in store.read_each(RANK)]
    weight_records = [parsed(x) for x in store.read_each(WEIGHTS)]
    membership = [parsed(x) for x in member_states(store, [parsed(x) for x in store.read_each(MEMBERSHIP)])]
    stale = stale_of(heartbeats_of(rank_records, now, None if registered is CORRUPT else registered))
    ranks = [{**_rank_status(r, rank, weights, None if registered is CORRUPT else r in registered, now, r in stale,
                             expected, cluster_state), "membership": membership[r]}
             for r, (rank, weights) in enumerate(zip(rank_records, weight_records))]
    for row in ranks:
        if row["membership"] is MemberState.EXCLUDED and row["routing"] is not None:
            row["routing"] = "not_member"
    has_placement = placement not in (None, CORRUPT)
    live = [r for r, st in enumerate(membership) if st is MemberState.ACTIVE]
    return {
        "cluster": store.cluster,
        "now_ms": now,
        "generation": None if rec is CORRUPT else rec.generation,
        "live_ranks": live,
        "degraded": _degraded(config, placement if has_placement else None, live),
        "staged": _staged(store, config, rec, cluster_state, read, redis_url),
        "config": {"ep_size": config.ep_size, "policy": config.policy, "cordoned": config.cordoned,
                   "min_gain": config.min_gain, "version": config.version, "layer_ids": config.model_layer_ids,
                   "num_model_layers": config.model_layers, **config.topology()},
        "rearrange": {**_rearrange_status(rec, now), "lease_holder": lease.holder, "lease_ttl_ms": lease.ttl_ms},
        "placement": {"plan_id": placement.plan_id if has_placement else None,
                      "version": placement.version if has_placement else None, "routing_digest": expected,
                      "corrupt": placement is CORRUPT},
        "routing_mismatches": [r["ep_rank"] for r in ranks if r["routing"] == "mismatch"],
        "ranks": ranks,
        "corrupt": corrupt,
    }


def degraded_experts(store) -> dict[str, Any] | None:
    """``cluster_status``' ``degraded`` alone (for ``/health``): None while every logical expert of the current
    placement has a replica on an ACTIVE member, else ``{"orphans": [[layer, log_id], ...], "ranks": [...]}``.
    :class:`CorruptRecordError` for a configuration, placement or member record that does not parse."""
    config = store.read_config()
    live = store.restored_view().active()  # as unhealthy_ranks reads: a deleted record as it is restored
    if len(live) == config.ep_size:
        return None
    try:
        placement = store.current_placement()
    except NotFoundError:
        return None
    return _degraded(config, placement, live)


def _degraded(config, placement, live: list[int]) -> dict[str, Any] | None:
    """None while every logical expert has a replica on an ACTIVE member; else ``{"orphans": [[layer, log_id],
    ...], "ranks": [the ranks that are not members]}``: the cluster serves without those experts until a rank
    rejoins or the operator acts (a re-placement failed closed)."""

    from fdeplb.placement import orphaned_experts

    if placement is None or len(live) == config.ep_size:
        return None
    mask = np.zeros(config.ep_size, dtype=bool)
    mask[live] = True
    orphans = orphaned_experts(placement.phy2log, config.num_logical_experts, config.ep_size, mask)
    if not orphans:
        return None
    return {"orphans": [[l, e] for l, e in orphans], "ranks": [r for r in range(config.ep_size) if r not in live]}


def _staged(store, config, rec, cluster_state, read, redis_url: str) -> dict[str, Any] | None:
    """The staged plan of a cordoned cluster in LOAD_SUCC (None otherwise, or when the plan is gone or corrupt)."""
    if not (config.cordoned and cluster_state is ClusterState.LOAD_SUCC and rec.plan_id):
        return None
    plan = read(store.read_plan, rec.plan_id)
    if plan in (None, CORRUPT):
        return None
    return {"plan_id": plan.plan_id, "balancedness_before": plan.balancedness_before,
            "balancedness_after": plan.balancedness_after, "moved_experts": plan.moved_experts,
            "commit_command": commit_command(redis_url, store.cluster, plan.plan_id)}


def _rearrange_status(rec, now: int) -> dict[str, Any]:
    """The cluster record's part of :func:`cluster_status` (state CORRUPT and every other field None for one that
    does not parse)."""
    if rec is CORRUPT:
        return {"state": CORRUPT, **dict.fromkeys(("code", "version", "round", "requested", "requested_reason",
                                                    "plan_id", "deadline_left_ms", "reason", "alarm",
                                                    "probe_mismatch"))}
    return {
        "state": rec.state,
        "code": CLUSTER.to_code(rec.state),
        "version": rec.version,
        "round": rec.round,
        "requested": rec.requested,
        "requested_reason": rec.requested_reason,
        "plan_id": rec.plan_id,
        "deadline_left_ms": rec.deadline_ms - now if rec.deadline_ms else None,
        "reason": rec.reason,
        "alarm": rec.alarm,
        "probe_mismatch": rec.probe_mismatch,
    }


def _rank_status(r: int, rank, weights, registered: bool | None, now: int, stale: bool,
                 expected: str | None, cluster_state: ClusterState | None) -> dict[str, Any]:
    """One rank's row of :func:`cluster_status`: ``rank`` / ``weights`` are its records, None (missing) or CORRUPT
    (shown as that state, the fields that come from the record None)."""
    has_rank = rank not in (None, CORRUPT)
    has_weights = weights not in (None, CORRUPT)
    heartbeat = rank.heartbeat_ms if has_rank else 0
    return {
        "ep_rank": r,
        "registered": registered,
        "state": rank.state if has_rank else rank,
        "load_result": RANK.to_code(rank.state) if has_rank else None,
        "version": rank.version if has_rank else None,
        "plan_id": rank.plan_id if has_rank else None,
        "live_plan_id": rank.live_plan_id if has_rank else None,  # None: no agent has run yet
        "reason": rank.reason if has_rank else None,
        "heartbeat_age_ms": now - heartbeat if heartbeat else None,
        "heartbeat_ttl_ms": (rank.heartbeat_ttl_ms or None) if has_rank else None,
        "step": rank.step if has_rank else None,  # the worker's safe-point counter at its last heartbeat
        # its last staging: read from the checkpoint + taken from peers' live slots + copied between its own slots
        "staged_bytes": rank.disk_bytes + rank.peer_bytes + rank.local_bytes if has_rank else None,
        "disk_bytes": rank.disk_bytes if has_rank else None,
        "peer_bytes": rank.peer_bytes if has_rank else None,
        "stale": stale,
        "weights": weights.state if has_weights else weights,
        "weights_code": WEIGHTS.to_code(weights.state) if has_weights else None,
        "weights_version": weights.version if has_weights else None,
        "routing_digest": (rank.routing_digest or None) if has_rank else None,
        "routing": _routing(rank, expected, cluster_state) if has_rank else None,
        "probe": (rank.probe or None) if has_rank else None,  # its last swap's output probe (None: none ran)
    }


def _routing(rank, expected: str | None, cluster_state: ClusterState | None) -> str | None:
    """How ``rank``'s reported routing digest compares with the placement's ``expected`` (see cluster_status)."""
    if rank is None or expected is None:
        return None
    if not rank.routing_digest:
        return "not_reported"
    if rank.routing_digest == expected:
        return "match"
    if cluster_state is ClusterState.SWAPPING and rank.state is not RankState.SWAPPED:
        return "swap_pending"
    return "mismatch"
