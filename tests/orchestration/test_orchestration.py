"""Coordinator + rank agents over a real Redis (agents in threads of this process); numpy weights unless a test
needs paddle tensors."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from fdeplb.errors import CorruptRecordError, RedisUnavailableError, StateError
from fdeplb.machines.tables import ClusterState
from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.placement import balancedness
from fdeplb.store import Deadlines
from fdeplb.testing import NumpyWeights
from tests.helpers import RawRedis, thread_cluster, wait_for
from tests.orchestration.helpers import round_over, transitions_of
from tests.servers import RedisServer

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in most tests


def cluster_state(store):
    return store.read_cluster()


def last_cluster_transition(store):
    return [a for a in store.iter_audit() if a["machine"] == "cluster"][-1]


def test_full_round_swaps_every_rank(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        before = store.current_placement().phy2log
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store) == [
            ("FREE", "COLLECTING", "start"), ("COLLECTING", "PLANNING", "plan"), ("PLANNING", "LOADING", "load"),
            ("LOADING", "LOAD_SUCC", "loaded"), ("LOAD_SUCC", "SWAPPING", "commit"), ("SWAPPING", "DONE", "swapped"),
            ("DONE", "FREE", "release")]
        placement = store.current_placement()
        plan_id, after = placement.plan_id, placement.phy2log
        assert plan_id and not np.array_equal(before, after)
        total = tc.loads.sum(axis=0)
        assert balancedness(total, after, 4).mean() > balancedness(total, before, 4).mean()
        # the snapshot of the round is exactly the sum of the ranks' windows
        assert np.array_equal(store.read_snapshot(1), total)
        for agent in tc.agents:
            assert np.array_equal(agent.backend.phy2log, after)
            assert agent.backend.verify() == (3 * 5, 3 * 5)
        # audit versions per record have no gaps
        versions: dict[str, list[int]] = {}
        for a in store.iter_audit():
            versions.setdefault(a["key"], []).append(int(a["version"]))
        assert all(v == list(range(1, len(v) + 1)) for v in versions.values())


class _RoundTrips:
    """Counts the round trips of one redis-py client: commands sent alone, and pipelines (one round trip each)."""

    def __init__(self, client):
        self.n = 0
        self.calls: list[str] = []
        send, pipeline = client.execute_command, client.pipeline

        def execute_command(*args, **kwargs):
            self.n += 1
            self.calls.append(str(args[0]))
            return send(*args, **kwargs)

        def make_pipeline(*args, **kwargs):
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            def counted(*a, **k):
                self.n += 1
                self.calls.append("+".join(str(c[0][0]) for c in pipe.command_stack))
                return execute(*a, **k)

            pipe.execute = counted
            return pipe

        client.execute_command, client.pipeline = execute_command, make_pipeline


def test_a_rank_agent_makes_six_round_trips_per_round(redis_url, cluster_id, tmp_path):
    """A rank agent's round costs one round trip per wake-up (start, load, commit, release: each wait also
    carries the previous step's last write and reads the next view; "swapped" wakes no rank, a SWAPPED rank
    finishes at the release) plus the stage commit sent with the plan read and the swap commit: 6, counted on the
    agent's own client from the request to the round's end."""
    import threading

    from fdeplb.orchestration.agent import RankAgent
    from fdeplb.testing import NumpyWeights

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start_agents(ranks=[0, 2, 3])
        agent = RankAgent(tc.store(), 1, load_source=lambda _round: tc.loads[1], heartbeat_ttl_ms=3_600_000,
                          backend_factory=NumpyWeights.factory())
        agent.start()
        counter = _RoundTrips(agent.store._client)
        idle = []  # waits that ended at their 2 s timeout, not on a signal (a slow machine): not the round's
        wait_view = agent.store.wait_view

        def counted_wait_view(*args, **kwargs):
            signals, view, outcomes = wait_view(*args, **kwargs)
            if not signals:
                idle.append(counter.n)
            return signals, view, outcomes

        agent.store.wait_view = counted_wait_view
        t = threading.Thread(target=agent.run, kwargs={"block_ms": 2_000}, daemon=True)
        t.start()
        tc.agents.append(agent)
        tc.threads.append(t)
        tc.start_coordinator()
        store.request_round()  # round 1 also pays once-per-process reads (the published round, script loads)
        wait_for(round_over(store, 1), 60, store, "round 1")
        wait_for(lambda: agent._outbox == [], 10, store, "rank 1 blocked after round 1")
        tc.loads = np.ascontiguousarray(tc.loads[:, :, ::-1])  # new loads: round 2 moves experts again
        before = counter.n
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        wait_for(lambda: counter.n - before >= 6, 10, store, "rank 1's wait after round 2")
        assert last_cluster_transition(store)["trigger"] == "release"
        timeouts = sum(1 for n in idle if n >= before)  # each made the agent issue one more wait
        assert counter.n - before - timeouts == 6, counter.calls[-(counter.n - before):]


def test_gated_round_is_audited_not_silent(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, min_gain=1.0) as tc:
        store = tc.store()
        before = store.current_placement().phy2log
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "gated round")
        last = last_cluster_transition(store)
        assert (last["from"], last["to"], last["trigger"]) == ("PLANNING", "FREE", "abort")
        assert last["reason"].startswith("gated:")
        assert np.array_equal(store.current_placement().phy2log, before)


def test_staging_over_budget_aborts_and_keeps_old_placement(redis_url, cluster_id, tmp_path):
    pytest.importorskip("paddle")
    with thread_cluster(redis_url, cluster_id, tmp_path, backend="paddle") as tc:
        store = tc.store()
        before = store.current_placement().phy2log
        tc.start_agents(staging_budget_bytes=1)
        live_before = [{k: [t.numpy().copy() for t in v] for k, v in a.backend.live.tensors.items()} for a in tc.agents]
        tc.start_coordinator()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "aborted round")
        last = last_cluster_transition(store)
        assert (last["to"], last["trigger"]) == ("FREE", "abort")
        assert "failed to load" in last["reason"]
        placement = store.current_placement()
        plan_id, after = placement.plan_id, placement.phy2log
        assert plan_id == "" and np.array_equal(before, after)
        rank_paths = transitions_of(store, "rank")
        assert ("LOADING", "LOAD_FAILED", "fail") in rank_paths and ("LOAD_FAILED", "IDLE", "abort") in rank_paths
        for agent, saved in zip(tc.agents, live_before):
            assert agent.staged is None
            for suffix, layers in agent.backend.live.tensors.items():
                for t, old in zip(layers, saved[suffix]):
                    assert np.array_equal(t.numpy(), old)


def test_cordoned_cluster_waits_for_external_commit(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        rec = wait_for(lambda: (r := cluster_state(store)).state == "LOAD_SUCC" and r, 60, store, "LOAD_SUCC")
        assert store.current_placement().plan_id == ""  # nothing committed yet
        store.request_commit(rec.plan_id)
        wait_for(round_over(store, 1), 60, store, "committed round")
        assert store.current_placement().plan_id == rec.plan_id


def test_cordoned_commit_deadline_aborts(redis_url, cluster_id, tmp_path):
    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=300, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True, deadlines=deadlines) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round aborted by the commit deadline")
        last = last_cluster_transition(store)
        assert (last["from"], last["trigger"]) == ("LOAD_SUCC", "abort") and "commit deadline" in last["reason"]


def test_missing_rank_aborts_collecting_by_deadline(redis_url, cluster_id, tmp_path):
    deadlines = Deadlines(collecting_ms=300, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        store = tc.store()
        tc.start_agents(ranks=[0, 1, 2])
        tc.start_silent_rank(3)  # registered and beating, never publishes (an unregistered one refuses the start)
        tc.start_coordinator()
        store.request_round()
        wait_for(lambda: (r := cluster_state(store)).round >= 1 and r.state == "FREE",
                 60, store, "collecting deadline")
        last = last_cluster_transition(store)
        assert last["trigger"] == "abort" and "collecting deadline passed: no load from ranks [" in last["reason"]
        assert 3 in json.loads(last["reason"].rsplit("ranks ", 1)[1])  # a slow live rank may be named too


def test_two_rounds_second_is_gated_or_moves_nothing_twice(redis_url, cluster_id, tmp_path):
    """The same loads twice: the second plan equals the current placement, so the round is gated (audited)."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        first = store.current_placement()
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        last = last_cluster_transition(store)
        assert last["trigger"] == "abort" and "0 moved experts" in last["reason"]
        assert store.current_placement().plan_id == first.plan_id


