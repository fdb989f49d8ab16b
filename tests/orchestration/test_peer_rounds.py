"""Rounds whose moved experts come from peers' live slots: rank agents with a peer secret (thread clusters)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from fdeplb.api.prometheus import ClusterCollector
from fdeplb.cli.status_view import print_status
from fdeplb.orchestration.peer_agent import peer_share_s, peer_wait_s
from fdeplb.status import cluster_status
from fdeplb.testing import NumpyWeights
from tests.helpers import thread_cluster, wait_for
from tests.orchestration.helpers import round_over, transitions_of
from tests.weights.peer_proc import WrongBytes

SECRET = "round-peer-secret"


def _staged_records(store):
    return [a for a in store.iter_audit() if a["machine"] == "rank" and a["trigger"] == "staged"]


def test_a_round_moves_experts_from_peers_and_reports_peer_bytes(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start(peer_secret=SECRET)
        assert all(store.rank_info()[r]["peer_address"].startswith("127.0.0.1:") for r in range(4))
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")]
        records = [store.read_rank(r) for r in range(4)]
        assert sum(r.peer for r in records) > 0
        for rec in records:  # every expert new to a rank is live on another member
            assert rec.disk == 0 and rec.disk_bytes == 0
            assert rec.peer_bytes == rec.peer * tc.agents[0].backend.expert_nbytes
        assert all(not a["detail"] for a in _staged_records(store))
        after = store.current_placement().phy2log
        for agent in tc.agents:
            assert np.array_equal(agent.backend.phy2log, after) and agent.backend.verify() == (15, 15)
        status = cluster_status(store)
        rows = status["ranks"]
        assert [row["peer_bytes"] for row in rows] == [r.peer_bytes for r in records]
        assert [row["staged_bytes"] for row in rows] == [r.peer_bytes + r.local_bytes for r in records]
        text = io.StringIO()
        print_status(status, text)
        rank_rows = [line for line in text.getvalue().splitlines() if "from peers" in line]
        assert len(rank_rows) == sum(1 for r in records if r.peer_bytes)
        metrics = {(s.labels["ep_rank"], s.labels["source"]): s.value for family in ClusterCollector(store).collect()
                   if family.name == "fdeplb_staging_source_bytes" for s in family.samples}
        for r, rec in enumerate(records):
            assert metrics[(str(r), "peer")] == rec.peer_bytes and metrics[(str(r), "disk")] == 0


def test_a_peer_sending_wrong_bytes_is_audited_and_the_round_goes_on(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        liar = lambda _c, phy2log, r, size: WrongBytes(phy2log, r, size)  # noqa: E731
        tc.start_agents([0], peer_secret=SECRET, backend_factory=liar)
        tc.start_agents([1, 2, 3], peer_secret=SECRET, backend_factory=NumpyWeights.factory())
        tc.start_coordinator()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")]
        fallbacks = [json.loads(a["detail"]) for a in _staged_records(store) if a["detail"]]
        assert fallbacks, "some rank asked rank 0 for an expert"
        for detail in fallbacks:
            assert {f["peer"] for f in detail["fallback"]} == {0}
            assert "wrong bytes" in detail["fallback"][0]["error"]
        audited = {int(a["key"].rsplit(":", 1)[1]) for a in _staged_records(store) if a["detail"]}
        for r in audited:  # those experts came from disk: counted there, verified in the swap
            assert store.read_rank(r).disk > 0
        after = store.current_placement().phy2log
        for agent in tc.agents:
            assert np.array_equal(agent.backend.phy2log, after) and agent.backend.verify() == (15, 15)


def test_the_per_peer_wait_is_half_the_heartbeat_ttl_within_1_to_10_s():
    assert [peer_wait_s(ttl) for ttl in (100, 2_000, 4_000, 10_000, 20_000, 60_000)] == [1.0, 1.0, 2.0, 5.0, 10.0, 10.0]


def test_a_peers_whole_share_is_waited_on_for_half_the_loading_deadline(redis_url, cluster_id, tmp_path):
    """The agent's transports bound a peer's share (not only each expert): what a slow peer has not delivered by
    half the loading deadline is read from the checkpoint before the round's deadline aborts it."""
    assert peer_share_s(120_000) == 60.0
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start(peer_secret=SECRET)
        service = tc.agents[0].peers
        assert service.share_s == peer_share_s(tc.config.deadlines.loading_ms) == 10.0
        old = tc.agents[0].backend.phy2log
        transport = service.fetch_for(old, old, (0, 1, 2, 3), store).transport
        assert transport.total_s == 10.0


