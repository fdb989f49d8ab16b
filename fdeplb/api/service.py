"""What each route does, as plain synchronous functions over a :class:`~fdeplb.store.Store` (no HTTP here).

Every function returns ``(status, body)`` with FastDeploy's body shape ``{"code": 0 | 1, "msg": ..., ...}``, or
raises an :class:`~fdeplb.errors.FdeplbError` that the router turns into ``{"code": 1, "msg": ...}`` with the status
of :func:`fdeplb.errors.http_status`. A refused call writes nothing to Redis (only wake-up events may be appended).

fdeplb never connects to an address named in a request: ``ips`` is only checked against the API addresses the rank
agents registered (``Store.rank_info()``), and Redis carries the fan-out.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from fdeplb.checks import check_int
from fdeplb.errors import (ContentionError, CorruptRecordError, FdeplbError, InputError, NotFoundError,
                           RedisUnavailableError, StateError)
from fdeplb.machines.tables import CLUSTER, FASTDEPLOY_STATUS_NAMES, RANK, WEIGHTS, ClusterState, WeightState
from fdeplb.recording import audit_dict
from fdeplb.status import cluster_status, degraded_experts, unhealthy_ranks
from fdeplb.store import Store
from fdeplb.store.streams import parse_stream_id

log = structlog.get_logger("fdeplb.api")

#: FastDeploy's RearrangeExpertStatus names by code (CLUSTER.to_code gives the code of an fdeplb state)
FD_STATUS = FASTDEPLOY_STATUS_NAMES
#: stream ids (``<ms>-<seq>``, ASCII digits, each part at most 2**64 - 1) accepted by ``since``
MAX_AUDIT_LIMIT = 10_000
MAX_WAIT_MS = 30_000
#: longest slice a waiting call blocks before it looks at :attr:`ApiSettings.shutdown` again (ms)
SHUTDOWN_POLL_MS = 250

Reply = tuple[int, dict[str, Any]]


def ok(**fields: Any) -> Reply:
    return 200, {"code": 0, "msg": "ok", **fields}


def refuse(msg: str, status: int = 400, **fields: Any) -> Reply:
    return status, {"code": 1, "msg": msg, **fields}


def refuse_state(err: StateError, msg: str | None = None) -> Reply:
    """The refusal of a request the store turned down (``msg``, or the error's text), except a
    :class:`~fdeplb.errors.ContentionError`: other writers won every attempt and nothing was refused, so it is
    raised (409, try again) rather than answered as a refusal."""
    if isinstance(err, ContentionError):
        raise err
    return refuse(str(err) if msg is None else msg)


@dataclass
class ApiSettings:
    """How the API serves one cluster.

    ``weights_timeout_s``: how long ``/update_model_weight`` and ``/clear_load_weight`` wait for every rank
    (FastDeploy: 300 s). ``metrics_public``: ``/metrics`` answers without credentials (``fdeplb serve
    --metrics-public``; by default it takes HTTP Basic like every GET route). ``/health`` has no setting of its own:
    it always answers without credentials (:func:`probe_health`); a rank is unhealthy when its heartbeat outlived
    the TTL its agent wrote (the coordinator's rule, :mod:`fdeplb.status`). ``max_body_bytes`` / ``max_depth``:
    request body limits. ``statecharts_dir``: where the
    ``<machine>.svg`` diagrams are (default: ``statecharts/`` of the checkout, else rendered with Graphviz).
    ``max_waiting``: calls that wait on the cluster (``/v1/audit`` with ``wait_ms``, ``/update_model_weight``,
    ``/clear_load_weight``) served at once; more wait their turn. They have their own worker threads, so however
    many are pending, the other routes (``/health`` first) still answer at once. ``shutdown``: set when the
    server stops (``fdeplb serve`` on SIGTERM / SIGINT); those waiting calls then answer within
    :data:`SHUTDOWN_POLL_MS` (a long poll with what it has, a weight wait 503 ``server shutting down``)."""

    weights_timeout_s: float = 300.0
    metrics_public: bool = False
    max_body_bytes: int = 8 << 20
    max_depth: int = 16
    statecharts_dir: Path | None = None
    max_waiting: int = 16
    shutdown: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


def _status_msg(rec, expect: int) -> str:
    code = CLUSTER.to_code(rec.state)
    return f"rearrange is doing. actual status {code} ({rec.state}), expect status {expect}"


# ---- POST /rearrange_experts ---------------------------------------------------------------------------------------
def start_round(store: Store, ips: list[str] | None) -> Reply:
    """Action "": start a round if every address of ``ips`` is a registered rank's and the cluster is FREE with no
    round pending and every rank's weights NORMAL with no clear pending (atomic: of concurrent calls exactly one is
    accepted, and a concurrent clear refuses either the start or itself)."""
    if ips is None:
        return refuse("ips in request is None")
    if not ips:
        return refuse("ips is empty: name the API addresses of the ranks")
    registered = {str(info.get("api_address")) for info in store.rank_info().values() if info.get("api_address")}
    unknown = sorted({ip for ip in ips if ip not in registered})
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        return refuse(f"ips not registered as a rank's API address: {shown}")
    weights = store.read_all(WEIGHTS)
    not_normal = [r for r, w in enumerate(weights) if w.state is not WeightState.NORMAL]
    if not_normal:
        return refuse(f"weights of ranks {not_normal} are not NORMAL ({weights[not_normal[0]].state}); "
                      f"a round needs every rank's weights loaded (GET /update_model_weight)")
    try:
        accepted, rec = store.request_round_if_free("api")
    except StateError as err:  # weights cleared or a clear asked since the check above
        return refuse_state(err, f"{err}; a round needs every rank's weights loaded (GET /update_model_weight)")
    if not accepted:
        if rec.state is ClusterState.FREE:
            return refuse(f"rearrange is doing. actual status 0 (FREE), expect status 0 with no round pending: "
                          f"round {rec.round + 1} is requested already")
        return refuse(_status_msg(rec, 0))
    log.info("round requested", round=rec.round + 1)
    return ok(round=rec.round + 1)


def supply_load(store: Store, data: list[list[int]] | None) -> Reply:
    """Action ``recv_expert_weight``: ``data`` [L][E] is the load of the round being collected (or of the next round)
    instead of the ranks' windows. :class:`~fdeplb.errors.ContentionError` (409, nothing written) when other writers
    changed the snapshot or the supplied load under every attempt of the store's transaction."""
    if data is None:
        return refuse("data not in request or data is not a list")
    cfg = store.read_config()
    expected = (cfg.num_layers, cfg.num_logical_experts)
    rows = {len(row) for row in data}
    if len(data) != expected[0] or rows != {expected[1]}:
        shape = f"{len(data)} rows of lengths {sorted(rows)[:4]}" if len(rows) != 1 else f"{len(data)}x{rows.pop()}"
        return refuse(f"data must be [num_layers][num_logical_experts] = {expected[0]}x{expected[1]}, got {shape}")
    load = np.asarray(data, dtype=np.int64)
    rec = store.read_cluster()
    collecting = rec.state is ClusterState.COLLECTING and store.read_snapshot(rec.round) is None
    round_ = rec.round if collecting else rec.round + 1
    try:
        try:
            store.supply_load(round_, load)
        except StateError as err:
            if not collecting or isinstance(err, ContentionError):
                raise
            round_ += 1  # the round being collected froze its load meanwhile: the load is the next round's
            store.supply_load(round_, load)
    except StateError as err:
        return refuse_state(err)
    log.info("load supplied", round=round_, total=int(load.sum()))
    return ok(round=round_)


def commit(store: Store, plan_id: str | None = None) -> Reply:
    """Action ``update_weight_from_tensor``: allow the cordoned cluster's staged plan to commit (LOAD_SUCC only).
    With ``plan_id`` (the plan the caller reviewed), only if it is the staged one: a late commit after that plan's
    round timed out is refused with 409 naming both, never committing a plan nobody reviewed."""
    rec = store.read_cluster()
    staged = rec.plan_id if rec.state is ClusterState.LOAD_SUCC else ""
    if plan_id is not None and staged != plan_id:
        raise StateError(f"plan {plan_id} is not the staged plan: the cluster is {rec.state} (round {rec.round}), "
                         f"staged plan {staged or 'none'}; nothing committed")
    if rec.state is not ClusterState.LOAD_SUCC:
        return refuse(f"actual status {CLUSTER.to_code(rec.state)} ({rec.state}), expect status 2 (LOAD_SUCC)")
    try:
        store.request_commit(rec.plan_id, by="http")
    except StateError as err:
        if plan_id is not None:
            raise  # 409: the named plan is no longer the staged one
        return refuse_state(err)
    log.info("commit requested", round=rec.round, plan_id=rec.plan_id)
    return ok(round=rec.round, plan_id=rec.plan_id)


# ---- fdeplb's operator routes (fdeplb.orchestration.operator) -------------------------------------------------------
def abort_round(store: Store, by: str, reason: str) -> Reply:
    """``POST /v1/round/abort``: the round in flight aborted before the commit point (409 after it, or when none)."""
    from fdeplb.orchestration.operator import abort_round as abort

    fired = abort(store, by=by, reason=reason)
    return ok(round=fired.before.round, state_was=fired.before.state.value, reason=fired.after.reason)


def cancel_request(store: Store, by: str, reason: str) -> Reply:
    """``POST /v1/round/cancel``: the pending round request withdrawn (409 when none is pending), and the
    operator's plan that waited for it (``dropped_plan``: its routing digest, "" when none)."""
    from fdeplb.orchestration.operator import cancel_request as cancel

    withdrawn, dropped = cancel(store, by=by, reason=reason)
    return ok(round=withdrawn, dropped_plan=dropped)


def supply_plan(store: Store, phy2log: list[list[int]], by: str, reason: str) -> Reply:
    """``POST /v1/round/plan``: one round to the placement ``phy2log`` [L][P] (an operator's plan, no gain gate:
    :func:`fdeplb.orchestration.rollback.supply_operator_plan`); 400 for a plan the cluster cannot take (another
    shape, a logical expert missing or on non-members only), 409 while a round is in flight or a rollback waits.
    Answers the round that will go to it and the plan's routing digest."""
    import numpy as np

    from fdeplb.errors import InputError
    from fdeplb.orchestration.rollback import supply_operator_plan
    from fdeplb.store.records import check_request_reason

    check_request_reason(reason)  # before the plan is supplied: the round's request keeps it (400, nothing written)
    try:
        arr = np.asarray(phy2log, dtype=np.int64)
    except (ValueError, OverflowError) as err:  # ragged rows, an id past int64: a bad body, never a 500
        raise InputError(f"phy2log is no [num_layers][num_physical_experts] table of expert ids ({err})") from None
    digest = supply_operator_plan(store, arr, f"POST /v1/round/plan by {by}" + (f" ({reason})" if reason else ""))
    return ok(round=store.request_round(reason or "operator plan"), plan=digest)


def config(store: Store) -> dict[str, Any]:
    """``GET /v1/config``: the cluster's configuration (its ``version`` counts the changes)."""
    return store.read_config(fresh=True).to_json()


def change_config(store: Store, changes: dict[str, Any], by: str, reason: str) -> Reply:
    """``POST /v1/config``: change settings (400 for one that may not change or a bad value)."""
    from fdeplb.orchestration.operator import change_settings

    if not changes:
        raise InputError("nothing to change: give at least one setting")
    old, new = change_settings(store, changes, by=by, reason=reason)
    return ok(version=new.version, changed=new.version != old.version, config=new.to_json())


def delete_cluster(store: Store, by: str, force: bool) -> Reply:
    """``POST /v1/cluster/delete``: every key of the cluster deleted (409 while agents are alive, unless force)."""
    from fdeplb.orchestration.operator import delete_cluster as delete

    n = delete(store, force=force, by=by)
    log.warning("cluster deleted", by=by, keys=n, force=force)
    return ok(deleted_keys=n)


# ---- POST /get_per_expert_tokens_stats -----------------------------------------------------------------------------
def expert_stats(store: Store, clear_stat: bool) -> Reply:
    """Every rank's last published expert_load window, ``data`` [ep_size][L][E] (zeros for a rank that never
    published). ``clear_stat`` is accepted and changes nothing: the windows slide."""
    cfg = store.read_config()
    data = []
    for r in range(cfg.ep_size):
        window = store.read_load(r)
        data.append(window.expert_load.tolist() if window is not None else
                     [[0] * cfg.num_logical_experts for _ in range(cfg.num_layers)])
    msg = "ok (clear_stat ignored: the load windows slide)" if clear_stat else "ok"
    return 200, {"code": 0, "msg": msg, "data": data}


# ---- POST /check_redundant -----------------------------------------------------------------------------------------
def rearrange_status(store: Store, get_workloads: bool) -> Reply:
    """Action "": FastDeploy's status name (FREE / DOING / LOAD_SUCC / DONE); with ``check_get_workloads`` also
    ``data`` in FastDeploy's workload layout: the last snapshot, phy2log, log2phy and logcnt of the current
    placement."""
    from fdeplb.placement.core import derive_maps

    rec = store.read_cluster()
    body: dict[str, Any] = {"code": 0, "msg": "ok", "status": FD_STATUS[CLUSTER.to_code(rec.state)],
                            "state": rec.state.value, "round": rec.round, "plan_id": rec.plan_id}
    if get_workloads:
        cfg = store.read_config()
        placement = store.current_placement()
        log2phy, logcnt = derive_maps(placement.phy2log, cfg.num_logical_experts)
        snapshot, snapshot_round = None, None
        for r in range(rec.round, max(rec.round - 3, 0), -1):  # the round in flight may not have frozen one yet
            snapshot = store.read_snapshot(r)
            if snapshot is not None:
                snapshot_round = r
                break
        body["data"] = {
            "tokens_per_expert_stats_list": None if snapshot is None else snapshot.tolist(),
            "snapshot_round": snapshot_round,
            "ep_rank_to_expert_id_list": placement.phy2log.tolist(),
            "expert_id_to_ep_rank_array": log2phy.tolist(),
            "expert_in_rank_num_list": logcnt.tolist(),
            "plan_id": placement.plan_id,
        }
    return 200, body


def load_results(store: Store) -> Reply:
    """Action ``check_load_weight_result``: per-rank load result (0 / 1 / -1) for the round in flight."""
    rec = store.read_cluster()
    data = [RANK.to_code(r.state) if r.plan_id == rec.plan_id and rec.plan_id else 0 for r in store.read_all(RANK)]
    return ok(data=data)


# ---- GET /update_model_weight, /clear_load_weight ------------------------------------------------------------------
_WEIGHT_ACTIONS = {"update": (WeightState.NORMAL, "update model weight", "updated"),
                   "clear": (WeightState.CLEARED, "clear model weight", "cleared")}


def drive_weights(store: Store, action: str, timeout_s: float, shutdown: threading.Event | None = None) -> Reply:
    """Ask every rank to update or clear its weights and wait (at most ``timeout_s``) until every ACTIVE member
    carried out this request (``WeightRecord.request``) and is NORMAL resp. CLEARED (a rank that is not a member is
    not waited for: the switch step does not count it either). 200 when done; 404 with the message on a
    timeout or a failed rank (FastDeploy's codes); 400 when the request cannot be made now; 409 when the request
    was cancelled (its switch step was not fixed within ``deadlines.weights_ms``: no rank applied it), the body's
    ``ranks`` naming the ranks that held it back; 503 ``server shutting down`` once ``shutdown`` is set (the
    request stays made: the ranks carry it out)."""
    target, what, done = _WEIGHT_ACTIONS[action]

    def members_records() -> list[tuple[int, Any]]:  # the ACTIVE members' records: the others are not waited for
        records, members = store.read_all(WEIGHTS), set(store.restored_view().active())
        return [(r, w) for r, w in enumerate(records) if r in members]

    records = members_records()
    if all(w.state is target for _, w in records):
        return ok(msg=f"model weight is {done}")
    busy = [r for r, w in records if w.state in (WeightState.UPDATING, WeightState.CLEARING)]
    if busy:
        return refuse(f"ranks {busy} are {dict(records)[busy[0]].state} already; try again when they finish")
    cursor = store.cursor()
    try:  # a clear: refused while a round runs or is pending (checked where the request is written)
        n = store.request_weights(action, reason="api", when_idle=action == "clear")
    except StateError as err:
        return refuse_state(err)
    log.info("weights requested", action=action, request=n)
    end = time.monotonic() + timeout_s
    while True:
        records = members_records()
        if all(w.request >= n and w.state is target for _, w in records):
            return ok(msg=f"{what} successfully", request=n)
        rec = store.read_cluster()
        if rec.weights_cancelled == n:  # withdrawn: no rank applied it, every rank goes back to its previous state
            return refuse(f"{what} cancelled: {rec.weights_cancel_reason}", 409, request=n, ranks=rec.held_by)
        failed = [(r, w) for r, w in records if w.request >= n and w.state is not target
                  and w.state not in (WeightState.UPDATING, WeightState.CLEARING)]
        if failed:
            detail = "; ".join(f"rank {r} {w.state}{': ' + w.reason if w.reason else ''}" for r, w in failed)
            return refuse(f"{what} failed: {detail}", 404, request=n)
        left = end - time.monotonic()
        if left <= 0:
            late = [r for r, w in records if not (w.request >= n and w.state is target)]
            return refuse(f"{what} timeout: ranks {late} not {target} after {timeout_s:g} s (request {n})", 404,
                          request=n)
        if shutdown is not None and shutdown.is_set():
            return refuse(f"server shutting down; {what} request {n} stays made", 503, request=n)
        store.wait(cursor, int(min(left, SHUTDOWN_POLL_MS / 1000) * 1000) + 1)


# ---- GET /health ---------------------------------------------------------------------------------------------------
def health(store: Store) -> Reply:
    """200 when Redis answers, every member rank (all of ``ep_size`` but EXCLUDED ones) is registered and has a
    live heartbeat (one that has not outlived the TTL its agent wrote with it: the coordinator's rule) and every
    logical expert has a replica on a member; else 503 naming the ranks and why (``not registered``: e.g. Redis lost
    its data and no agent registered again; :func:`fdeplb.status.unhealthy_ranks`), or the experts a lost rank left
    without a replica (:func:`fdeplb.status.degraded_experts`: a re-placement failed closed), or the audited
    ``probe_mismatch`` of a committed swap whose output probe failed (the cluster record's ``probe_mismatch``,
    until a later round swaps with no probe failing, the rollback: :mod:`fdeplb.orchestration.rollback`). A fixed number of round trips,
    however many ranks."""
    try:
        registered, unhealthy = unhealthy_ranks(store)
        degraded = None if unhealthy else degraded_experts(store)
        mismatch = "" if unhealthy or degraded else store.read_cluster().probe_mismatch
    except (CorruptRecordError, NotFoundError) as err:  # unhealthy, and why (the probe says one phrase): a corrupt
        return refuse(f"cluster state unreadable: {err}", 503)  # record, or no cluster (deleted, Redis lost it)
    if unhealthy:
        why = "; ".join(f"rank {r} {text}" for r, text in unhealthy.items())
        return refuse(f"ranks {sorted(unhealthy)} have no live heartbeat ({why})", 503, ranks=registered)
    if degraded:
        orphans = degraded["orphans"]
        shown = ", ".join(f"[{l}, {e}]" for l, e in orphans[:10]) + (f" and {len(orphans) - 10} more"
                                                                     if len(orphans) > 10 else "")
        return refuse(f"degraded: {len(orphans)} experts (layer, log_id) have no replica on a member rank: {shown} "
                      f"(ranks {degraded['ranks']} are not members)", 503, ranks=registered, orphans=orphans)
    if mismatch:  # cleared by the swapped of a later round with no probe failing (the rollback's)
        return refuse(f"a swap's output probe failed; rolling back: {mismatch}", 503, ranks=registered,
                      probe_mismatch=mismatch)
    return ok(ranks=registered)


#: /health answers within this many seconds: past it, 503 "Redis unavailable" (a frozen Redis would hold its reads
#: for the socket timeout, 30 s, and a load balancer's or Kubernetes' probe gives up after a few seconds)
HEALTH_DEADLINE_S = 5.0

#: the one phrase an anonymous /health gives for each way the cluster is unhealthy (nothing else of the cluster)
HEALTH_PHRASES = {"ranks": "a rank has no live heartbeat", "degraded": "an expert has no replica on a member rank",
                  "probe": "a swap's output probe mismatched", "redis": "Redis unavailable",
                  "unreadable": "cluster state unreadable"}


def probe_health(store: Store) -> Reply:
    """``/health`` for a caller without credentials (a load balancer's or Kubernetes' probe, FastDeploy's health
    check): 200 ``{"code": 0, "msg": "ok"}`` when :func:`health` is, else 503 with one phrase of
    :data:`HEALTH_PHRASES` and no cluster data (no rank ids, counts, addresses or Redis URL)."""
    try:
        status, body = health(store)
    except RedisUnavailableError:
        return refuse(HEALTH_PHRASES["redis"], 503)
    except FdeplbError:  # a record that does not parse, a store error: unhealthy, the details are the operator's
        return refuse(HEALTH_PHRASES["unreadable"], 503)
    if status == 200:
        return ok()
    if str(body.get("msg", "")).startswith("cluster state unreadable"):
        return refuse(HEALTH_PHRASES["unreadable"], 503)
    return refuse(HEALTH_PHRASES["degraded" if body.get("orphans") else "probe" if body.get("probe_mismatch")
                                 else "ranks"], 503)


# ---- read-only /v1 routes ------------------------------------------------------------------------------------------
def state(store: Store) -> dict[str, Any]:
    """Every machine's record now (``fdeplb status --json``) plus the ranks' registered API addresses (none when the
    registry does not parse: it is then listed in ``corrupt``). A record that does not parse is listed in
    ``corrupt`` and the others are shown (200: the service works, part of the data is bad); a corrupt configuration
    is a :class:`~fdeplb.errors.CorruptRecordError` (500)."""
    out = cluster_status(store)
    try:
        info = store.rank_info()
    except CorruptRecordError:
        info = {}
    out["api_addresses"] = {str(r): i.get("api_address") for r, i in sorted(info.items())}
    return out


def _int_param(value: str | None, name: str, default: int, lo: int, hi: int) -> int:
    """A query parameter's integer in [lo, hi] (``default`` when absent): ASCII digits only (``int()`` would take
    ``"1_0"``, ``" 12"`` or Arabic-Indic digits), then :func:`fdeplb.checks.check_int`; :class:`InputError`
    (400) naming it. Checked here, after the route authenticated, not by FastAPI before it (``Query(ge=, le=)``
    would answer a bad value to a caller without credentials, and with a 422 in an app that mounts the router)."""
    if value is None:
        return default
    if not re.fullmatch(r"[0-9]{1,9}", value):
        raise InputError(f"{name} must be an integer in [{lo}, {hi}], got {value[:40]!r}")
    return check_int(int(value), name, lo=lo, hi=hi)


def audit(store: Store, since: str | None, limit: str | None, wait_ms: str | None,
          shutdown: threading.Event | None = None) -> dict[str, Any]:
    """Audit records after stream id ``since`` (all when absent), at most ``limit``; with ``wait_ms``, wait that
    long for the first new record when there is none yet (long poll, for ``fdeplb audit --url --follow``), or until
    ``shutdown`` is set (looked at every :data:`SHUTDOWN_POLL_MS`)."""
    if since is not None:
        try:
            parse_stream_id(since)
        except InputError:
            raise InputError(f"since must be an audit id like 1700000000000-0, got {since[:40]!r}") from None
    count = _int_param(limit, "limit", 1000, 1, MAX_AUDIT_LIMIT)
    wait = _int_param(wait_ms, "wait_ms", 0, 0, MAX_WAIT_MS)
    start = "-" if since is None else f"({since}"
    cursor = store.cursor() if wait else None
    end = time.monotonic() + wait / 1000
    while True:
        records = store.audit(start, "+", count=count)
        left = end - time.monotonic()
        if records or cursor is None or left <= 0 or (shutdown is not None and shutdown.is_set()):
            break
        store.wait(cursor, min(int(left * 1000) + 1, SHUTDOWN_POLL_MS))
    last = records[-1].id if records else (since or "0-0")
    return {"records": [audit_dict(r) for r in records], "last_id": last}


PLACEMENT_MEDIA = {"sglang": "application/json", "fastdeploy": "application/json", "trtllm": "application/yaml",
                   "fdeplb": "application/json"}


def placement(store: Store, fmt: str | None) -> tuple[str, str] | dict[str, Any]:
    """The current placement: phy2log / log2phy / logcnt as JSON (with ``live_ranks``, the members it was committed
    for: log2phy and logcnt then name only their slots, exactly what every member's engine routes with;
    ``layer_ids``: the model layer of every row), or (text, media type) of a placement file in ``fmt`` (one of
    :data:`fdeplb.placement.FORMATS`, with the model's layers: :func:`fdeplb.status.placement_file`)."""
    import numpy as np

    from fdeplb.placement import live_maps
    from fdeplb.placement.core import Placement
    from fdeplb.status import placement_file

    if fmt is not None:
        text = placement_file(store, fmt)
        return text, PLACEMENT_MEDIA[fmt]
    cfg = store.read_config()
    current = store.current_placement()
    pl = Placement.from_phy2log(current.phy2log, cfg.num_logical_experts, policy=cfg.policy,
                                num_groups=cfg.num_groups, num_nodes=cfg.num_nodes, num_gpus=cfg.ep_size)
    live = np.zeros(cfg.ep_size, dtype=bool)
    live[list(current.live_ranks(cfg.ep_size))] = True
    log2phy, logcnt = (pl.log2phy, pl.logcnt) if live.all() else live_maps(
        current.phy2log, cfg.num_logical_experts, cfg.ep_size, live)  # routes name live slots only
    return {"plan_id": current.plan_id, "version": current.version, "num_logical_experts": cfg.num_logical_experts,
            "num_physical_experts": cfg.num_physical_experts, "ep_size": cfg.ep_size,
            "live_ranks": np.flatnonzero(live).tolist(), "layer_ids": cfg.model_layer_ids,
            "phy2log": pl.phy2log.tolist(), "log2phy": log2phy.tolist(), "logcnt": logcnt.tolist()}


def statechart_svg(machine: str, folder: Path | None) -> str:
    """The SVG diagram of ``machine`` (a table name): from ``folder`` (default the checkout's statecharts/), else
    rendered with Graphviz. :class:`NotFoundError` for an unknown machine."""
    from fdeplb.machines.diagrams import default_dir, dot, render_svg
    from fdeplb.machines.tables import TABLES

    if machine not in TABLES:
        raise NotFoundError(f"no machine {machine[:40]!r}; machines: {', '.join(TABLES)}")
    if folder is None:
        try:
            folder = default_dir()
        except InputError:
            folder = None
    if folder is not None and (folder / f"{machine}.svg").is_file():
        return (folder / f"{machine}.svg").read_text(encoding="utf-8")
    return render_svg(dot(TABLES[machine]))