def test_swap_verification_failure_is_repaired_and_round_completes(redis_url, cluster_id, tmp_path, monkeypatch):
    """Past the commit point a corrupted staging must not be swallowed: the swap's checksum catches it, the rank
    restores its slots from the checkpoint, stages again and completes; an alarm is raised on the way."""
    pytest.importorskip("paddle")
    import fdeplb.weights.staging as weights

    real_stage = weights.stage_experts
    corrupted = []

    def corrupting_stage(plan, reader, **kwargs):
        staged = real_stage(plan, reader, **kwargs)
        if not corrupted and len(staged.experts):
            tensor = next(iter(staged.experts[0].values()))
            tensor.set_value(tensor + 1)  # a wrong value in staging: exactly what the checksum must catch
            corrupted.append(plan.ep_rank)
        return staged

    monkeypatch.setattr(weights, "stage_experts", corrupting_stage)
    with thread_cluster(redis_url, cluster_id, tmp_path, backend="paddle") as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round with a repaired swap")
        events = [e for e in store.wait(store.cursor(events_from="0-0"), 1) if e["kind"] == "alarm"]
        assert corrupted and any("verification failed" in e["message"] for e in events)
        assert transitions_of(store)[-1] == ("DONE", "FREE", "release")
        phy2log = store.current_placement().phy2log
        for agent in tc.agents:
            assert np.array_equal(agent.backend.phy2log, phy2log)
            assert agent.backend.verify() == (15, 15)


