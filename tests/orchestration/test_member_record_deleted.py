"""A deleted member record (QA HIGH 3 and H2, ``DEL fdeplb:{c}:member:R``) is restored as a corrupt one is
(:mod:`fdeplb.store.member_repair`, audited ``record_repaired``): from the rank's last audited membership record;
without one the initial ACTIVE v0 when the audit is whole, else EXCLUDED (a trimmed audit does not tell: fail
closed), so an excluded rank is never silently readmitted. Only a cluster made before membership (no member record
at all, generation 0) leaves them missing (read as ACTIVE). Status, metrics and the UI show a deleted record at once
as the coordinator will restore it; after one coordinator pass none is missing (QA M4)."""

from __future__ import annotations

import json

import pytest
import redis
import structlog

from fdeplb.cli import main
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.orchestration.membership import MembershipWatch, operator_fire
from fdeplb.replay import replay_file
from tests.helpers import wait_for
from tests.orchestration.helpers import lose_rank3

M = MemberState


def _two_ranks(redis_url, cluster_id):
    from tests.sim.helpers import two_rank_cluster  # 2 ranks, initialised, nothing running

    return two_rank_cluster(redis_url, cluster_id)


def test_a_deleted_record_is_restored_from_the_audit_and_an_unaudited_one_as_initial(redis_url, cluster_id):
    store = _two_ranks(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    def member(r):
        return f"fdeplb:{{{cluster_id}}}:member:{r}"

    try:
        operator_fire(store, 1, "drain", who="op", reason="maintenance")  # rank 1: DRAINING v1, audited
        drained = store.audit()[-1]
        raw.delete(member(0), member(1))
        audited, head = store.member_audits([0, 1])
        assert audited.keys() == {1} and audited[1][0] == drained.id and audited[1][1]["to"] == "DRAINING"
        assert head == store.audit()[-1].id
        assert store.member_audits([0, 1], after=head) == ({}, head)  # nothing newer: walks nothing
        # never trimmed: rank 0's history is all there, and holds no membership of it
        fixed = store.repair_member(0, fence="", actor="test")
        assert (fixed.record.state, fixed.record.version, fixed.source) == (M.ACTIVE, 0, "initial")
        fixed = store.repair_member(1, fence="", actor="test")
        assert (fixed.record.state, fixed.record.version, fixed.source) == (M.DRAINING, 1, drained.id)
        note = store.audit()[-1]
        assert (note["trigger"], note["key"], note["to"], note["version"]) == ("record_repaired", "member:1",
                                                                                "DRAINING", "1")
        assert "missing (deleted)" in note["reason"] and json.loads(note["detail"])["found"] == {}
        assert [m and m.state for m in store.member_view().members] == [M.ACTIVE, M.DRAINING]
        assert store.repair_member(1, fence="", actor="test") is None  # sound now
    finally:
        store.delete_cluster()


def test_the_membership_watch_restores_a_deleted_record_before_it_acts(redis_url, cluster_id):
    store = _two_ranks(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    try:
        operator_fire(store, 1, "drain", who="op", reason="maintenance")
        raw.delete(f"fdeplb:{{{cluster_id}}}:member:1")
        watch = MembershipWatch(store, "coord-a", structlog.get_logger())
        watch.observe("", 60_000, ClusterState.FREE)
        # restored DRAINING, then drained out (no round in flight): never ACTIVE again
        assert [a["trigger"] for a in store.audit() if a["key"] == "member:1"][-2:] == ["record_repaired", "drained"]
        assert store.read(MEMBERSHIP, 1).state is M.EXCLUDED and watch.view.states() == [M.ACTIVE, M.EXCLUDED]
        length = store.audit_length()
        watch.observe("", 60_000, ClusterState.FREE)
        assert store.audit_length() == length  # nothing more to do
    finally:
        store.delete_cluster()


def test_readers_show_a_deleted_record_as_the_coordinator_will_restore_it_at_once(redis_url, cluster_id):
    from fdeplb.api.prometheus import ClusterCollector
    from fdeplb.status import cluster_status, unhealthy_ranks
    from fdeplb.ui.view_model import LiveReadModel

    store = _two_ranks(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    try:
        operator_fire(store, 1, "drain", who="op", reason="maintenance")  # rank 1: DRAINING, then drained out
        MembershipWatch(store, "coord-a", structlog.get_logger()).observe("", 60_000, ClusterState.FREE)
        assert store.read(MEMBERSHIP, 1).state is M.EXCLUDED
        length = store.audit_length()
        raw.delete(*(f"fdeplb:{{{cluster_id}}}:member:{r}" for r in (0, 1)))  # no coordinator pass after this
        status = cluster_status(store)  # fdeplb status, GET /v1/state
        assert [r["membership"] for r in status["ranks"]] == [M.ACTIVE, M.EXCLUDED] and status["live_ranks"] == [0]
        assert status["corrupt"] == [] and status["ranks"][1]["routing"] in (None, "not_member")
        assert [r["membership"] for r in LiveReadModel(store).view()["ranks"]] == ["ACTIVE", "EXCLUDED"]
        gauge = {f.name: f for f in ClusterCollector(store).collect()}["fdeplb_membership_ranks"]
        counts = {s.labels["state"]: s.value for s in gauge.samples}
        assert (counts["ACTIVE"], counts["EXCLUDED"]) == (1, 1)
        assert unhealthy_ranks(store)[1] == {0: "not registered"}  # an excluded rank is not waited for
        assert store.audit_length() == length and raw.exists(f"fdeplb:{{{cluster_id}}}:member:1") == 0  # reads only
    finally:
        store.delete_cluster()


@pytest.mark.slow  # a thread cluster
def test_a_deleted_member_record_of_an_excluded_rank_does_not_readmit_it_unaudited(redis_url, cluster_id, tmp_path):
    with lose_rank3(redis_url, cluster_id, tmp_path) as (tc, store):
        raw = redis.Redis.from_url(redis_url)
        audited = [a for a in store.iter_audit() if a["key"] == "member:3"]
        raw.delete(f"fdeplb:{{{cluster_id}}}:member:3")
        # the leading coordinator's watch passes several times within this deadline (as for a corrupt record)
        notes = wait_for(lambda: [a for a in store.iter_audit() if a["key"] == "member:3"][len(audited):] or None,
                         15, store, "an audited repair of the deleted member:3")
        assert [(a["trigger"], a["to"], a["version"]) for a in notes] == [("record_repaired", "EXCLUDED",
                                                                           audited[-1]["version"])]
        assert json.loads(notes[0]["detail"])["source"] == audited[-1].id
        assert store.read(MEMBERSHIP, 3).state is M.EXCLUDED
        tc.stop()
        path = tmp_path / "deleted.jsonl"  # the note matches the record as replayed
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        assert replay_file(path).final["member:3"].state == "EXCLUDED"


def test_readers_walk_no_audit_for_missing_records_while_no_member_ever_transitioned(redis_url, cluster_id,
                                                                                   monkeypatch):
    # a cluster made before membership has no member records: every status read walked the whole audit
    from fdeplb.status import cluster_status

    store = _two_ranks(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.delete(*(f"fdeplb:{{{cluster_id}}}:member:{r}" for r in (0, 1)))
        assert store.read_cluster().generation == 0

        def walked(*args, **kwargs):
            raise AssertionError("the audit was walked")

        monkeypatch.setattr(type(store), "member_audits", walked)
        assert [r["membership"] for r in cluster_status(store)["ranks"]] == [M.ACTIVE, M.ACTIVE]
    finally:
        store.delete_cluster()


@pytest.fixture
def two(redis_url, cluster_id):
    """(a cluster of 2 ranks, initialised, nothing running; a raw client); the cluster deleted after the test."""
    store = _two_ranks(redis_url, cluster_id)
    yield store, redis.Redis.from_url(redis_url)
    store.delete_cluster()


def _member(store, r):
    return f"fdeplb:{{{store.cluster}}}:member:{r}"


def _trim(store, tmp_path):
    """Append 3 notes, then export and trim all but the newest 2 audit records (``audit_keep``), as a round's end
    does: the membership records before them leave the stream."""
    for i in range(3):
        store.append_note(store.read_cluster(), trigger="alarm", actor="test", reason=f"filler {i}")
    (tmp_path / "audit").mkdir(exist_ok=True)
    assert store.trim_audit(2, str(tmp_path / "audit" / "export.jsonl"), str(tmp_path / "audit"), fence="") > 0


def test_a_deleted_record_of_an_excluded_rank_whose_audit_was_trimmed_stays_excluded(two, tmp_path):
    # QA H2: rank 1 drained out, the drain records exported and trimmed, then its member record deleted
    from fdeplb.api.prometheus import ClusterCollector
    from fdeplb.status import cluster_status, unhealthy_ranks

    store, raw = two
    operator_fire(store, 1, "drain", who="op", reason="maintenance")
    watch = MembershipWatch(store, "coord-a", structlog.get_logger())
    watch.observe("", 60_000, ClusterState.FREE)
    assert store.read(MEMBERSHIP, 1).state is M.EXCLUDED
    _trim(store, tmp_path)
    assert not [a for a in store.audit() if a["machine"] == "membership"]  # exported, trimmed
    raw.delete(_member(store, 1))
    # readers: as the coordinator will restore it (the audit does not tell: excluded), never ACTIVE
    status = cluster_status(store)
    assert [r["membership"] for r in status["ranks"]] == [M.ACTIVE, M.EXCLUDED] and status["live_ranks"] == [0]
    assert unhealthy_ranks(store)[1] == {0: "not registered"}
    gauge = {f.name: f for f in ClusterCollector(store).collect()}["fdeplb_membership_ranks"]
    assert {s.labels["state"]: s.value for s in gauge.samples}["ACTIVE"] == 1
    # the coordinator's next pass restores it so, audited
    watch.observe("", 60_000, ClusterState.FREE)
    note = store.audit()[-1]
    assert (note["trigger"], note["key"], note["to"]) == ("record_repaired", "member:1", "EXCLUDED")
    assert json.loads(note["detail"])["source"] == "excluded" and "(trimmed)" in note["reason"]
    assert store.read(MEMBERSHIP, 1).state is M.EXCLUDED and watch.view.states() == [M.ACTIVE, M.EXCLUDED]


def test_one_coordinator_pass_leaves_no_record_missing_and_readers_walk_no_more(two, monkeypatch):
    # QA M4: a never-transitioned rank's record deleted while the generation is above 0 (rank 1 drained)
    from fdeplb.status import cluster_status

    store, raw = two
    operator_fire(store, 1, "drain", who="op", reason="maintenance")
    raw.delete(_member(store, 0))
    MembershipWatch(store, "coord-a", structlog.get_logger()).observe("", 60_000, ClusterState.FREE)
    assert None not in store.member_view().members
    note = [a for a in store.audit() if a["key"] == "member:0"][-1]
    assert (note["trigger"], note["to"], note["version"]) == ("record_repaired", "ACTIVE", "0")
    assert json.loads(note["detail"])["source"] == "initial"  # the audit is whole and holds none of rank 0

    def walked(*args, **kwargs):
        raise AssertionError("the audit was walked")

    monkeypatch.setattr(type(store), "member_audits", walked)
    assert [r["membership"] for r in cluster_status(store)["ranks"]] == [M.ACTIVE, M.EXCLUDED]


def test_a_cluster_made_before_membership_is_left_as_it_is(two):
    # no member record at all and generation 0: nothing restored, every rank counts ACTIVE
    store, raw = two
    raw.delete(_member(store, 0), _member(store, 1))
    length = store.audit_length()
    watch = MembershipWatch(store, "coord-a", structlog.get_logger())
    watch.observe("", 60_000, ClusterState.FREE)
    assert store.repair_member(0, fence="", actor="test") is None
    assert store.audit_length() == length and watch.view.states() == [M.ACTIVE, M.ACTIVE]
    assert store.member_view().members == [None, None]
    # one record there: the other was deleted, and is restored (whole audit: the initial state)
    raw.hset(_member(store, 1), mapping={"state": "ACTIVE", "version": "0"})
    watch.observe("", 60_000, ClusterState.FREE)
    assert store.read(MEMBERSHIP, 0).state is M.ACTIVE and store.audit()[-1]["trigger"] == "record_repaired"


def test_a_record_restored_twice_keeps_its_generation(two):
    # QA L2: the second restore reads the first repair's note, which carries the generation
    store, raw = two
    operator_fire(store, 1, "drain", who="op", reason="maintenance")
    assert store.read(MEMBERSHIP, 1).generation == 1
    for _ in range(2):
        raw.delete(_member(store, 1))
        fixed = store.repair_member(1, fence="", actor="test")
        assert (fixed.record.state, fixed.record.generation) == (M.DRAINING, 1)
        assert json.loads(store.audit()[-1]["detail"])["generation"] == 1
    assert store.audit()[-2]["trigger"] == "record_repaired"  # the second restored from the first's note
    assert json.loads(store.audit()[-1]["detail"])["source"] == store.audit()[-2].id


def test_the_audit_is_whole_until_trimmed_or_deleted(two, tmp_path):
    # whole: its oldest record chains from nothing (the first ever appended)
    store, raw = two
    assert store.whole_audit()
    _trim(store, tmp_path)
    assert not store.whole_audit()
    raw.delete(f"fdeplb:{{{store.cluster}}}:audit")  # the stream lost, its head kept: history is gone
    assert not store.whole_audit()
    store.append_note(store.read_cluster(), trigger="alarm", actor="test", reason="after the loss")
    assert not store.whole_audit()  # chained after the lost head, not from nothing
    raw.delete(f"fdeplb:{{{store.cluster}}}:audit", f"fdeplb:{{{store.cluster}}}:audit_head")
    assert store.whole_audit()  # nothing ever appended


def test_a_corrupt_record_without_a_version_is_restored_by_the_same_rule(two, tmp_path):
    # its version field gone, it does not say it never transitioned: initial while the audit is whole, else excluded
    store, raw = two
    for expected in ((M.ACTIVE, 0, "initial"), (M.EXCLUDED, 0, "excluded")):
        raw.hdel(_member(store, 0), "version")
        raw.hset(_member(store, 0), "state", "BOGUS")
        fixed = store.repair_member(0, fence="", actor="test")
        assert (fixed.record.state, fixed.record.version, fixed.source) == expected
        _trim(store, tmp_path)


def test_actions_judge_a_deleted_record_as_the_coordinator_will_restore_it(two):
    # review: an operator's plan and a drain's last-member check read the raw view, where a deleted record counted
    # ACTIVE until the coordinator's pass: a plan routing experts only to an EXCLUDED rank was accepted
    import numpy as np

    from fdeplb.errors import InputError, StateError
    from fdeplb.orchestration.rollback import check_operator_plan

    store, raw = two
    operator_fire(store, 1, "drain", who="op", reason="maintenance")
    MembershipWatch(store, "coord-a", structlog.get_logger()).observe("", 60_000, ClusterState.FREE)
    assert store.read(MEMBERSHIP, 1).state is M.EXCLUDED
    raw.delete(_member(store, 1))  # no coordinator pass after this
    assert store.restored_view().states() == [M.ACTIVE, M.EXCLUDED]
    plan = np.tile(np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]), (2, 1))  # experts 4-7 only on rank 1
    with pytest.raises(InputError, match="without a replica on an ACTIVE member"):
        check_operator_plan(store, plan)
    with pytest.raises((StateError, InputError)):  # rank 0 is the last member: never drained
        operator_fire(store, 0, "drain", who="op", reason="last one")
    assert store.read(MEMBERSHIP, 0).state is M.ACTIVE
