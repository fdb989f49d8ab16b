"""The membership machine over Redis: records made ACTIVE by init, each transition raising the cluster generation in
its commit step (record, cluster and audit agree), generation fencing of cluster commits, guards counting ACTIVE
members only, the replay reading member records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdeplb.errors import GenerationError, GuardError, IllegalTransitionError, StaleStateError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, MemberState
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.recording import audit_dict
from fdeplb.replay import parse_lines, replay
from fdeplb.store import ClusterConfig, Store
from tests.helpers import RawRedis

EP = 3
M = MemberState


def make(url: str, cluster: str) -> tuple[Store, RawRedis]:
    store = Store(url, cluster)
    cfg = ClusterConfig(num_layers=1, num_logical_experts=6, num_physical_experts=6, ep_size=EP)
    init_cluster(store, cfg, np.arange(6, dtype=np.int64).reshape(1, 6))
    return store, RawRedis(url, cluster)


def member(store: Store, r: int) -> RecordHandle:
    return RecordHandle(store, MEMBERSHIP, r, actor="test")


def test_init_makes_every_rank_an_active_member_at_generation_0(redis_url, cluster_id):
    store, _ = make(redis_url, cluster_id)
    recs = store.read_all(MEMBERSHIP)
    assert [(r.state, r.version, r.key) for r in recs] == [
        (M.ACTIVE, 0, f"fdeplb:{{{cluster_id}}}:member:{r}") for r in range(EP)]
    assert store.read_cluster().generation == 0
    assert store.read_config().deadlines.exclude_ms == 30_000


PATHS = [
    ("suspect", "recover"),
    ("suspect", "exclude", "rejoin", "admit"),
    ("drain", "drained", "readmit"),
    ("drain", "readmit"),
]


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_each_transition_bumps_the_generation_in_the_same_step(redis_url, cluster_id, path):
    store, _ = make(redis_url, cluster_id)
    handle = member(store, 1)
    state = M.ACTIVE
    for n, trigger in enumerate(path, start=1):
        fired = handle.fire(trigger)
        state = MEMBERSHIP.spec(state, trigger).dest
        rec = handle.read()
        assert rec.state == fired.state == state
        assert rec.generation == n == store.read_cluster().generation
        entry = store.audit()[-1]
        assert (entry["machine"], entry["key"], entry["trigger"], entry["generation"]) == (
            "membership", "member:1", trigger, str(n))
    assert store.read_cluster().version == 0  # the cluster record's state and version are not touched


@pytest.mark.parametrize("state,trigger", [
    (M.ACTIVE, "exclude"), (M.ACTIVE, "recover"), (M.EXCLUDED, "suspect"), (M.DRAINING, "exclude"),
    (M.SUSPECT, "drain"), (M.REJOINING, "readmit"), (M.ACTIVE, "admit")])
def test_illegal_member_transitions_change_nothing(redis_url, cluster_id, state, trigger):
    store, raw = make(redis_url, cluster_id)
    raw.force(raw.keys.member(2), state, version=3)
    before = raw.snapshot()
    with pytest.raises(IllegalTransitionError):
        member(store, 2).fire(trigger)
    assert raw.snapshot() == before


def test_a_cluster_commit_under_an_older_generation_is_refused(redis_url, cluster_id):
    store, raw = make(redis_url, cluster_id)
    lease = store.acquire_lease("test", 60_000)
    read = store.read_cluster()  # generation 0
    member(store, 0).fire("suspect")  # generation 1 meanwhile
    before = raw.snapshot()
    cluster = RecordHandle(store, CLUSTER, actor="test", fence=lease)
    with pytest.raises(GenerationError, match="generation 0.*generation 1") as err:
        cluster.fire("start", record=read, plan_id="", changes={"round": 1})
    assert isinstance(err.value, StaleStateError)  # the coordinator reads again and retries
    assert raw.snapshot() == before
    fired = cluster.fire("start", plan_id="", changes={"round": 1})  # read again: generation 1, allowed
    assert fired.state == "COLLECTING" and store.audit()[-1]["generation"] == "1"


def test_per_rank_guards_count_active_members_only(redis_url, cluster_id):
    store, raw = make(redis_url, cluster_id)
    lease = store.acquire_lease("test", 60_000)
    raw.force(raw.keys.rank(2), "LOADING")  # rank 2 is busy: the start's guard refuses while it is a member
    cluster = RecordHandle(store, CLUSTER, actor="test", fence=lease)
    with pytest.raises(GuardError, match="rank:2 is LOADING"):
        cluster.fire("start", plan_id="", changes={"round": 1})
    for trigger in ("suspect", "exclude"):
        member(store, 2).fire(trigger)
    assert cluster.fire("start", plan_id="", changes={"round": 1}).state == "COLLECTING"


def test_no_active_member_is_a_guard_refusal(redis_url, cluster_id):
    store, raw = make(redis_url, cluster_id)
    lease = store.acquire_lease("test", 60_000)
    for r in range(EP):
        raw.force(raw.keys.member(r), M.EXCLUDED)
    with pytest.raises(GuardError, match="no rank is an ACTIVE member"):
        RecordHandle(store, CLUSTER, actor="test", fence=lease).fire("start", plan_id="", changes={"round": 1})


def test_the_replay_reads_member_transitions(redis_url, cluster_id):
    store, _ = make(redis_url, cluster_id)
    for trigger in ("suspect", "exclude"):
        member(store, 1).fire(trigger)
    report = replay(parse_lines([json.dumps(audit_dict(e)) for e in store.iter_audit()]))
    assert report.final["member:1"].state == "EXCLUDED" and report.final["member:1"].transitions == 2
