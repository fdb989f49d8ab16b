"""The store as the Redis boundary: typed records in and out, redis-py errors mapped once, corrupt values typed."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from fdeplb.errors import CorruptRecordError, InputError, NotFoundError, RedisUnavailableError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, ClusterState, RankState, WeightState
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, ClusterRecord, PlanEntry, RankRecord, Store, WeightRecord
from fdeplb.store.records import encode_changes, parse_record
from tests.helpers import RawRedis


@pytest.fixture
def store(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=2, num_logical_experts=4, num_physical_experts=6, ep_size=2),
                 np.array([[0, 1, 2, 3, 0, 1]] * 2))
    yield store
    store.delete_cluster()


def test_records_come_back_typed(store):
    cluster = store.read_cluster()
    assert isinstance(cluster, ClusterRecord) and cluster.state is ClusterState.FREE and cluster.version == 0
    ranks = store.read_all(RANK)
    assert [type(r) for r in ranks] == [RankRecord, RankRecord] and ranks[1].state is RankState.IDLE
    assert ranks[0].live_plan_id is None  # no agent has loaded yet
    assert store.read_weights(1).state is WeightState.NORMAL
    store.update(RANK, 1, heartbeat_ms=5, live_plan_id="", stage_ms=1.5)
    rank = store.read_rank(1)
    assert (rank.heartbeat_ms, rank.live_plan_id, rank.stage_ms) == (5, "", 1.5)
    placement = store.current_placement()
    assert placement.plan_id == "" and placement.version == 0 and placement.phy2log.dtype == np.int64


def test_every_record_field_is_documented():
    import ast
    import inspect

    from fdeplb.store import plan_entry, records

    trees = [ast.parse(inspect.getsource(module)) for module in (records, plan_entry)]
    classes = {n.name: n for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)}
    for cls in (ClusterRecord, RankRecord, WeightRecord, PlanEntry):
        documented = set()
        for node in (classes[c.__name__] for c in cls.__mro__ if c.__name__ in classes):  # a field may be the base's
            documented |= {prev.target.id for prev, nxt in zip(node.body, node.body[1:])
                           if isinstance(prev, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                           and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_unknown_or_commit_only_fields_are_refused(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    before = raw.snapshot()
    with pytest.raises(InputError, match="has no field 'colour'"):
        store.update(RANK, 0, colour="red")
    with pytest.raises(InputError, match="written only by a commit"):
        store.update(CLUSTER, state="DONE")
    with pytest.raises(InputError, match="written only by a commit"):
        encode_changes(WeightRecord, {"version": 3})
    assert raw.snapshot() == before


@pytest.mark.parametrize("field,value,message", [
    ("version", "v7", "field 'version'"),
    ("state", "EXPLODED", "field 'state'"),
    ("round", "1.5", "field 'round'"),
    ("round", "-7", "field 'round' holds '-7', not a valid int"),  # counters, versions and times are >= 0
    ("version", "-1", "field 'version'"),
    ("deadline_ms", "-5", "field 'deadline_ms'"),
    ("requested", str(2**60), "field 'requested'"),  # above 2**53: the Lua scripts' numbers are doubles
])
def test_corrupt_record_values_are_typed_errors(store, redis_url, cluster_id, field, value, message):
    raw = RawRedis(redis_url, cluster_id)
    raw.r.hset(raw.keys.rearrange, field, value)
    with pytest.raises(CorruptRecordError, match=message) as info:
        store.read_cluster()
    assert info.value.key == raw.keys.rearrange  # for readers that go on past it (fdeplb status, the metrics)


def test_read_each_returns_a_corrupt_record_in_its_place(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    raw.r.hset(raw.keys.rank(1), "state", "EXPLODED")
    raw.r.delete(raw.keys.weights(0))
    got = store.read_each(RANK)
    assert len(got) == 2 and got[0].state is RankState.IDLE
    assert isinstance(got[1], CorruptRecordError) and got[1].key == raw.keys.rank(1)
    assert "field 'state' holds 'EXPLODED'" in str(got[1])
    weights = store.read_each(WEIGHTS)
    assert weights[0] is None and weights[1].state is WeightState.NORMAL


def test_corrupt_arrays_and_config_are_typed_errors(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    raw.r.hset(raw.keys.placement, "phy2log", b"\x00" * 5)
    with pytest.raises(CorruptRecordError, match=r"placement: array 'phy2log': 5 bytes are not a whole number of "
                                                 r"int64 elements"):
        store.current_placement()
    for field, value, message in (("phy2log:dtype", "|O", "refused"), ("phy2log:dtype", "nonsense", "not a numpy"),
                                  ("phy2log:shape", "3,x", "not a list of sizes"),
                                  ("phy2log:shape", "-1,8", "not a list of sizes")):
        raw.r.hset(raw.keys.placement, mapping={"phy2log": b"\x00" * 64, "phy2log:dtype": "<i8", "phy2log:shape": "8",
                                                field: value})
        with pytest.raises(CorruptRecordError, match=f"placement: array 'phy2log': .*{message}"):
            store.current_placement()
    raw.r.hset(raw.keys.config, "ep_size", "not json")
    with pytest.raises(CorruptRecordError, match=r"config: field 'ep_size' holds 'not json', which is not JSON"):
        Store(redis_url, cluster_id).read_config()
    raw.r.hset(raw.keys.config, mapping={"ep_size": "4", "deadlines": '{"x": 1}'})
    with pytest.raises(CorruptRecordError) as info:
        Store(redis_url, cluster_id).read_config()
    assert str(info.value).count("not a cluster configuration") == 1, info.value
    raw.r.hset(raw.keys.load(0), mapping={"round": "x", "expert_load": b""})
    with pytest.raises(CorruptRecordError):
        store.load_round(0)


def test_redis_errors_are_mapped_once_at_the_boundary(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    raw.r.delete(raw.keys.rank(0))
    raw.r.set(raw.keys.rank(0), "a string, not a hash")  # another program wrote this key
    with pytest.raises(CorruptRecordError, match=re.escape(f"{raw.keys.rank(0)}: ")) as info:  # names the key
        store.read_rank(0)
    assert info.value.key == raw.keys.rank(0) and "WRONGTYPE" in str(info.value)
    with pytest.raises(RedisUnavailableError, match="unavailable"):
        Store("redis://127.0.0.1:1/0", cluster_id).read_cluster()
    with pytest.raises(NotFoundError):
        store.read_weights(9)


def test_parse_record_needs_state_and_version():
    with pytest.raises(CorruptRecordError, match="without state or version"):
        parse_record(ClusterRecord, "k", {"state": "FREE"})
    rec = parse_record(WeightRecord, "k", {"state": "CLEARED", "version": "2", "from_the_future": "x"})
    assert rec.state is WeightState.CLEARED and rec.version == 2


def test_weight_requests_count_and_refuse_unknown_actions(store):
    assert store.request_weights("clear", "test") == 1
    assert store.request_weights("update") == 2
    rec = store.read_cluster()
    assert (rec.weights_request, rec.weights_action, rec.weights_reason) == (2, "update", "operator")
    with pytest.raises(InputError):
        store.request_weights("explode")
    assert store.read_cluster().weights_request == 2
    assert WEIGHTS.name == "weights"


# ---- calls sent later, in one pipeline (one round trip per rank-agent wake-up) ------------------------
def test_publish_lua_header_names_the_slots_scripts_py_lays_out():
    import re

    from fdeplb.store.scripts import PUBLISH_ARGV, PUBLISH_KEYS, script_text

    text = script_text("publish")
    assert tuple(re.findall(r"^-- KEYS\[(\d+)\]\s+(\w+):", text, re.M)) == (("1", "load"), ("2", "events"))
    assert tuple(n for _, n in re.findall(r"^-- KEYS\[(\d+)\]\s+(\w+):", text, re.M)) == PUBLISH_KEYS
    assert tuple(n for _, n in re.findall(r"^-- ARGV\[(\d+)\]\s+(\w+):", text, re.M)) == PUBLISH_ARGV


def test_wait_view_sends_the_deferred_writes_before_it_blocks_and_reads_the_view_after(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    cursor = store.signal_cursor()
    load = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int64)
    w = store.read_weights(0)
    writes = [store.deferred_publish(0, 3, load),
              store.deferred_commit(WEIGHTS, WEIGHTS.spec(w.state, "clear"), w, actor="t", label="weights:0")]
    assert store.read_load(0) is None and raw.audit_len() == 0  # nothing sent yet
    raw.r.xadd(raw.keys.signal, {"what": "test"})  # a pending wake-up: the wait returns at once
    signals, (cluster, rank, weights), outcomes = store.wait_view(cursor, 0, 2_000, writes)
    assert [s["what"] for s in signals] == ["test"]
    assert isinstance(outcomes[0], int) and outcomes[0] > 0  # the window's published_ms (server time)
    assert outcomes[1].version == w.version + 1
    assert weights.state is WeightState.CLEARING  # the view was read after the writes
    window = store.read_load(0)
    assert window.round == 3 and np.array_equal(window.expert_load, load) and window.published_ms == outcomes[0]
    events = raw.r.xrange(raw.keys.events)
    assert events[-1][1] == {b"kind": b"load_published", b"rank": b"0", b"round": b"3"}
    # nothing new: the wait blocks until its timeout, then reads the view all the same
    signals, view, outcomes = store.wait_view(cursor, 0, 50)
    assert signals == [] and outcomes == [] and view[2].state is WeightState.CLEARING


def test_a_refused_deferred_commit_comes_back_as_its_error_and_writes_nothing(store, redis_url, cluster_id):
    from fdeplb.errors import GuardError, StaleStateError

    raw = RawRedis(redis_url, cluster_id)
    me = store.read_rank(0)
    w = store.read_weights(1)
    stale = dataclasses.replace(w, version=w.version + 7)
    calls = [store.deferred_commit(RANK, RANK.spec(me.state, "stage"), me, actor="t", label="rank:0", plan_id="p1"),
             store.deferred_commit(WEIGHTS, WEIGHTS.spec(w.state, "clear"), stale, actor="t", label="weights:1")]
    before = raw.snapshot()
    outcomes = store.send(calls)
    assert isinstance(outcomes[0], GuardError) and "cluster is FREE" in str(outcomes[0])  # stage needs LOADING
    assert isinstance(outcomes[1], StaleStateError)
    assert raw.snapshot() == before


def test_a_deferred_call_survives_a_server_that_lost_its_scripts(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    w = store.read_weights(0)
    seen = []
    call = dataclasses.replace(store.deferred_commit(WEIGHTS, WEIGHTS.spec(w.state, "clear"), w, actor="t",
                                                     label="weights:0"), then=seen.append)
    raw.r.script_flush()  # as after a restart: EVALSHA answers NOSCRIPT
    outcomes = store.send([call, store.deferred_plan_read("no-such-plan")])
    assert outcomes[0].version == w.version + 1 and seen == [outcomes[0]]  # loaded, run, then reported
    assert outcomes[1] is None  # the plan read beside it: no such plan
    assert store.read_weights(0).state is WeightState.CLEARING


def test_rank_states_pairs_and_their_typed_errors(store, redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    assert store.rank_states() == [(RankState.IDLE, ""), (RankState.IDLE, "")]
    raw.force(raw.keys.rank(1), "LOADED", plan_id="p9")
    assert store.rank_states()[1] == (RankState.LOADED, "p9")
    raw.force(raw.keys.rank(1), "SLEEPING")
    with pytest.raises(CorruptRecordError, match="rank:1.*SLEEPING") as err:
        store.rank_states()
    assert err.value.key == raw.keys.rank(1)
    raw.r.hdel(raw.keys.rank(1), "state")  # a record without a state is corrupt, not missing
    with pytest.raises(CorruptRecordError, match="rank:1.*without state") as err:
        store.rank_states()
    assert err.value.key == raw.keys.rank(1)
    raw.r.delete(raw.keys.rank(1))
    with pytest.raises(NotFoundError, match="rank:1"):
        store.rank_states()


def test_read_cluster_at_reads_the_record_and_the_server_clock_together(store, redis_url, cluster_id):
    before = store.now_ms()
    rec, at = store.read_cluster_at()
    assert rec == store.read_cluster()
    assert before <= at <= store.now_ms()
    raw = RawRedis(redis_url, cluster_id)
    raw.force(raw.keys.rearrange, "SLEEPING")
    with pytest.raises(CorruptRecordError, match="SLEEPING"):
        store.read_cluster_at()
    raw.r.delete(raw.keys.rearrange)
    with pytest.raises(NotFoundError, match="cluster record"):
        store.read_cluster_at()


def test_an_audit_record_answers_in_by_its_fields():
    """``name in record`` asks the record's fields (an AuditRecord answers "" for any key, so without
    ``__contains__`` the test would iterate 0, 1, 2, ... forever): reasons.supplied_of reads records this way."""
    from fdeplb.rounds import reasons
    from fdeplb.store import AuditRecord

    rec = AuditRecord("1-0", {"trigger": "load", "detail": ""})
    assert "trigger" in rec and "supplied" not in rec and 0 not in rec
    assert reasons.supplied_of(rec) is None


def test_a_command_redis_never_answered_says_its_change_may_have_been_made(cluster_id, monkeypatch):
    # QA: a config set whose reply timed out said "unavailable" although the change and its note had committed
    import socket

    from fdeplb.store import connection

    monkeypatch.setattr(connection, "SOCKET_TIMEOUT_S", 0.3)
    silent = socket.socket()  # accepts connections and never answers (a frozen Redis)
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        with pytest.raises(RedisUnavailableError, match="may have been made: look") as info:
            Store(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", cluster_id).read_cluster()
        assert "did not answer in time" in str(info.value)
    finally:
        silent.close()
