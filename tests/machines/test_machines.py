"""The machines over Redis: every (state, trigger) pair of every table, guards, races, fencing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fdeplb.errors import FenceError, GuardError, IllegalTransitionError, StaleStateError, StateError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, TABLES, WEIGHT_CANCELS, WEIGHTS
from fdeplb.machines.tables import Effect
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.store import ClusterConfig, PlanEntry, Store
from tests.helpers import RawRedis, wait_for

EP = 2
PLAN = "p1"


def make_cluster(url: str, cluster: str) -> tuple[Store, RawRedis]:
    store = Store(url, cluster)
    cfg = ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=EP)
    init_cluster(store, cfg, np.arange(4, dtype=np.int64).reshape(1, 4))
    return store, RawRedis(url, cluster)


def record_key(raw: RawRedis, table) -> str:
    """Key of the record the tests drive: the cluster's, or rank 1's rank / weights record."""
    return {CLUSTER: raw.keys.rearrange, RANK: raw.keys.rank(1), WEIGHTS: raw.keys.weights(1),
            MEMBERSHIP: raw.keys.member(1)}[table]


def satisfy_guards(store: Store, raw: RawRedis, table, trigger: str) -> None:
    """Make every guard of ``trigger`` hold (for the legal pairs of the table-driven test)."""
    plan = np.array([[3, 2, 1, 0]], dtype=np.int64)
    store.save_plan(PlanEntry(plan_id=PLAN, round=1, policy="deepseek", old_plan_id="", topology={},
                              expert_load=np.ones((1, 4), np.int64), old_phy2log=np.arange(4).reshape(1, 4),
                              new_phy2log=plan, balancedness_before=0.5, balancedness_after=1.0, moved_experts=2))
    rank_state = {"loaded": "LOADED", "commit": "LOADED", "swapped": "SWAPPED"}.get(trigger, "IDLE")
    if table is CLUSTER:
        for r in range(EP):
            raw.force(raw.keys.rank(r), rank_state, plan_id=PLAN)
    if table is RANK:
        cluster_state = {"stage": "LOADING", "swap": "SWAPPING"}.get(trigger, "FREE")
        raw.force(raw.keys.rearrange, cluster_state, plan_id=PLAN)
    if table is WEIGHTS and trigger in WEIGHT_CANCELS.values():  # a withdrawn request, from the cancel's dest
        prior = next(s for s, t in WEIGHT_CANCELS.items() if t == trigger)
        raw.r.hset(raw.keys.rearrange, mapping={"weights_request": "3", "weights_cancelled": "3"})
        raw.r.hset(raw.keys.weights(1), mapping={"request": "3", "prior": prior.value})


def fire_args(table):
    if table is CLUSTER:
        return {"fence": "LEASE"}
    return {}


CASES = [(t.name, s, trig) for t in TABLES.values() for s in t.states for trig in t.triggers]


@pytest.mark.parametrize("table_name,state,trigger", CASES, ids=[f"{a}-{b}-{c}" for a, b, c in CASES])
def test_every_state_trigger_pair(redis_url, cluster_id, table_name, state, trigger):
    """Every (state, trigger) either reaches the table's destination with version + 1 and exactly one audit
    record, or raises IllegalTransitionError and leaves every key of the cluster unchanged."""
    store, raw = make_cluster(redis_url, cluster_id)
    table = TABLES[table_name]
    lease = store.acquire_lease("test", 60_000)
    handle = RecordHandle(store, table, None if table is CLUSTER else 1, actor="test",
                          fence=lease if table is CLUSTER else "")
    satisfy_guards(store, raw, table, trigger)
    raw.force(record_key(raw, table), state, version=5, plan_id=PLAN)
    try:
        spec = table.spec(state, trigger)
    except IllegalTransitionError:
        spec = None
    before = raw.snapshot()
    audit_len = raw.audit_len()
    if spec is None:
        with pytest.raises(IllegalTransitionError):
            handle.fire(trigger, plan_id=PLAN)
        assert raw.snapshot() == before
        return
    fired = handle.fire(trigger, plan_id=PLAN)
    rec = handle.read()
    assert fired.state == rec.state == spec.dest
    assert rec.version == 6
    assert raw.audit_len() == audit_len + 1
    entry = store.audit()[-1]
    assert (entry["machine"], entry["from"], entry["to"], entry["trigger"], entry["version"]) == (
        table.name, state, spec.dest, trigger, "6")
    if spec.effect is Effect.SET_PLACEMENT:
        placement = store.current_placement()
        assert placement.plan_id == PLAN and placement.phy2log.tolist() == [[3, 2, 1, 0]]
    store.delete_cluster()


def test_codes_both_ways():
    assert [CLUSTER.to_code(s) for s in CLUSTER.states] == [0, 1, 1, 1, 2, 2, 3]
    assert [RANK.to_code(s) for s in RANK.states] == [0, 0, 1, -1, 1, 1]
    assert [WEIGHTS.to_code(s) for s in WEIGHTS.states] == [0, 1, -1, -2]
    for table in TABLES.values():
        for state in table.states:
            assert table.to_code(table.from_code(table.to_code(state))) == table.to_code(state)
    assert CLUSTER.from_code(3) == "DONE" and WEIGHTS.from_code(-2) == "CLEARED"


@pytest.mark.parametrize(
    "table,state,trigger,spoil",
    [
        (CLUSTER, "FREE", "start", lambda x: x.force(x.keys.rank(1), "LOADED")),
        (CLUSTER, "FREE", "start", lambda x: x.force(x.keys.weights(0), "CLEARED")),
        (CLUSTER, "PLANNING", "load", lambda x: x.r.delete(x.keys.plan(PLAN))),
        (CLUSTER, "LOADING", "loaded", lambda x: x.force(x.keys.rank(0), "LOADED", plan_id="other")),
        (CLUSTER, "LOADING", "loaded", lambda x: x.force(x.keys.rank(1), "LOAD_FAILED", plan_id=PLAN)),
        (CLUSTER, "LOAD_SUCC", "commit", lambda x: x.force(x.keys.rank(1), "LOAD_FAILED", plan_id=PLAN)),
        (CLUSTER, "SWAPPING", "swapped", lambda x: x.force(x.keys.rank(1), "SWAPPING", plan_id=PLAN)),
        (RANK, "IDLE", "stage", lambda x: x.force(x.keys.rearrange, "FREE", plan_id=PLAN)),
        (RANK, "LOADED", "swap", lambda x: x.force(x.keys.rearrange, "SWAPPING", plan_id="other")),
        (RANK, "LOADED", "abort", lambda x: x.r.hset(x.keys.placement, "plan_id", PLAN)),
        (RANK, "LOADED", "fail", lambda x: x.r.hset(x.keys.placement, "plan_id", PLAN)),
        (WEIGHTS, "NORMAL", "clear", lambda x: x.force(x.keys.rearrange, "LOADING")),
    ],
)
def test_guard_refusals_change_nothing(redis_url, cluster_id, table, state, trigger, spoil):
    store, raw = make_cluster(redis_url, cluster_id)
    lease = store.acquire_lease("test", 60_000)
    handle = RecordHandle(store, table, None if table is CLUSTER else 1, actor="test",
                          fence=lease if table is CLUSTER else "")
    satisfy_guards(store, raw, table, trigger)
    raw.force(record_key(raw, table), state, plan_id=PLAN)
    spoil(raw)
    before = raw.snapshot()
    with pytest.raises(GuardError):
        handle.fire(trigger, plan_id=PLAN)
    assert raw.snapshot() == before
    store.delete_cluster()


def test_two_clients_race_exactly_one_wins(redis_url, cluster_id):
    """Two clients (own connections) read the same record and fire the same trigger at the same time."""
    _, raw = make_cluster(redis_url, cluster_id)
    stores = [Store(redis_url, cluster_id), Store(redis_url, cluster_id)]
    handles = [RecordHandle(s, WEIGHTS, 0, actor=f"client{i}") for i, s in enumerate(stores)]
    records = [h.read() for h in handles]
    audit_len = raw.audit_len()
    barrier = threading.Barrier(2)
    outcomes: list = [None, None]

    def go(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = handles[i].fire("update", record=records[i]).state
        except StateError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    wins = [o for o in outcomes if o == "UPDATING"]
    losses = [o for o in outcomes if isinstance(o, StaleStateError)]
    assert len(wins) == 1 and len(losses) == 1, outcomes
    assert raw.audit_len() == audit_len + 1
    assert handles[0].read().version == 1


def test_deposed_coordinator_is_fenced(redis_url, cluster_id):
    store, raw = make_cluster(redis_url, cluster_id)
    old = store.acquire_lease("old", 300)
    assert old and old.startswith("1:") and store.acquire_lease("new", 300) is None
    wait_for(lambda: store.lease_info().holder is None, 10, what="lease expiry")
    stale = RecordHandle(store, CLUSTER, actor="old", fence=old)
    store.request_round()
    before = raw.snapshot()
    with pytest.raises(FenceError):  # lapsed, nobody else holds it yet: still refused
        stale.fire("start")
    assert raw.snapshot() == before
    new = store.acquire_lease("new", 60_000)
    assert new.startswith("2:")  # the fence only grows
    with pytest.raises(FenceError):
        stale.fire("start")
    assert not store.renew_lease(old, 60_000)
    assert RecordHandle(store, CLUSTER, actor="new", fence=new).fire("start").state == "COLLECTING"


def test_unknown_trigger_is_typed(redis_url, cluster_id):
    store, _ = make_cluster(redis_url, cluster_id)
    with pytest.raises(IllegalTransitionError, match="unknown trigger"):
        RecordHandle(store, RANK, 0, actor="t").fire("explode")


def test_a_standby_coordinator_says_once_whom_it_waits_on(redis_url, cluster_id):
    import structlog.testing

    from fdeplb.orchestration.coordinator import Coordinator

    store, _ = make_cluster(redis_url, cluster_id)
    leader = store.acquire_lease("leader", 60_000)
    standby = Coordinator(store, "standby")
    with structlog.testing.capture_logs() as logs:
        assert not standby.ensure_leadership() and not standby.ensure_leadership()
        assert store.release_lease(leader)
        assert standby.ensure_leadership()
    events = [(e["event"], e.get("leader") or e.get("lease")) for e in logs]
    assert events == [("standing by", leader), ("leading", standby.lease)], logs
