"""Recovery from lost records, the pieces without processes: the start guard and
``/health`` count every rank of ``ep_size``, registered or not; ``init-cluster`` over live ranks adopts the placement
they report when they agree and refuses, naming them, when they do not; an agent whose records are gone reports
its live placement and registers again once the cluster is created anew, loading the cluster's placement when it
holds another one and refusing only another topology (``/health`` names it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import structlog

from fdeplb.errors import NotFoundError, StateError, TopologyError, VerificationError
from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.orchestration import Coordinator, RankAgent, init_cluster
from fdeplb.orchestration.membership import MembershipWatch
from fdeplb.orchestration.recovery import PLACEMENT_LOADED, RecordsLostError
from fdeplb.placement import initial_placement, routing_digest
from fdeplb.status import unhealthy_ranks
from fdeplb.store import ClusterConfig, Store
from fdeplb.store.liveness import NOT_REGISTERED, stale_of
from fdeplb.testing import NumpyWeights
from fdeplb.weights.reports import SlotCheck
from tests.helpers import wait_for

CFG = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=12, ep_size=3)


def _store(redis_url, cluster_id) -> Store:
    store = Store(redis_url, cluster_id)
    assert init_cluster(store, CFG, initial_placement(2, 8, 12).phy2log)
    return store


def test_the_start_guard_refuses_unregistered_ranks_and_health_is_503(redis_url, cluster_id):
    store = _store(redis_url, cluster_id)
    try:
        assert unhealthy_ranks(store) == (0, {0: "not registered", 1: "not registered", 2: "not registered"})
        store.register_rank(1, {"agent_id": "a1"})
        store.heartbeat(1, heartbeat_ttl_ms=60_000)
        store.request_round("test")
        coordinator = Coordinator(store, "co")
        assert coordinator.ensure_leadership()
        coordinator.step()
        rec = store.read_cluster()
        assert rec.state == "FREE" and rec.reason == "start refused: stale ranks 0 (not registered), 2 (not registered)"
        assert unhealthy_ranks(store) == (1, {0: "not registered", 2: "not registered"})
        notes = [a for a in store.iter_audit() if a["trigger"] == "start_refused"]
        assert len(notes) == 1 and '"heartbeat_age_ms":-1' in notes[0]["detail"]
    finally:
        store.delete_cluster()


def test_an_unregistered_rank_is_stale_to_the_start_guard_but_never_suspected(redis_url, cluster_id):
    """One staleness rule (``stale_of``), two questions: the start guard counts every rank of ``ep_size`` (an
    unregistered one is stale, age NOT_REGISTERED); the membership watch suspects only a registered rank whose
    heartbeat lapsed, never one that is not registered."""
    store = _store(redis_url, cluster_id)
    try:
        store.register_rank(1, {"agent_id": "a1"})
        store.heartbeat(1, heartbeat_ttl_ms=100)
        wait_for(lambda: 1 in store.stale_ranks(), 10, what="rank 1's 100 ms heartbeat to lapse")
        view = store.member_view()
        assert stale_of(view.heartbeats, CFG.ep_size) == {0: NOT_REGISTERED, 1: view.heartbeats[1][0],
                                                          2: NOT_REGISTERED}
        assert stale_of(view.heartbeats) == {1: view.heartbeats[1][0]}
        watch = MembershipWatch(store, "co", structlog.get_logger("test"))
        assert watch.observe(fence="", exclude_ms=60_000, cluster_state=ClusterState.FREE)[0]
        assert [store.read(MEMBERSHIP, r).state for r in range(3)] == [MemberState.ACTIVE, MemberState.SUSPECT,
                                                                      MemberState.ACTIVE]
    finally:
        store.delete_cluster()


def _report(store, r, phy2log, plan_id):
    store.report_live(r, phy2log, plan_id, agent_id=f"agent{r}", ttl_ms=60_000)


def test_init_cluster_adopts_the_live_placement_when_the_ranks_agree(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    live = initial_placement(2, 8, 12).phy2log[:, ::-1].copy()
    try:
        for r in range(3):
            _report(store, r, live, "abc123")
        assert init_cluster(store, CFG, initial_placement(2, 8, 12).phy2log)
        placement = store.current_placement()
        assert placement.plan_id == "abc123" and np.array_equal(placement.phy2log, live)
        assert store.live_reports(3) == {} and store.read_config().incarnation
    finally:
        store.delete_cluster()


def test_init_cluster_refuses_when_the_live_ranks_disagree_and_writes_nothing(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    first = initial_placement(2, 8, 12).phy2log
    try:
        _report(store, 0, first, "")
        _report(store, 1, first[:, ::-1].copy(), "p2")
        _report(store, 2, first[:, ::-1].copy(), "p2")
        with pytest.raises(StateError, match=r"disagree.*ranks \[0\] hold plan initial.*ranks \[1, 2\] hold plan p2"):
            init_cluster(store, CFG, first)
        assert store.key_count() == 3  # the three reports, nothing else
    finally:
        store.delete_cluster()


def _agent(store, r=0) -> RankAgent:
    agent = RankAgent(store, r, load_source=lambda _round: np.zeros((2, 8), np.int64),
                      backend_factory=NumpyWeights.factory(), heartbeat_ttl_ms=60_000)
    agent.start(info={"api_address": "10.0.0.1:8000"})
    return agent


def test_an_agent_reports_while_the_records_are_gone_then_registers_again(redis_url, cluster_id):
    store = _store(redis_url, cluster_id)
    agent = _agent(Store(redis_url, cluster_id))
    try:
        old = store.read_config().incarnation
        store.delete_cluster()  # as FLUSHALL would
        with pytest.raises(NotFoundError) as gone:
            agent.step()
        with pytest.raises(RecordsLostError, match="records are gone"):
            agent._records_lost(gone.value)  # what the agent's loop does with it
        assert sorted(store.live_reports(3)) == [0]
        assert init_cluster(store, CFG, initial_placement(2, 8, 12).phy2log)
        assert store.read_config(fresh=True).incarnation != old
        agent._heartbeat(force=True)  # finds the registry without it: registers again
        info = store.rank_info()[0]
        assert info["agent_id"] == agent.agent_id and info["api_address"] == "10.0.0.1:8000"
        assert agent.config.incarnation == store.read_config().incarnation
        assert store.read_rank(0).heartbeat_ttl_ms == 60_000
    finally:
        store.delete_cluster()


def _notes(store, trigger):
    return [a for a in store.iter_audit() if a["trigger"] == trigger]


def test_an_agent_loads_the_placement_of_a_cluster_created_again_with_another_one(redis_url, cluster_id, tmp_path):
    """Same topology, another placement: the agent reloads the cluster's from the checkpoint (verified, audited
    ``placement_loaded``) and registers; it no longer refuses until its worker is restarted. The note replays."""
    from fdeplb.cli import main
    from fdeplb.replay import replay_file

    store = _store(redis_url, cluster_id)
    agent = _agent(Store(redis_url, cluster_id))
    other = initial_placement(2, 8, 12).phy2log[:, ::-1].copy()
    try:
        store.delete_cluster()
        assert init_cluster(store, dataclasses.replace(CFG), other)
        agent._records_lost(None)
        assert np.array_equal(agent.backend.phy2log, other) and agent.backend.verify() == (12 // 3 * 2, 12 // 3 * 2)
        assert store.rank_info()[0]["agent_id"] == agent.agent_id
        notes = _notes(store, PLACEMENT_LOADED)
        assert len(notes) == 1 and notes[0]["key"].endswith("rank:0") and "verified" in notes[0]["reason"]
        assert store.read_rank(0).routing_digest == routing_digest(other)
        path = tmp_path / "loaded.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        assert replay_file(path).skipped == 1
    finally:
        store.delete_cluster()


def test_an_embedded_agent_loads_the_cluster_placement_at_its_safe_point_then_registers(redis_url, cluster_id):
    """With safe points the live experts change only between the worker's forward steps: the load waits for
    ``at_safe_point``, and the agent registers after it, not before."""
    store = _store(redis_url, cluster_id)
    agent = RankAgent(Store(redis_url, cluster_id), 0, load_source=lambda _round: np.zeros((2, 8), np.int64),
                      backend_factory=NumpyWeights.factory(), heartbeat_ttl_ms=60_000, safe_points=True)
    agent.start()
    other = initial_placement(2, 8, 12).phy2log[:, ::-1].copy()
    try:
        store.delete_cluster()
        assert init_cluster(store, CFG, other)
        agent._records_lost(None)
        assert 0 not in store.rank_info() and not np.array_equal(agent.backend.phy2log, other)  # waits for it
        assert agent.at_safe_point()
        assert np.array_equal(agent.backend.phy2log, other)
        agent._records_lost(None)
        assert store.rank_info()[0]["agent_id"] == agent.agent_id and len(_notes(store, PLACEMENT_LOADED)) == 1
    finally:
        store.delete_cluster()


class _CorruptFirstLoad(NumpyWeights):
    """A rank whose first reload reads a slot wrong (verification fails), the next one right."""

    loads = 0

    def reload_in(self, phy2log):
        check = super().reload_in(phy2log)
        type(self).loads += 1
        return SlotCheck(check.verified - 1, check.total) if type(self).loads == 1 else check


def test_a_load_that_fails_its_verification_is_loaded_again_before_the_agent_registers(redis_url, cluster_id):
    store = _store(redis_url, cluster_id)
    agent = RankAgent(Store(redis_url, cluster_id), 0, load_source=lambda _round: np.zeros((2, 8), np.int64),
                      backend_factory=_CorruptFirstLoad.factory(), heartbeat_ttl_ms=60_000)
    agent.start()
    other = initial_placement(2, 8, 12).phy2log[:, ::-1].copy()
    try:
        store.delete_cluster()
        assert init_cluster(store, CFG, other)
        with pytest.raises(VerificationError, match="1 of 8 slots do not match the checkpoint; not registering"):
            agent._records_lost(None)
        assert 0 not in store.rank_info() and _notes(store, PLACEMENT_LOADED) == []
        agent._records_lost(None)  # the loop's retry: loaded again (the slots' placement already matches)
        assert _CorruptFirstLoad.loads == 2 and store.rank_info()[0]["agent_id"] == agent.agent_id
        assert len(_notes(store, PLACEMENT_LOADED)) == 1
    finally:
        store.delete_cluster()


def test_an_agent_refuses_another_topology_and_health_names_it(redis_url, cluster_id):
    store = _store(redis_url, cluster_id)
    agent = _agent(Store(redis_url, cluster_id))
    bigger = dataclasses.replace(CFG, num_physical_experts=15)
    try:
        store.delete_cluster()
        assert init_cluster(store, bigger, initial_placement(2, 8, 15).phy2log)
        with pytest.raises(TopologyError, match="created again with topology"):
            agent._records_lost(None)
        assert 0 not in store.rank_info()
        registered, why = unhealthy_ranks(store)
        assert registered == 0 and why[0].startswith("not registered: rank 0: cluster") and "topology" in why[0]
        assert why[1] == "not registered"
        # what it says, done: "create the cluster with the worker's" topology: the same agent registers
        store.delete_cluster()
        assert init_cluster(store, CFG, initial_placement(2, 8, 12).phy2log)
        agent._records_lost(None)
        assert store.rank_info()[0]["agent_id"] == agent.agent_id
        # or "restart it with the cluster's topology": a worker started on the bigger cluster serves it
        store.delete_cluster()
        assert init_cluster(store, bigger, initial_placement(2, 8, 15).phy2log)
        with pytest.raises(TopologyError):
            agent._records_lost(None)
        agent.stop_event.set()
        fresh = _agent(Store(redis_url, cluster_id))
        assert store.rank_info()[0]["agent_id"] == fresh.agent_id and unhealthy_ranks(store)[0] == 1
    finally:
        store.delete_cluster()


def test_the_disagreement_message_is_followed_by_doing_what_it_says(redis_url, cluster_id):
    """init-cluster refuses live ranks that disagree and says to run it again with --adopt-wait-ms 0 (no
    adoption): done, the initial placement is written and a live agent holding another one loads it and
    registers, no restart."""
    store = _store(redis_url, cluster_id)
    agent = _agent(Store(redis_url, cluster_id))
    first = initial_placement(2, 8, 12).phy2log
    try:
        store.delete_cluster()
        _report(store, 1, first[:, ::-1].copy(), "p2")
        with pytest.raises(RecordsLostError):
            agent._records_lost(None)  # rank 0 reports the initial placement, rank 1 another
        with pytest.raises(StateError, match="disagree.*run init-cluster again with --adopt-wait-ms 0") as said:
            init_cluster(store, CFG, first)
        assert "restart" not in str(said.value).split("nothing written")[1].replace("no restart", "")
        agent.backend.reload_in(first[:, ::-1].copy())  # rank 0 now holds another placement than the initial one
        assert init_cluster(store, CFG, first, adopt=False)
        assert np.array_equal(store.current_placement().phy2log, first)
        agent._records_lost(None)
        assert np.array_equal(agent.backend.phy2log, first) and len(_notes(store, PLACEMENT_LOADED)) == 1
        assert store.rank_info()[0]["agent_id"] == agent.agent_id
    finally:
        store.delete_cluster()


def test_init_cluster_waits_for_the_live_reports_and_says_who_did_not(redis_url, cluster_id):
    """With ``adopt_wait_ms`` a cluster without records waits for reports once some rank reported (a Redis up
    for long: no wait without one), then adopts and says which ranks did not report."""
    store = Store(redis_url, cluster_id)
    live = initial_placement(2, 8, 12).phy2log[:, ::-1].copy()
    said = []
    try:
        for r in (0, 2):
            _report(store, r, live, "abc123")
        assert init_cluster(store, CFG, initial_placement(2, 8, 12).phy2log, adopt_wait_ms=300, say=said.append)
        assert store.current_placement().plan_id == "abc123"
        assert len(said) == 1 and "2 of 3 ranks reported" in said[0] and "ranks [1] did not" in said[0], said
    finally:
        store.delete_cluster()


def test_init_cluster_refuses_fewer_ranks_than_report_a_live_placement(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    live = initial_placement(2, 8, 12).phy2log
    try:
        for r in range(4):  # 4 live ranks of a 4-rank cluster whose records were lost; re-created with ep_size 3
            _report(store, r, live, "abc123")
        with pytest.raises(TopologyError, match=r"ranks \[3\] report the placement they hold live.*ep_size 3"):
            init_cluster(store, CFG, live)
        with pytest.raises(NotFoundError):
            store.read_config()  # nothing written
    finally:
        store.delete_cluster()


def test_a_negative_adopt_wait_is_exit_2_and_writes_nothing(redis_url, cluster_id, tmp_path, capsys):
    from tests.cli.helpers import init_args
    from tests.helpers import run_cli

    store = Store(redis_url, cluster_id)
    code, _, err = run_cli(capsys, *init_args(store, tmp_path, "--adopt-wait-ms", "-1"))
    assert code == 2 and "--adopt-wait-ms must be >= 0, got -1" in err
    assert store.key_count() == 0