def test_a_rank_staging_longer_than_its_ttl_from_a_lying_peer_stays_a_member(redis_url, cluster_id, tmp_path):
    """QA HIGH 1 (a peer sending wrong bytes, a small TTL): ranks 1-3 stage for more than twice their 1 s heartbeat
    TTL (their staging returns only once their heartbeat moved past that, or fails after 10 s) while rank 0 sends
    wrong bytes; their heartbeat stays fresh meanwhile, none is suspected and the round releases."""
    ttl_ms = 1_000

    class SlowStaging(NumpyWeights):  # staging that outlasts the TTL, for as long as it takes the heartbeat past it
        def stage(self, new_phy2log, budget_bytes, pause=None, peers=None):
            store = tc.store()
            since = store.now_ms()
            staged = super().stage(new_phy2log, budget_bytes, pause, peers)
            wait_for(lambda: store.read_rank(self.ep_rank).heartbeat_ms > since + 2 * ttl_ms, 10, None,
                     f"rank {self.ep_rank}'s heartbeat while it stages")
            return staged

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        liar = lambda _c, phy2log, r, size: WrongBytes(phy2log, r, size)  # noqa: E731
        tc.start_agents([0], peer_secret=SECRET, backend_factory=liar, heartbeat_ttl_ms=ttl_ms)
        tc.start_agents([1, 2, 3], peer_secret=SECRET, backend_factory=lambda _c, phy2log, r, size: SlowStaging(
            phy2log, r, size), heartbeat_ttl_ms=ttl_ms)
        assert all(agent.peers.timeout_s == 1.0 for agent in tc.agents)  # half the TTL, within [1, 10] s
        tc.start_coordinator()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        trail = [(a["trigger"], a["reason"][:100]) for a in store.iter_audit() if a["machine"] != "rank"]
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")], trail
        assert not [a for a in store.iter_audit() if a["trigger"] == "suspect"], trail
        fallbacks = [json.loads(a["detail"]) for a in _staged_records(store) if a["detail"]]
        assert fallbacks and all("wrong bytes" in f["error"] for d in fallbacks for f in d["fallback"])


def test_a_wrong_secret_raises_one_alarm_naming_it_and_status_shows_the_disk_bytes(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        before = store.current_placement().phy2log
        tc.start_agents([0, 1, 2], peer_secret=SECRET)
        tc.start_agents([3], peer_secret="another-secret")  # no handshake with rank 3 succeeds, either way
        tc.start_coordinator()
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")]
        alarms = [a for a in store.iter_audit() if a["trigger"] == "alarm"]
        assert alarms and all("failed authentication" in a["reason"] and "FDEPLB_PEER_SECRET" in a["reason"]
                              for a in alarms), [a["reason"] for a in alarms]
        assert len({a["actor"] for a in alarms}) == len(alarms)  # one per rank that met a refusal
        assert "rank3" in {a["actor"].split("@")[0] for a in alarms}
        rank3 = store.read_rank(3)
        assert rank3.peer_bytes == 0 and rank3.disk_bytes > 0  # every expert new to it came from disk
        text = io.StringIO()
        print_status(cluster_status(store), text)
        assert f"staged 0 B from peers, {rank3.disk_bytes} B from disk" in text.getvalue()
        agent = tc.agents[3]  # staging again (back to the first placement) meets the refusals again: no alarm
        staged = agent.peers.stage(agent.backend, before, None, None, agent.live_ranks, store)
        try:
            assert staged.fallbacks and all(f.unauthenticated for f in staged.fallbacks)
        finally:
            staged.release()
        assert len([a for a in store.iter_audit() if a["trigger"] == "alarm"]) == len(alarms)


def test_paddle_ranks_serve_their_live_slots_to_each_other(redis_url, cluster_id, tmp_path):
    pytest.importorskip("paddle")
    with thread_cluster(redis_url, cluster_id, tmp_path, backend="paddle") as tc:
        store = tc.store()
        tc.start(peer_secret=SECRET)
        store.request_round()
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert transitions_of(store)[-2:] == [("SWAPPING", "DONE", "swapped"), ("DONE", "FREE", "release")]
        records = [store.read_rank(r) for r in range(4)]
        assert sum(r.peer_bytes for r in records) > 0 and sum(r.disk_bytes for r in records) == 0
        assert all(not a["detail"] for a in _staged_records(store))
        for agent in tc.agents:  # every slot, peer-staged ones included, holds its checkpoint expert
            assert agent.backend.verify() == (15, 15)


def test_a_start_that_fails_after_the_peer_server_opened_leaves_none_listening(redis_url, cluster_id, tmp_path,
                                                                               monkeypatch):
    """Redis away as the rank registers: start() raises, and the peer server it had opened over the live slots is
    closed (before, it kept accepting connections, with no loop left to close it: README's
    ``EmbeddedAgent(...).start()`` never returns an agent to close then)."""
    import socket

    from fdeplb.errors import RedisUnavailableError
    from fdeplb.orchestration.embedded_agent import EmbeddedAgent

    with thread_cluster(redis_url, cluster_id, tmp_path):
        agent = EmbeddedAgent(redis_url, 0, cluster=cluster_id, backend_factory=NumpyWeights.factory(),
                              peer_secret=SECRET)
        opened = []
        real = agent.store.register_rank

        def away(*_a, **_k):
            opened.append(agent.peers.address)
            raise RedisUnavailableError("redis away")

        monkeypatch.setattr(agent.store, "register_rank", away)
        with pytest.raises(RedisUnavailableError):
            agent.start()
        assert agent.peers is None and len(opened) == 1
        host, _, port = opened[0].rpartition(":")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5).close()
        monkeypatch.setattr(agent.store, "register_rank", real)
        with agent.start():  # a later start opens a new one
            assert agent.peers is not None
