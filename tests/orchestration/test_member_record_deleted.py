"""A deleted member record (QA HIGH 3, ``DEL fdeplb:{c}:member:R``): when the audit holds the rank's membership, the
record is restored from it as a corrupt one is (:mod:`fdeplb.store.member_repair`, audited ``record_repaired``), so
an excluded rank is not silently readmitted; a missing record of a rank whose membership was never audited is the
initial ACTIVE v0, as before (nothing written). Status, metrics and the UI show a deleted record at once as the
coordinator will restore it, never as ACTIVE until its next pass."""

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


def test_a_deleted_record_is_restored_from_the_audit_and_an_unaudited_one_stays_initial(redis_url, cluster_id):
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
        length = store.audit_length()
        assert store.repair_member(0, fence="", actor="test") is None  # never transitioned: nothing written
        assert raw.exists(member(0)) == 0 and store.audit_length() == length
        fixed = store.repair_member(1, fence="", actor="test")
        assert (fixed.record.state, fixed.record.version, fixed.source) == (M.DRAINING, 1, drained.id)
        note = store.audit()[-1]
        assert (note["trigger"], note["key"], note["to"], note["version"]) == ("record_repaired", "member:1",
                                                                                "DRAINING", "1")
        assert "missing (deleted)" in note["reason"] and json.loads(note["detail"])["found"] == {}
        assert [m and m.state for m in store.member_view().members] == [None, M.DRAINING]
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