def test_swapping_deadline_raises_alarm_and_rolls_forward(redis_url, cluster_id, tmp_path):
    """After the commit point an overdue rank is reported (record, audit, event), never aborted; once it comes
    back it loads the committed placement and the round completes."""
    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=300)
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True, deadlines=deadlines) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        rec = wait_for(lambda: (r := cluster_state(store)).state == "LOAD_SUCC" and r, 60, store, "LOAD_SUCC")
        tc.agents[3].stop_event.set()  # rank 3's worker goes away after staging
        tc.threads[3].join(10)
        assert not tc.threads[3].is_alive()
        store.request_commit(rec.plan_id)
        # the alarm names whoever is late at the deadline and is rewritten as ranks catch up: wait for rank 3 alone
        alarmed = wait_for(lambda: "ranks [3] not SWAPPED" in (r := cluster_state(store)).alarm and r,
                           30, store, "the alarm about rank 3")
        assert alarmed.state == "SWAPPING"
        alarms = [a for a in store.iter_audit() if a["trigger"] == "alarm"]
        assert alarms and alarms[0]["from"] == alarms[0]["to"] == "SWAPPING"
        assert store.current_placement().plan_id == rec.plan_id  # committed: rolls forward
        # the rank comes back (a new process would do the same): it loads the current placement and swaps
        agent = tc.start_agent(3)
        wait_for(round_over(store, 1), 60, store, "the round to complete")
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")]
        assert np.array_equal(agent.backend.phy2log, store.current_placement().phy2log)


