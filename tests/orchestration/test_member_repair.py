"""A corrupt member record (issue 34 item 4) no longer blocks the rounds: the leading coordinator rewrites it as its
last audited membership record left it (or the initial state when none was audited), audited ``record_repaired``,
and the next round goes on; the recording replays (the note must match the record as replayed). Real Redis, a
thread cluster."""

from __future__ import annotations

import json

import pytest
import redis

from fdeplb.cli import main
from fdeplb.errors import FenceError
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.replay import ReplayError, replay_file
from tests.helpers import wait_for
from tests.orchestration.helpers import lose_rank3, round_done

pytestmark = pytest.mark.slow  # thread clusters

M = MemberState


def _repairs(store, r):
    return [a for a in store.iter_audit() if a["trigger"] == "record_repaired" and a["key"] == f"member:{r}"]


def test_a_corrupt_member_record_is_repaired_from_the_audit_and_rounds_go_on(redis_url, cluster_id, tmp_path):
    # rank 3 is lost: its membership is audited (SUSPECT, then EXCLUDED at v2), and the re-placement round ends
    with lose_rank3(redis_url, cluster_id, tmp_path) as (tc, store):
        raw = redis.Redis.from_url(redis_url)
        exclude = [a for a in store.iter_audit() if a["key"] == "member:3"][-1]
        # both records corrupted by hand: rank 2's never transitioned (its truth: ACTIVE v0), rank 3's did
        raw.hset(f"fdeplb:{{{cluster_id}}}:member:2", "state", "BOGUS")
        raw.hset(f"fdeplb:{{{cluster_id}}}:member:3", mapping={"state": "BOGUS", "version": "x", "generation": "y"})
        (two,) = wait_for(lambda: _repairs(store, 2), 30, store, "member:2 repaired")
        (three,) = wait_for(lambda: _repairs(store, 3), 30, store, "member:3 repaired")
        assert (two["from"], two["to"], two["version"]) == ("ACTIVE", "ACTIVE", "0")
        assert json.loads(two["detail"])["source"] == "initial" and "BOGUS" in two["reason"]
        assert (three["to"], three["version"]) == ("EXCLUDED", exclude["version"]) == ("EXCLUDED", "2")
        assert json.loads(three["detail"])["source"] == exclude.id
        assert json.loads(three["detail"])["found"]["state"] == "BOGUS"
        assert two["fence"] != "" and two["actor"] == tc.coordinator.holder  # the leading coordinator, fenced
        rec = store.read(MEMBERSHIP, 3)
        assert (rec.state, rec.version, rec.generation) == (M.EXCLUDED, 2, int(exclude["generation"]))
        assert store.read(MEMBERSHIP, 2).state is M.ACTIVE
        # rounds go on among the members, nothing else was needed
        store.request_round("after the repair")
        done = wait_for(lambda: round_done(store, 2), 60, store, "round 2")
        assert done.members == "0,1,2"
        assert not [a for a in store.iter_audit() if a["trigger"] == "alarm" and "corrupt" in a["reason"]]
        tc.stop()
        path = tmp_path / "repaired.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        report = replay_file(path)
        assert report.final["member:3"].state == "EXCLUDED"
        # a repair that restores something the audit did not leave is refused by the replay
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        forged = tmp_path / "forged.jsonl"
        forged.write_text("".join(json.dumps({**ln, "to": "ACTIVE", "from": "ACTIVE"}
                                             if ln.get("trigger") == "record_repaired" and ln["key"] == "member:3"
                                             else ln) + "\n" for ln in lines))
        with pytest.raises(ReplayError, match="record_repaired for member:3 ACTIVE v2, but member:3 is EXCLUDED v2"):
            replay_file(forged)
        assert store.read_cluster().state is ClusterState.FREE


def _store(redis_url, cluster_id):
    from tests.sim.helpers import two_rank_cluster  # 2 ranks, initialised, nothing running

    return two_rank_cluster(redis_url, cluster_id)


def test_repair_writes_nothing_for_a_sound_record_or_a_lost_lease(redis_url, cluster_id):
    store = _store(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    key = f"fdeplb:{{{cluster_id}}}:member:1"
    try:
        fence = store.acquire_lease("coord-a", 60_000)
        assert store.repair_member(1, fence=fence, actor="coord-a") is None  # it parses: nothing to repair
        raw.hset(key, "state", "BOGUS")
        before, length = raw.hgetall(key), store.audit_length()
        with pytest.raises(FenceError, match="lease is not held"):
            store.repair_member(1, fence="someone-else", actor="coord-b")  # a deposed coordinator
        assert raw.hgetall(key) == before and store.audit_length() == length
        assert store.member_of(key) == 1 and store.member_of(key + "0") is None and store.member_of(None) is None
        fixed = store.repair_member(1, fence=fence, actor="coord-a")
        assert (fixed.record.state, fixed.record.version, fixed.source) == (MemberState.ACTIVE, 0, "initial")
        assert store.read(MEMBERSHIP, 1).state is M.ACTIVE and store.audit_length() == length + 1
        assert store.audit()[-1].id == fixed.audit_id and store.audit()[-1]["fence"] == fence
    finally:
        store.delete_cluster()


def test_with_no_audited_record_a_member_that_transitioned_is_excluded(redis_url, cluster_id, tmp_path):
    store = _store(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    try:
        # version 3 but nothing in the audit (trimmed): the truth is unknown, so the rank is excluded
        raw.hset(f"fdeplb:{{{cluster_id}}}:member:0", mapping={"state": "BOGUS", "version": "3", "generation": "2"})
        fixed = store.repair_member(0, fence="", actor="test")
        assert (fixed.record.state, fixed.record.version, fixed.record.generation) == (M.EXCLUDED, 3, 2)
        assert fixed.source == "excluded" and "excluded: the audit holds no membership record" in \
            store.audit()[-1]["reason"]
        assert [m.state for m in store.member_view().members] == [M.EXCLUDED, M.ACTIVE]
        # the replay holds the rank excluded from the note on; a note that "excludes" into another state is refused
        path = tmp_path / "excluded.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        assert replay_file(path).final["member:0"].state == "EXCLUDED"
        forged = tmp_path / "forged.jsonl"
        forged.write_text(path.read_text().replace('"to":"EXCLUDED"', '"to":"ACTIVE"'))
        with pytest.raises(ReplayError, match="record_repaired excluding member:0 into ACTIVE"):
            replay_file(forged)
    finally:
        store.delete_cluster()


def test_a_record_rewritten_between_the_read_and_the_write_is_read_again(redis_url, cluster_id, monkeypatch):
    from fdeplb.store import member_repair

    store = _store(redis_url, cluster_id)
    raw = redis.Redis.from_url(redis_url)
    key = f"fdeplb:{{{cluster_id}}}:member:1"
    real, calls = member_repair._restored, []

    def operator_fixes_it_meanwhile(*args):
        calls.append(args)
        raw.hset(key, "state", "ACTIVE")  # after the WATCHed read, before EXEC: the EXEC is refused, read again
        return real(*args)

    monkeypatch.setattr(member_repair, "_restored", operator_fixes_it_meanwhile)
    try:
        raw.hset(key, "state", "BOGUS")
        length = store.audit_length()
        assert store.repair_member(1, fence="", actor="test") is None  # the second read finds it sound
        assert len(calls) == 1 and store.audit_length() == length and store.read(MEMBERSHIP, 1).state is M.ACTIVE
    finally:
        store.delete_cluster()
