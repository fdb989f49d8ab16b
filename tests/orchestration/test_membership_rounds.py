"""Rounds around a lost rank, on thread clusters: a rank whose heartbeat lapses goes SUSPECT, then EXCLUDED after
``exclude_ms`` (fenced coordinator commits, each raising the generation); the re-placement round that follows
moves only its orphaned experts and routes no slot of it; with no redundant replica the round fails closed; a
round in flight aborts at once when a participant goes SUSPECT."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.api import service
from fdeplb.api.prometheus import ClusterCollector
from fdeplb.cli import main
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.placement import live_maps, orphaned_experts
from fdeplb.replay import ReplayError, check_plans, replay_file
from fdeplb.rounds import reasons
from tests.helpers import run_cli, thread_cluster, wait_for
from tests.orchestration.helpers import TTL, deadlines, kill, round_done

pytestmark = pytest.mark.slow  # thread clusters

M = MemberState


def member_trail(store, r: int) -> list[tuple[str, str, str]]:
    return [(a["from"], a["to"], a["trigger"]) for a in store.iter_audit() if a["key"] == f"member:{r}"]


def test_a_lost_rank_is_suspected_excluded_and_its_experts_replaced(redis_url, cluster_id, tmp_path):
    # E=8, P=12, 4 ranks of 3 slots: rank 2 holds experts 6, 7, 0; 6 and 7 only there
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        before = store.current_placement().phy2log
        assert tc.agents[0].live_ranks == (0, 1, 2, 3)
        kill(tc, 2)
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is M.EXCLUDED, 30, store, "rank 2 excluded")
        assert member_trail(store, 2) == [("ACTIVE", "SUSPECT", "suspect"), ("SUSPECT", "EXCLUDED", "exclude")]
        suspect, exclude = [a for a in store.iter_audit() if a["key"] == "member:2"]
        assert suspect["actor"] == exclude["actor"] == tc.coordinator.holder and suspect["fence"] != ""
        assert (suspect["generation"], exclude["generation"]) == ("1", "2")
        assert store.read_cluster().generation == 2
        # the coordinator asks for the re-placement by itself; it completes among ranks 0, 1, 3
        rec = wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        assert rec.requested_reason.startswith("replacement") and rec.members == "0,1,3"
        load = [a for a in store.iter_audit() if a["key"] == "cluster" and a["trigger"] == "load"][-1]
        assert reasons.is_replacement(load)
        assert reasons.detail_of(load)["replacement"] == {"ranks": [2], "orphans": [[0, 6], [0, 7], [1, 6], [1, 7]]}
        # rank 2 is not a member: its lapsed heartbeat no longer makes the cluster unhealthy, nothing is orphaned
        assert service.health(store)[0] == 200 and service.probe_health(store)[0] == 200
        families = {f.name: f for f in ClusterCollector(store).collect()}
        assert families["fdeplb_replacement_rounds"].samples[0].value == 1
        assert families["fdeplb_fail_closed"].samples[0].value == 0
        after = store.current_placement()
        assert after.plan_id == rec.plan_id != ""
        live = np.array([True, True, False, True])
        assert orphaned_experts(after.phy2log, 8, 4, live) == []
        changed = np.argwhere(after.phy2log != before)
        assert len(changed) == 2 * 2  # only the two orphans per layer moved (one slot each)
        assert all(not 6 <= p < 9 for _, p in changed)  # never into the lost rank's slots
        log2phy, logcnt = live_maps(after.phy2log, 8, 4, live)
        assert not np.isin(log2phy, [6, 7, 8]).any() and (logcnt >= 1).all()
        plan = store.read_plan(after.plan_id)
        assert plan.generation == 2 and plan.topology["live_ranks"] == [0, 1, 3]
        assert tc.agents[0].live_ranks == (0, 1, 3)  # the engine's dispatch mask, switched with the tables
        assert tc.agents[0].backend.live_ranks == (0, 1, 3) and after.members == "0,1,3"
        from fdeplb.status import cluster_status

        status = cluster_status(store)  # the dead rank's old tables are no mismatch: nobody routes to it
        assert status["ranks"][2]["routing"] == "not_member" and status["routing_mismatches"] == []
        commit = [a for a in store.iter_audit() if a["trigger"] == "commit"][-1]
        assert commit["generation"] == "2"
        # the next round plans without rank 2 as well and routes nothing to it
        store.request_round("test")
        wait_for(lambda: round_done(store, 2), 60, store, "round 2")
        assert orphaned_experts(store.current_placement().phy2log, 8, 4, live) == []
        # the recording replays: member transitions, guards over members, both plans recomputed
        tc.stop()
        path = tmp_path / "lost.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        report = replay_file(path)
        assert report.final["member:2"].state == "EXCLUDED"
        assert len(check_plans(store, report)) == 2
        assert main(["replay", str(path)]) == 0


def test_after_a_rank_is_lost_rounds_rearrange_over_the_members(redis_url, cluster_id, tmp_path, capsys):
    # issue 34 A: the gate, /metrics and /ui counted the excluded rank's slots, so every later round was skipped
    from fdeplb.rounds.gating import decide, mean_balancedness
    from fdeplb.replay import check_gates
    from fdeplb.ui.view_model import plan_view

    members = (0, 2, 3)
    # 8 experts in 16 slots, each on two ranks: losing rank 1 orphans none; this seed's load over every rank would
    # plan a loss (gain -0.06) where over the members it gains +0.07: min_gain 0.05 tells the two apart
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=8, seed=1,
                        min_gain=0.05, deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        kill(tc, 1)
        wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        assert store.current_placement().members == "0,2,3"
        capsys.readouterr()
        code, out, _ = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait",
                               "--timeout", "60")
        rec = store.read_cluster()
        placement = store.current_placement()
        assert code == 0 and rec.round == 2 and f"round 2: rearranged, plan {rec.plan_id}: balancedness " in out
        assert rec.plan_id and placement.plan_id == rec.plan_id, f"round 2 did not rearrange: {rec.reason}"
        load = [a for a in store.iter_audit() if a["trigger"] == "load" and a["round"] == "2"]
        gate = reasons.detail_of(load[0])["gate"]
        plan = store.read_plan(rec.plan_id)
        snap, old, new = plan.expert_load, plan.old_phy2log, plan.new_phy2log
        assert gate["live_ranks"] == list(members) == list(plan.live_ranks(4)) == list(placement.live_ranks(4))
        assert gate["balancedness_before"] == mean_balancedness(snap, old, 4, members)
        assert gate["balancedness_after"] == mean_balancedness(snap, new, 4, members)
        assert gate["gain"] > 0.05 and load[0]["reason"].startswith("gate: balancedness ")
        assert round(gate["balancedness_after"], 6) == plan.balancedness_after  # the plan's figures, 6 decimals
        assert f"balancedness {plan.balancedness_before:.4f} -> {plan.balancedness_after:.4f}" in out
        assert decide(snap, old, new, tc.config).gain < 0.05  # counting rank 1's slots would have skipped it
        families = {f.name: f for f in ClusterCollector(store).collect()}
        current = {s.labels["placement"]: s.value for s in families["fdeplb_balancedness"].samples}
        assert current == {"current": mean_balancedness(snap, new, 4, members), "planned": plan.balancedness_after}
        view = plan_view(plan, 4)
        assert view["live_ranks"] == list(members) and {len(row) for row in view["after"]} == {3}
        # the export replays: the plan, its figures and the load's gate recomputed over the members
        tc.stop()
        path = tmp_path / "members.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        report = replay_file(path)
        assert report.header["schema"] == 3 and rec.plan_id in check_plans(store, report)
        assert check_gates(report) == [2]
        assert main(["replay", str(path)]) == 0
        # a forger who edits the load's figures (and recomputes the chain) is caught by the recomputation
        import json

        from tests.replay.helpers import rechain

        lines = [json.loads(x) for x in path.read_text().splitlines()]
        at = next(i for i, x in enumerate(lines) if x.get("trigger") == "load" and x.get("round") == 2)
        detail = json.loads(lines[at]["detail"])
        detail["gate"]["balancedness_after"] += 1e-9  # invisible in the 4-decimal text
        lines[at]["detail"] = json.dumps(detail, sort_keys=True, separators=(",", ":"))
        forged = tmp_path / "forged.jsonl"
        forged.write_text("".join(json.dumps(x) + "\n" for x in rechain(lines)))
        with pytest.raises(ReplayError, match="round 2 went on with the gate's figures"):
            check_gates(replay_file(forged))


def test_no_redundant_replica_fails_closed_naming_the_experts(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=0,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        before = store.current_placement()
        kill(tc, 1)  # experts 2 and 3 of each layer live only there
        abort = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "abort" and a["key"] == "cluster"], 60, store,
                         "the fail-closed abort")[0]
        assert abort["reason"].startswith("fail closed: redundancy insufficient")
        assert reasons.failed_closed(abort)
        detail = reasons.detail_of(abort)
        assert detail["ranks"] == [1] and detail["orphans"] == [[0, 2], [0, 3], [1, 2], [1, 3]]
        alarm = [a for a in store.iter_audit() if a["trigger"] == "alarm"]
        assert alarm and alarm[-1]["reason"] == abort["reason"]
        after = store.current_placement()
        assert after.plan_id == before.plan_id == "" and np.array_equal(after.phy2log, before.phy2log)
        wait_for(lambda: store.read_cluster().state is ClusterState.FREE, 30, store, "FREE")
        assert len([a for a in store.iter_audit() if a["trigger"] == "abort" and a["key"] == "cluster"]) == 1  # not retried
        # degraded until the rank comes back: /health names the experts, the probe one phrase
        code, body = service.health(store)
        assert code == 503 and body["orphans"] == [[0, 2], [0, 3], [1, 2], [1, 3]] and "degraded" in body["msg"]
        assert service.probe_health(store) == (503, {"code": 1, "msg": service.HEALTH_PHRASES["degraded"]})
        families = {f.name: f for f in ClusterCollector(store).collect()}
        assert families["fdeplb_fail_closed"].samples[0].value == 1
        assert families["fdeplb_replacement_rounds"].samples[0].value == 0


def test_a_round_aborts_at_once_when_a_participant_goes_suspect(redis_url, cluster_id, tmp_path):
    # cordoned: the round waits in LOAD_SUCC for an external commit (commit_ms 20 s) when rank 3 dies
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True, deadlines=deadlines(exclude_ms=60_000)) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        store.request_round("test")
        wait_for(lambda: store.read_cluster().state is ClusterState.LOAD_SUCC, 60, store, "LOAD_SUCC")
        kill(tc, 3)
        rec = wait_for(lambda: round_done(store, 1), 30, store, "the abort")
        abort = [a for a in store.iter_audit() if a["trigger"] == "abort" and a["key"] == "cluster"][-1]
        assert abort["from"] == "LOAD_SUCC" and "ranks [3]" in abort["reason"]
        from fdeplb.rounds import reasons

        assert reasons.detail_of(abort) == {"ranks": [3]}
        assert "deadline" not in rec.reason and store.read(MEMBERSHIP, 3).state is M.SUSPECT
        assert store.current_placement().plan_id == ""  # nothing committed


def test_an_excluded_rank_rejoins_and_the_next_round_counts_it(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        kill(tc, 2)
        wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        placement = store.current_placement()
        back = tc.start_agent(2, heartbeat_ttl_ms=TTL)  # a new worker for rank 2: it loads the current placement
        assert np.array_equal(back.backend.phy2log, placement.phy2log)
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is M.ACTIVE, 30, store, "rank 2 admitted")
        assert [t for _, _, t in member_trail(store, 2)] == ["suspect", "exclude", "rejoin", "admit"]
        rejoin = [a for a in store.iter_audit() if a["key"] == "member:2" and a["trigger"] == "rejoin"][0]
        assert rejoin["actor"] == back.actor and rejoin["fence"] == "" and rejoin["generation"] == "3"
        # admitted, not yet routed to: every member routes over the ranks the placement was committed for
        assert back.live_ranks == (0, 1, 3) and tc.agents[0].live_ranks == (0, 1, 3)
        # the coordinator asks for the membership round by itself; at its switch step every member routes to rank 2
        rec = wait_for(lambda: round_done(store, 2), 60, store, "round 2")
        assert rec.members == "" and rec.requested_reason == "replacement: ranks [2] rejoined"
        start = [a for a in store.iter_audit() if a["trigger"] == "start"][-1]
        assert start["generation"] == "4"
        assert store.current_placement().members == "" and store.current_placement().plan_id == rec.plan_id
        assert back.live_ranks == tc.agents[0].live_ranks == (0, 1, 2, 3)


def test_readmit_waits_for_a_round_to_end(redis_url, cluster_id, tmp_path):
    from fdeplb.errors import GuardError
    from fdeplb.orchestration.membership import operator_fire

    # 16 experts in 32 slots: each expert on two ranks, so draining rank 3 orphans none (no re-placement round)
    with thread_cluster(redis_url, cluster_id, tmp_path, num_redundant=16, cordoned=True,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        operator_fire(store, 3, "drain", who="operator:test", reason="")
        tc.start(heartbeat_ttl_ms=TTL)
        wait_for(lambda: store.read(MEMBERSHIP, 3).state is M.EXCLUDED, 30, store, "rank 3 drained")
        store.request_round("test")
        wait_for(lambda: store.read_cluster().state is ClusterState.LOAD_SUCC, 60, store, "LOAD_SUCC")
        assert store.read_cluster().members == "0,1,2"
        with pytest.raises(GuardError, match="cluster_in"):
            operator_fire(store, 3, "readmit", who="operator:test", reason="")
        assert store.read(MEMBERSHIP, 3).state is M.EXCLUDED


def test_a_rank_lost_in_swapping_comes_back_into_the_current_placement(redis_url, cluster_id, tmp_path):
    # rank 2 died SWAPPING for plan X; the round completed among the others, it was excluded and its experts
    # re-placed (plan Y current): its new worker must hold Y and leave SWAPPING, never swap back to X
    from tests.helpers import RawRedis

    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        kill(tc, 2)
        wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        current = store.current_placement()
        assert current.plan_id and current.members == "0,1,3"
        RawRedis(redis_url, cluster_id).force(store._keys.rank(2), "SWAPPING", version=store.read_rank(2).version,
                                              plan_id="0123456789abcdef")  # the round it died in
        back = tc.start_agent(2, heartbeat_ttl_ms=TTL)
        rec = wait_for(lambda: (r := store.read_rank(2)).state.value == "IDLE" and r, 30, store, "rank 2 IDLE")
        assert rec.live_plan_id == current.plan_id and np.array_equal(back.backend.phy2log, current.phy2log)
        trail = [(a["from"], a["to"]) for a in store.iter_audit() if a["key"] == "rank:2"][-2:]
        assert trail == [("SWAPPING", "SWAPPED"), ("SWAPPED", "IDLE")]
        # admitted, then routed to again by the membership round that follows
        wait_for(lambda: round_done(store, 2), 60, store, "the membership round")
        assert store.current_placement().members == "" and back.live_ranks == (0, 1, 2, 3)


def test_weight_clear_and_update_do_not_wait_on_an_excluded_rank(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines(weights_ms=2_000)) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        kill(tc, 2)
        wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
        assert service.drive_weights(store, "clear", 30.0)[0] == 200
        assert service.drive_weights(store, "update", 30.0) == (
            200, {"code": 0, "msg": "update model weight successfully", "request": 2})
        # past weights_ms no alarm names the excluded rank: nobody waits for it
        wait_for(lambda: store.now_ms() - int([a for a in store.iter_audit()][-1]["ts_ms"]) > 3_000, 10, store,
                 "weights_ms passed")
        assert not [a for a in store.iter_audit() if a["trigger"] in ("alarm", "weights_cancelled")]


@pytest.mark.parametrize("field,value", [("state", "BOGUS"), ("generation", "abc")])
def test_a_corrupt_member_record_makes_health_503_until_the_coordinator_repairs_it(redis_url, cluster_id, tmp_path,
                                                                                    field, value):
    from tests.helpers import RawRedis

    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines()) as tc:
        store = tc.store()
        RawRedis(redis_url, cluster_id).r.hset(store._keys.member(3), field, value)
        code, body = service.health(store)  # no coordinator yet: /health names the key (503, not a 500)
        assert code == 503 and body["msg"].startswith("cluster state unreadable:") and "member:3" in body["msg"]
        assert service.probe_health(store) == (503, {"code": 1, "msg": service.HEALTH_PHRASES["unreadable"]})
        tc.start(heartbeat_ttl_ms=TTL)  # rank 3's agent starts over it: its rejoin is decided once it is repaired
        # the coordinator repairs it (issue 34 item 4; nothing of rank 3 audited: its initial state), audited
        (note,) = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "record_repaired"], 30, store,
                           "the repair")
        assert note["key"] == "member:3" and note["to"] == "ACTIVE" and f"field {field!r}" in note["reason"]
        assert store.read(MEMBERSHIP, 3).state is M.ACTIVE
        wait_for(lambda: service.health(store)[0] == 200, 30, store, "healthy again")
        assert not [a for a in store.iter_audit() if a["trigger"] == "alarm"]


def test_health_of_a_deleted_cluster_is_503(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines()) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=TTL)
        tc.stop()
        store.delete_cluster()
        code, body = service.health(store)
        assert code == 503 and "not initialised" in body["msg"]
        assert service.probe_health(store)[0] == 503


def test_a_corrupt_cluster_generation_is_refused_not_read_as_zero(redis_url, cluster_id, tmp_path):
    from fdeplb.errors import StaleStateError
    from fdeplb.orchestration.membership import operator_fire
    from tests.helpers import RawRedis

    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines()) as tc:
        store = tc.store()
        RawRedis(redis_url, cluster_id).r.hset(store._keys.rearrange, "generation", "x1")
        with pytest.raises(StaleStateError, match="generation .* is not a non-negative integer"):
            operator_fire(store, 3, "drain", who="operator:test", reason="")
        assert store.read(MEMBERSHIP, 3).state is M.ACTIVE
