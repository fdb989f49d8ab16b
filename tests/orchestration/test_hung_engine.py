"""A hung engine (issue 34 item 3): a sim worker whose forward-step loop hangs (failpoint ``engine.hang=SIGUSR1``)
while its agent's thread heartbeats on. A round that waits on it suspects it once it passed no safe point for
``deadlines.exclude_ms`` (audited "no safe point for N ms"), aborts naming it, the re-placement round after its
exclusion goes on among the others, and the rank rejoins once its engine steps again (as a worker stopped whole
with SIGSTOP does once continued)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest

from fdeplb.cli import main
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.orchestration.membership import hung_ranks
from fdeplb.rounds.members import waited_on
from fdeplb.store.liveness import NOT_REGISTERED, MemberView, stale_of
from fdeplb.replay import replay_file
from fdeplb.rounds import reasons
from tests.faults.helpers import wait_event
from tests.helpers import wait_for
from tests.orchestration.helpers import deadlines, round_done
from tests.sim.helpers import write_trace

M = MemberState


def test_one_staleness_rule_judges_safe_points_of_the_ranks_a_round_waits_on():
    beats = {0: (100, 1000), 1: (100, 1000), 2: (1500, 1000), 3: (100, 0)}  # rank 2's heartbeat lapsed
    gaps = {0: 5_000, 1: 20, 2: 9_000, 3: 5_000}  # ms without a safe point at the last heartbeat
    assert stale_of(beats) == {2: 1500}
    assert stale_of(beats, safe_points=gaps, waited_on=(), hang_ms=1_000) == {2: 1500}  # no round waits on any
    # a waited-on engine hung past hang_ms is stale with its gap; a lapsed heartbeat keeps its own age
    assert stale_of(beats, safe_points=gaps, waited_on=(0, 1, 2, 3), hang_ms=1_000) == {0: 5_000, 2: 1500, 3: 5_000}
    assert stale_of(beats, safe_points=gaps, waited_on=(0, 1), hang_ms=5_000) == {2: 1500}  # not past it
    assert stale_of(beats, safe_points=gaps, waited_on=(0,), hang_ms=0) == {2: 1500}  # 0: safe points not judged
    assert stale_of(beats, 5, safe_points=gaps, waited_on=(1,), hang_ms=10) == {1: 20, 2: 1500, 4: NOT_REGISTERED}


def test_hung_ranks_waits_on_a_rounds_members_and_the_suspected():
    from fdeplb.store.records import MemberRecord

    members = [MemberRecord(key=f"member:{r}", state=st, version=1) for r, st in
               enumerate((M.ACTIVE, M.SUSPECT, M.ACTIVE, M.ACTIVE))]
    view = MemberView(0, {r: (10, 1000) for r in range(4)}, members, {0: 4_000, 1: 4_000, 2: 4_000})
    assert waited_on(ClusterState.FREE, "", 4) == () and waited_on(ClusterState.SWAPPING, "0,2", 4) == (0, 2)
    assert hung_ranks(view, (), 1_000) == ({1: 4_000}, {1: 4_000})  # FREE: only the suspected one stays hung
    assert hung_ranks(view, (0, 2, 3), 1_000) == ({0: 4_000, 1: 4_000, 2: 4_000}, {0: 4_000, 1: 4_000, 2: 4_000})
    lapsed = MemberView(0, {0: (2_000, 1000)}, members[:1], {0: 4_000})
    assert hung_ranks(lapsed, (0,), 1_000) == ({0: 2_000}, {})  # a lapsed heartbeat is no hang


def _audit(store, key: str, trigger: str) -> list[dict]:
    return [a for a in store.iter_audit() if a["key"] == key and a["trigger"] == trigger]


def _hung_ms(store, r: int) -> int:
    rec = store.read_rank(r)
    return rec.heartbeat_ms - rec.safe_point_ms if rec.safe_point_ms else 0


@contextlib.contextmanager
def _engines(redis_url, tmp_path, failpoints: dict[int, str], **config):
    """4 sim engines (a safe point every 5 ms, heartbeat TTL 1 s; rank r with ``FDEPLB_FAILPOINTS=failpoints[r]``)
    and a coordinator thread, over E=8, P=12, 4 ranks of 3 slots (rank 2's experts 6 and 7 have no other replica:
    re-placed on its exclusion), a lost rank excluded 1.5 s after its suspicion. Yields (store, cluster)."""
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id
    from fdeplb.store import ClusterConfig, Store

    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=12, ep_size=4,
                        deadlines=deadlines(exclude_ms=1_500), **config)
    store = Store(redis_url, new_cluster_id("hung-engine"))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=cfg, trace=str(write_trace(tmp_path, 2, 8)),
                           workdir=tmp_path, backend="numpy")
    cluster.init(initial_placement(2, 8, 12).phy2log)
    for r in range(4):
        cluster.start_rank(r, "--step-ms", "5", "--heartbeat-ttl-ms", "1000",
                           env={"FDEPLB_FAILPOINTS": failpoints[r]} if r in failpoints else None)
    coordinator = Coordinator(Store(redis_url, store.cluster), lease_ms=1_500)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    try:
        cluster.wait_ready(timeout_s=120)
        thread.start()
        yield store, cluster
    finally:
        coordinator.stop_event.set()
        if thread.is_alive():
            thread.join(10)
        cluster.stop()
        store.delete_cluster()


@pytest.mark.slow
@pytest.mark.faults
def test_a_hung_engine_is_suspected_the_round_aborts_the_next_goes_on_and_it_rejoins(redis_url, tmp_path):
    with _engines(redis_url, tmp_path, {2: "engine.hang=SIGUSR1"}) as (store, cluster):
        cursor = store.cursor()
        os.kill(cluster.procs[2].pid, signal.SIGUSR1)  # the engine hangs; its agent's thread runs on
        wait_event(store, cursor, kind="failpoint", name="engine.hang", state="hung", rank=2)
        # its heartbeat goes on, carrying its last safe point: hung for exclude_ms before the round starts
        wait_for(lambda: _hung_ms(store, 2) > 1_500, 30, store, "rank 2's heartbeat shows the hang")
        assert not _audit(store, "member:2", "suspect")  # no round waits on it: not suspected
        store.request_round("a round that waits on a hung engine")
        # the round waits on rank 2, whose safe points stopped for exclude_ms: suspected, the round aborts
        wait_for(lambda: _audit(store, "cluster", "abort"), 60, store, "round 1 aborts")
        (abort,) = _audit(store, "cluster", "abort")
        assert abort["round"] == "1" and "ranks [2]" in abort["reason"], abort
        (suspect,) = _audit(store, "member:2", "suspect")
        assert suspect["reason"].startswith("no safe point for ") and "rank 2" in suspect["reason"], suspect
        assert reasons.detail_of(suspect)["safe_point_age_ms"] > 1_500  # past exclude_ms, as its heartbeat said
        assert not _audit(store, "member:1", "suspect")  # the engines that step are never suspected
        # excluded at its deadline: the re-placement round goes on among the others
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is M.EXCLUDED, 30, store, "rank 2 excluded")
        (exclude,) = _audit(store, "member:2", "exclude")
        assert "still hung" in exclude["reason"], exclude
        rec = wait_for(lambda: round_done(store, 2) and store.current_placement().plan_id != "" and
                       store.read_cluster(), 60, store, "the re-placement round without rank 2")
        assert rec.members == "0,1,3" and store.current_placement().members == "0,1,3"
        # the engine steps again: the rank rejoins (REJOINING, admitted while FREE)
        os.kill(cluster.procs[2].pid, signal.SIGUSR1)
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is M.ACTIVE, 60, store, "rank 2 rejoins")
        assert [a["trigger"] for a in store.iter_audit() if a["key"] == "member:2"] == \
            ["suspect", "exclude", "rejoin", "admit"]
        (rejoin,) = _audit(store, "member:2", "rejoin")
        assert "is back (no safe point for " in rejoin["reason"], rejoin
        # routed over every rank again (the coordinator's membership round), rank 2 serving the current placement
        wait_for(lambda: round_done(store, 3) and store.current_placement().members == "", 60, store,
                 "the placement routed over rank 2 again")
        assert cluster.procs[2].poll() is None and store.read_rank(2).live_plan_id == store.current_placement().plan_id
        # a worker stopped whole (SIGSTOP: its heartbeat stops too) and continued comes back the same way
        os.kill(cluster.procs[1].pid, signal.SIGSTOP)
        wait_for(lambda: store.read(MEMBERSHIP, 1).state is M.EXCLUDED, 60, store, "rank 1 excluded")
        os.kill(cluster.procs[1].pid, signal.SIGCONT)
        wait_for(lambda: store.read(MEMBERSHIP, 1).state is M.ACTIVE, 60, store, "rank 1 rejoins")
        (back,) = _audit(store, "member:1", "rejoin")
        assert "is back (no heartbeat for " in back["reason"], back
        # the recording replays (the new reasons are audited notes of the membership machine)
        path = tmp_path / "hung.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", store.cluster, "--export", str(path)]) == 0
        final = replay_file(path).final
        assert final["member:2"].state == final["member:1"].state == "ACTIVE"


@pytest.mark.slow
@pytest.mark.faults
def test_an_engine_hung_past_the_commit_point_is_suspected_and_the_round_completes_without_it(redis_url, tmp_path):
    """Rank 1's engine hangs between the two chunks of a committed swap (failpoint ``rank.chunk.hang=1``, inside
    ``at_safe_point``; its agent's thread beats on): suspected once its safe points stopped for exclude_ms, the
    round rolls forward among the others instead of waiting out its swapping deadline."""
    with _engines(redis_url, tmp_path, {1: "rank.chunk.hang=1"}, layers_per_safe_point=1) as (store, cluster):
        cursor = store.cursor()
        store.request_round("a round whose swap a hung engine holds")
        wait_event(store, cursor, kind="failpoint", name="rank.chunk.hang", rank=1)
        wait_for(lambda: round_done(store, 1), 60, store, "round 1 rolls forward without rank 1")
        (suspect,) = _audit(store, "member:1", "suspect")
        assert suspect["reason"].startswith("no safe point for ") and "rank 1" in suspect["reason"], suspect
        assert not _audit(store, "cluster", "abort") and len(_audit(store, "cluster", "swapped")) == 1
        assert store.current_placement().plan_id == store.read_cluster().plan_id != ""  # committed, not undone
        assert "deadline" not in _audit(store, "cluster", "swapped")[0]["reason"]  # it did not wait one out
        wait_for(lambda: store.read(MEMBERSHIP, 1).state is M.EXCLUDED, 30, store, "rank 1 excluded")
        cluster.kill_rank(1)  # it hangs for good (the failpoint): SIGKILLed, as a supervisor would