def test_rank_failing_after_load_succ_aborts_instead_of_committing(redis_url, cluster_id, tmp_path):
    """A rank that loses its staging after LOAD_SUCC (restarted, and cannot stage again) must not let the plan
    commit: the round aborts before the commit point and the old placement stays."""
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        store = tc.store()
        before = store.current_placement()
        tc.start()
        store.request_round()
        wait_for(lambda: cluster_state(store).state == "LOAD_SUCC", 60, store, "LOAD_SUCC")
        tc.agents[0].stop_event.set()
        tc.threads[0].join(10)
        tc.start_agent(0, staging_budget_bytes=1)  # restarted, and cannot stage again
        wait_for(round_over(store, 1), 60, store, "the aborted round")
        last = last_cluster_transition(store)
        assert (last["from"], last["trigger"]) == ("LOAD_SUCC", "abort") and "failed after loading" in last["reason"]
        assert store.current_placement().plan_id == before.plan_id == ""
        with pytest.raises(StateError):
            store.request_commit(last["plan_id"])


def test_planner_error_aborts_the_round_instead_of_killing_the_coordinator(redis_url, cluster_id, tmp_path):
    from fdeplb.errors import TopologyError

    def broken_planner(expert_load, old_phy2log, config):
        raise TopologyError("no placement for this topology")

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start_agents()
        coordinator = tc.start_coordinator(planner=broken_planner)
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "the aborted round")
        last = last_cluster_transition(store)
        assert (last["from"], last["trigger"]) == ("PLANNING", "abort")
        assert last["reason"] == "planning failed: no placement for this topology"
        assert tc.threads[-1].is_alive() and not coordinator.stop_event.is_set()  # still leading, still serving


def test_round_without_gain_is_gated_even_if_it_would_move(redis_url, cluster_id, tmp_path):
    """One rank holds every slot: any plan has balancedness 1.0 before and after, so moving is pure cost."""
    with thread_cluster(redis_url, cluster_id, tmp_path, ep_size=1) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "the gated round")
        last = last_cluster_transition(store)
        assert last["trigger"] == "abort" and last["reason"].startswith("gated: skipped: planned gain 0.0000 <= min_gain")


def test_dropped_connections_do_not_kill_agents_or_coordinator(redis_url, cluster_id, tmp_path):
    """Every client connection is killed by the server mid-round (a failover or proxy restart looks the same):
    the loops log it, reconnect and the round still completes."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        wait_for(lambda: cluster_state(store).state != "FREE", 60, store, "the round to start")
        killer = RawRedis(redis_url, cluster_id)
        killed = killer.r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert int(killed) >= 5  # the coordinator's and the four agents' connections at least

        def finished():
            try:
                return round_over(store, 1)()
            except RedisUnavailableError:
                return False  # this test's own connection was killed too; the next call reconnects

        wait_for(finished, 60, what="the round to complete after the connections dropped")
        assert transitions_of(store)[-1] == ("DONE", "FREE", "release")
        assert all(t.is_alive() for t in tc.threads)


def test_malformed_plan_aborts_the_round(redis_url, cluster_id, tmp_path):
    """A planner returning a placement of the wrong shape or with unknown experts is refused before LOADING."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start_agents()
        tc.start_coordinator(planner=lambda load, old, cfg: old[:, :-1])
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "the aborted round")
        last = last_cluster_transition(store)
        assert (last["from"], last["trigger"]) == ("PLANNING", "abort")
        assert last["reason"].startswith("planning failed: planned phy2log")
        assert store.current_placement().plan_id == ""


