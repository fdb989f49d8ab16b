"""The chunked swap end to end through EmbeddedAgents on paddle tensors (CPU): a tiny pause budget (one changed
layer per safe point) over several rounds, a VerificationError in load_chunk in the background prepare and again in
the pause (the retry still switches one chunk per safe point), and budgets init-cluster would refuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.errors import VerificationError  # noqa: E402
from fdeplb.machines.tables import RankState  # noqa: E402
from fdeplb.weights.live import LiveExperts  # noqa: E402
from fdeplb.weights.plan import routing_tables  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.orchestration.helpers import new_load, paddle_serving, round_done  # noqa: E402

L = 4


def _check_consistent(store, agents):
    wait_for(lambda: all(store.read_rank(r).state is RankState.IDLE for r in range(len(agents))), 30, store,
             "every rank IDLE")
    placement = store.current_placement()
    ranks = [store.read_rank(r) for r in range(len(agents))]
    for a, rec in zip(agents, ranks):
        assert rec.state is RankState.IDLE, rec
        assert np.array_equal(a.backend.phy2log, placement.phy2log), f"rank {a.ep_rank} serves another placement"
        assert tuple(a.backend.verify()) == (a.backend.slots_total, a.backend.slots_total)
        live = a.backend.live
        assert not live.needs_reload
        log2phy, logcnt = routing_tables(placement.phy2log, live.num_logical_experts, live.max_replicas)
        assert np.array_equal(live.phy2log_tensor.numpy(), placement.phy2log)
        assert np.array_equal(live.log2phy.numpy(), log2phy)
        assert np.array_equal(live.logcnt.numpy(), logcnt)
    assert len({r.routing_digest for r in ranks}) == 1
    return ranks


def _round(tc, store, agents, n, reason):
    """Round ``n`` with round n's load (:func:`_new_load`) recorded first; waits for it, checks every rank
    (:func:`_check_consistent`) and returns their records."""
    new_load(tc, n, store)
    store.request_round(reason)
    wait_for(lambda: round_done(store, n), 90, store, f"round {n}")
    return _check_consistent(store, agents)


def test_chunked_rounds_on_paddle_tensors_converge_with_one_chunk_per_layer(redis_url, cluster_id, tmp_path):
    with paddle_serving(redis_url, cluster_id, tmp_path) as (tc, store, agents):
        for n in (1, 2):
            ranks = _round(tc, store, agents, n, f"test {n}")
            assert [x.chunks for x in ranks] == [L] * 4, [x.chunks for x in ranks]
            assert all(0 < x.pause_max_ms <= x.pause_sum_ms for x in ranks)
            assert [x.late_steps for x in ranks] == [0] * 4


@pytest.mark.parametrize("failures", [2], ids=["background-and-pause"])  # once would be background only: the pause prepares again
def test_a_verification_error_in_load_chunk_on_one_rank_still_converges(redis_url, cluster_id, tmp_path,
                                                                         monkeypatch, failures):
    """Rank 1's load_chunk raises VerificationError on its first ``failures`` calls of round 1: once (the
    background prepare; the pause prepares again) or twice (background and pause: the chunk fails, the rank alarms
    and retries). The round completes, every rank serves the committed placement, slots and routing match."""
    real = LiveExperts.load_chunk
    calls = {"n": 0, "where": []}

    def flaky(self, plan, staged, new, layers):
        if self.ep_rank == 1 and calls["n"] < failures:
            calls["n"] += 1
            calls["where"].append(threading.current_thread().name)
            raise VerificationError("test: the device buffer's copy differs")
        return real(self, plan, staged, new, layers)

    monkeypatch.setattr(LiveExperts, "load_chunk", flaky)
    with paddle_serving(redis_url, cluster_id, tmp_path) as (tc, store, agents):
        cursor = store.cursor()
        _round(tc, store, agents, 1, "test fault")
        alarms = [e.fields for e in store.wait(cursor, 100) if e["kind"] == "alarm"]
        assert calls["n"] == failures
        if failures == 2:  # the chunk failed in its pause: the rank alarmed (and retried)
            assert any("swap verification failed" in str(a.get("message", "")) for a in alarms), alarms
        # a second round after the fault goes through cleanly
        _round(tc, store, agents, 2, "test after")


@pytest.mark.parametrize("fail_layer", [2])  # a middle layer: chunks applied before and after the failed one
def test_the_retry_after_a_failed_chunk_keeps_one_chunk_per_safe_point(redis_url, cluster_id, tmp_path,
                                                                       monkeypatch, fail_layer):
    """README ("A swap in chunks"): a swap of N chunks stretches over N consecutive steps instead of one long stall;
    a mismatch makes the rank reload, retry and alarm. Rank 1's chunk of layer ``fail_layer`` fails to load twice
    (background prepare and the pause). The round converges and the retry (not armed: from the next safe point)
    still applies one chunk per safe point (QA: it applied every remaining chunk at one, and the rank record's
    pause_max_ms, then the largest single chunk, hid it)."""
    from fdeplb.orchestration.safe_points import SafePointOp

    real = LiveExperts.load_chunk
    calls = {"n": 0}

    def flaky(self, plan, staged, new, layers):
        if self.ep_rank == 1 and tuple(layers) == (fail_layer,) and calls["n"] < 2:
            calls["n"] += 1
            raise VerificationError("test: the device buffer's copy differs")
        return real(self, plan, staged, new, layers)

    per_safe_point: list[tuple[int, float]] = []  # rank 1: (chunks applied, ms) per safe point that applied any
    real_apply = SafePointOp.apply

    def apply(self, step):
        before = len(self.pauses_ms)
        real_apply(self, step)
        if threading.current_thread().name == "worker1" and len(self.pauses_ms) > before:
            per_safe_point.append((len(self.pauses_ms) - before, sum(self.pauses_ms[before:])))

    monkeypatch.setattr(LiveExperts, "load_chunk", flaky)
    monkeypatch.setattr(SafePointOp, "apply", apply)
    with paddle_serving(redis_url, cluster_id, tmp_path) as (tc, store, agents):
        _round(tc, store, agents, 1, "test retry")
        assert calls["n"] == 2
        assert max(n for n, _ in per_safe_point) == 1, (
            f"rank 1 applied {per_safe_point} (chunks, ms) per safe point: the retry took every remaining "
            "chunk at one safe point")


@pytest.mark.parametrize("kw", [dict(max_pause_bytes=2**62, layers_per_safe_point=4096)], ids=["largest"])
def test_the_largest_agent_budget_swaps_whole_and_reports_it(redis_url, cluster_id, tmp_path, kw):
    from prometheus_client import CollectorRegistry, generate_latest

    from fdeplb.api.prometheus import ClusterCollector

    with paddle_serving(redis_url, cluster_id, tmp_path, **kw) as (tc, store, agents):
        ranks = _round(tc, store, agents, 1, "test budget")
        assert [x.chunks for x in ranks] == [1] * 4
        registry = CollectorRegistry()
        registry.register(ClusterCollector(store))
        text = generate_latest(registry).decode()
        for r, x in enumerate(ranks):
            assert f'fdeplb_swap_chunks{{ep_rank="{r}"}} 1.0' in text
            assert f'fdeplb_swap_pause_max_seconds{{ep_rank="{r}"}} {x.pause_max_ms / 1000}' in text
            assert f'fdeplb_swap_pause_sum_seconds{{ep_rank="{r}"}} {x.pause_sum_ms / 1000}' in text
            assert x.pause_max_ms == x.pause_sum_ms > 0
