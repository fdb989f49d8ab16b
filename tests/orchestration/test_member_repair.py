"""A corrupt member record (issue 34 item 4) no longer blocks the rounds: the leading coordinator rewrites it as its
last audited membership record left it (or the initial state when none was audited), audited ``record_repaired``,
and the next round goes on; the recording replays (the note must match the record as replayed). Real Redis, a
thread cluster."""

from __future__ import annotations

import json

import pytest
import redis

from fdeplb.cli import main
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.replay import ReplayError, replay_file
from tests.helpers import thread_cluster, wait_for
from tests.orchestration.test_membership_rounds import TTL, deadlines, kill, round_done

pytestmark = pytest.mark.slow  # thread clusters

M = MemberState


def _repairs(store, r):
    return [a for a in store.iter_audit() if a["trigger"] == "record_repaired" and a["key"] == f"member:{r}"]


def test_a_corrupt_member_record_is_repaired_from_the_audit_and_rounds_go_on(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        raw = redis.Redis.from_url(redis_url)
        tc.start(heartbeat_ttl_ms=TTL)
        # rank 3 is lost: its membership is audited (SUSPECT, then EXCLUDED at v2), and the re-placement round ends
        kill(tc, 3)
        wait_for(lambda: store.read(MEMBERSHIP, 3).state is M.EXCLUDED, 30, store, "rank 3 excluded")
        wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        exclude = [a for a in store.iter_audit() if a["key"] == "member:3"][-1]
        # both records corrupted by hand: rank 2's never transitioned (its truth: ACTIVE v0), rank 3's did
        raw.hset(f"fdeplb:{{{cluster_id}}}:member:2", "state", "BOGUS")
        raw.hset(f"fdeplb:{{{cluster_id}}}:member:3", mapping={"state": "BOGUS", "version": "x", "generation": "y"})
        (two,) = wait_for(lambda: _repairs(store, 2), 30, store, "member:2 repaired")
        (three,) = wait_for(lambda: _repairs(store, 3), 30, store, "member:3 repaired")
        assert (two["from"], two["to"], two["version"]) == ("ACTIVE", "ACTIVE", "0")
        assert json.loads(two["detail"])["source"] == "" and "BOGUS" in two["reason"]
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