def test_broken_load_source_aborts_by_deadline_and_the_agent_survives(redis_url, cluster_id, tmp_path):
    deadlines = Deadlines(collecting_ms=500, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        store = tc.store()
        tc.start_agents(ranks=[0, 1, 2])
        broken = tc.start_agent(3)
        broken.load_source = lambda _round: np.full((3, 16), np.nan)  # the engine's recorder hands over garbage
        tc.start_coordinator()
        store.request_round()
        wait_for(lambda: (r := cluster_state(store)).round >= 1 and r.state == "FREE",
                 60, store, "the collecting deadline")
        last = last_cluster_transition(store)
        assert last["trigger"] == "abort" and 3 in json.loads(last["reason"].rsplit("ranks ", 1)[1])
        assert tc.threads[3].is_alive()  # the agent logged it and goes on serving


def test_a_second_agent_for_a_rank_supersedes_the_first(redis_url, cluster_id, tmp_path):
    """A worker restarted while its old process still runs: the older agent sees the registry name the newer one at
    its next heartbeat, raises an audited alarm naming both and stops; the newer one drives the rank's records and
    the next round completes with it."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=400)  # heartbeats every 0.1 s
        old = tc.agents[2]
        new = tc.start_agent(2, heartbeat_ttl_ms=400)
        thread = tc.threads[2]
        thread.join(timeout=30)
        assert not thread.is_alive() and old.stop_event.is_set()
        assert store.rank_agent(2) == new.agent_id != old.agent_id
        [alarm] = [a for a in store.iter_audit() if a["trigger"] == "alarm"]
        assert f"superseded by agent {new.agent_id}" in alarm["reason"] and old.agent_id in alarm["reason"]
        assert not new.stop_event.is_set()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store)[-1] == ("DONE", "FREE", "release")
        assert np.array_equal(new.backend.phy2log, store.current_placement().phy2log)
        assert store.routing_mismatches() == []


@pytest.mark.parametrize("lost", ["request", "reply"])
def test_a_wait_that_loses_its_deferred_writes_redoes_them_and_the_round_completes(redis_url, cluster_id, tmp_path,
                                                                                    lost):
    """A step's last write rides on the next wait. When that round trip fails (Redis away), the writes'
    fate is unknown: lost with the request, or done and only the reply lost. Either way the agent's next steps
    redo them (the window is published again, the transition fired again on the record as read) and the round
    ends normally, not at a deadline (600 s here). Rank 1 loses each of its four deferred writes (load window,
    staged, swapped, finish) once."""
    deadlines = Deadlines(collecting_ms=600_000, loading_ms=600_000, commit_ms=600_000, swapping_ms=600_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        store = tc.store()
        tc.start()
        agent = tc.agents[1]
        wait_view, send = agent.store.wait_view, agent.store.send
        lost_writes: list[str] = []

        def failing_wait_view(cursor, ep_rank, block_ms, writes=()):
            what = [w.what.split(" on ")[0] for w in writes]
            if what and what[0] not in lost_writes:
                lost_writes.append(what[0])
                if lost == "reply":
                    send(list(writes))  # done in Redis; the agent never hears of it
                raise RedisUnavailableError("connection lost (test)")
            return wait_view(cursor, ep_rank, block_ms, writes)

        agent.store.wait_view = failing_wait_view
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert lost_writes == ["load window of rank 1", "rank staged", "rank swapped", "rank finish"]
        rec = cluster_state(store)
        assert rec.reason == "" and rec.plan_id == store.current_placement().plan_id != ""
        assert [t for _, _, t in transitions_of(store, "rank") if t != "abort"].count("finish") == tc.config.ep_size
        assert store.routing_mismatches() == []


def test_run_honours_until_while_redis_is_away(tmp_path, cluster_id):
    """``RankAgent.run(until=...)`` returns once ``until()`` is true even while every step fails because Redis is
    gone (it used to retry the failing step every 0.5 s without asking ``until``: a benchmark's agent processes
    outlived their run by the join timeout)."""
    server = RedisServer(tmp_path / "redis")
    try:
        with thread_cluster(server.url, cluster_id, tmp_path) as tc:
            agent = RankAgent(tc.store(), 0, load_source=lambda _round: tc.loads[0],
                              backend_factory=NumpyWeights.factory())
            agent.start()
            asked, leave = threading.Event(), threading.Event()

            def until():
                asked.set()
                return leave.is_set()

            t = threading.Thread(target=agent.run, kwargs={"until": until, "block_ms": 200}, daemon=True)
            t.start()
            assert asked.wait(30)  # the loop runs (and asks) while Redis is up
            server.kill()
            leave.set()
            t.join(timeout=30)
            stuck = t.is_alive()
            agent.stop_event.set()
            t.join(timeout=30)
            server.start()  # the fixture's teardown deletes the cluster (appendonly: the data is still there)
            assert not stuck
    finally:
        server.close()


def test_a_negative_round_in_redis_is_corrupt_and_starts_no_round(redis_url, cluster_id, tmp_path):
    """A cluster record whose ``round`` is -7 (requested 0 > -7) used to parse, and the coordinator started an
    unrequested round -6 from it; now the record is corrupt: the step raises the typed error, nothing changes."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw = RawRedis(redis_url, cluster_id)
        raw.r.hset(raw.keys.rearrange, "round", "-7")
        coordinator = Coordinator(tc.store(), lease_ms=3_000)
        assert coordinator.ensure_leadership()
        before = raw.snapshot()
        with pytest.raises(CorruptRecordError, match="field 'round' holds '-7'"):
            coordinator.step()
        assert raw.snapshot() == before
        raw.r.hset(raw.keys.rearrange, "round", "0")  # the teardown reads the cluster


def test_a_failing_step_with_a_short_lease_keeps_the_lease(redis_url, cluster_id, tmp_path):
    """With ``lease_ms`` below the 1 s error back-off (300 ms is allowed), a coordinator whose step keeps failing
    (a corrupt cluster record) used to let its lease lapse at every retry and take it again with a new fence; the
    back-off is now at most a third of the lease, so it is renewed in time: one fence for the whole stretch."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw = RawRedis(redis_url, cluster_id)
        store = tc.store()
        cursor = store.cursor()
        raw.r.hset(raw.keys.rearrange, "state", "BOGUS")
        coordinator = Coordinator(tc.store(), lease_ms=600)
        steps = []  # every step it tries (the failure is announced and logged once, not at every retry)
        step = coordinator.step
        coordinator.step = lambda: (steps.append(1), step())[1]
        t = threading.Thread(target=coordinator.run, daemon=True)
        t.start()
        try:
            end, kinds = time.monotonic() + 60, []
            while len(steps) < 5:  # four failed retries: 4 s of back-off before, 0.8 s now; the lease is 0.6 s
                assert time.monotonic() < end, "the coordinator did not retry its failing step"
                kinds += [e["kind"] for e in store.wait(cursor, 100)]
            kinds += [e["kind"] for e in store.wait(cursor, 1)]
            assert kinds.count("coordinator_error") == 1, kinds  # announced once, not at every retry
        finally:
            coordinator.stop_event.set()
            t.join(timeout=30)
            raw.r.hset(raw.keys.rearrange, "state", "FREE")
        assert int(raw.r.get(raw.keys.fence)) == 1


def test_run_begun_while_redis_is_away_waits_for_it_and_then_serves_rounds(tmp_path, cluster_id):
    """An agent whose loop starts while Redis is down (its worker started, then Redis went away) retries until
    Redis is back and then takes part in rounds: its first read of the signal stream used to sit outside the
    retry loop, so ``run`` raised and the agent thread died."""
    server = RedisServer(tmp_path / "redis")
    try:
        with thread_cluster(server.url, cluster_id, tmp_path) as tc:
            for r in range(tc.config.ep_size):
                tc.agents.append(RankAgent(tc.store(), r, load_source=lambda _round, r=r: tc.loads[r],
                                           backend_factory=NumpyWeights.factory()))
                tc.agents[-1].start()
            refused = [threading.Event() for _ in tc.agents]
            for agent, event in zip(tc.agents, refused):
                first = agent.store.signal_cursor

                def signal_cursor(first=first, event=event):
                    try:
                        return first()
                    except RedisUnavailableError:
                        event.set()
                        raise

                agent.store.signal_cursor = signal_cursor
            server.kill()
            for agent in tc.agents:
                tc.threads.append(threading.Thread(target=agent.run, kwargs={"block_ms": 200}, daemon=True))
                tc.threads[-1].start()
            assert all(event.wait(30) for event in refused)  # each loop met Redis away at its first read
            server.start()
            store = tc.store()
            tc.start_coordinator()
            target = store.request_round("test")
            wait_for(lambda: (lambda c: c.round >= target and c.state is ClusterState.FREE)(store.read_cluster()),
                     60, store=store, what="a round after Redis came back")
            assert [a["trigger"] for a in store.audit() if a["machine"] == "cluster"][-1] == "release"
            assert all(t.is_alive() for t in tc.threads)
    finally:
        server.close()


def test_a_corrupt_fence_counter_is_named_and_the_coordinator_leads_once_it_is_repaired(redis_url, cluster_id,
                                                                                       tmp_path):
    """A fence counter that holds a non-integer (written by someone else) makes every lease acquisition fail: the
    coordinator's loop survives, its ``coordinator_error`` events name the key, nothing else is written, and once
    the counter is repaired it leads with the next fence."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw = RawRedis(redis_url, cluster_id)
        raw.r.set(raw.keys.fence, "abc")
        before = raw.snapshot()
        store = tc.store()
        cursor = store.cursor()
        coordinator = tc.start_coordinator()
        errors = []
        wait_for(lambda: errors.extend(e for e in store.wait(cursor, 500) if e["kind"] == "coordinator_error")
                 or errors, 30, what="a coordinator_error event")
        assert raw.keys.fence in errors[0]["error"] and "abc" in errors[0]["error"]
        assert raw.snapshot() == before  # no lease, no fence, no record changed
        raw.r.set(raw.keys.fence, "41")
        wait_for(lambda: store.lease_info().holder == f"42:{coordinator.holder}", 30, store=store,
                 what="the lease taken with fence 42")


def test_a_load_supplied_between_the_coordinators_check_and_its_freeze_is_the_one_frozen(redis_url, cluster_id,
                                                                                         tmp_path):
    """The API's recv_expert_weight writes a supplied load while the coordinator collects. Landing right after the
    coordinator looked for one and before it froze the ranks' windows, it used to be passed over while the API had
    answered 200; now the freeze refuses (both writes are WATCHed transactions on the snapshot and the supplied
    load) and the next step freezes the supplied load. The other order: a load supplied after the freeze is
    refused (StateError, nothing written)."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents()
        store = tc.store()
        coordinator = Coordinator(tc.store(), lease_ms=3_000)
        assert coordinator.ensure_leadership()
        round_ = store.request_round("test")
        while store.read_cluster().state is not ClusterState.COLLECTING:
            coordinator.step()
        wait_for(lambda: all(at == round_ for at in store.load_rounds()), 30, store=store, what="every window")
        supplied = np.full((tc.config.num_layers, tc.config.num_logical_experts), 7, dtype=np.int64)
        api = tc.store()
        looked = coordinator.store.supplied_load

        def racing(r):  # the coordinator's look finds nothing; the API's write lands right after it
            found = looked(r)
            coordinator.store.supplied_load = looked
            api.supply_load(r, supplied)
            return found

        coordinator.store.supplied_load = racing
        while store.read_cluster().state is ClusterState.COLLECTING:
            coordinator.step()
        assert np.array_equal(store.read_snapshot(round_), supplied)
        before = RawRedis(redis_url, cluster_id).snapshot()
        with pytest.raises(StateError, match=f"round {round_}'s load snapshot is frozen already"):
            api.supply_load(round_, supplied + 1)
        assert RawRedis(redis_url, cluster_id).snapshot() == before


def test_a_supplied_load_of_the_wrong_shape_aborts_the_round_naming_it(redis_url, cluster_id, tmp_path):
    """A supplied load the API did not check (written otherwise) whose shape is not [num_layers, num_experts]
    aborts the round being collected with the shapes in the reason (it used to be passed over in silence)."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        for r in range(tc.config.ep_size):
            tc.start_silent_rank(r)  # registered and beating: the start guard lets the round start
        coordinator = Coordinator(tc.store(), lease_ms=3_000)
        assert coordinator.ensure_leadership()
        round_ = store.request_round("test")
        coordinator.step()
        assert store.read_cluster().state is ClusterState.COLLECTING
        store.supply_load(round_, np.ones((1, 2), dtype=np.int64))
        coordinator.step()
        rec = store.read_cluster()
        assert rec.state is ClusterState.FREE and "has shape (1, 2), expected (3, 16)" in rec.reason
