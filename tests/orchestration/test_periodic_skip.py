"""The periodic trigger's skip is the gate's decision in the gate's words (one rule: ``GateDecision.why_skipped``,
through :func:`fdeplb.rounds.reasons.skipped`), with the gate's figures as its detail."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.rounds import reasons
from fdeplb.rounds.gating import GateDecision
from tests.helpers import thread_cluster, wait_for

pytestmark = pytest.mark.slow  # a thread cluster


def test_a_periodic_skip_says_why_the_gate_skipped(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, min_gain=1.0) as tc:  # no plan gains 1.0
        tc.start_agents(publish_interval_s=0.2)
        store = tc.store()
        wait_for(lambda: all(store.read_load(r) is not None for r in range(4)), 30, store, "windows")
        tc.start_coordinator(interval_s=0.5)
        skip = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "skip"], 30, store, "skip")[0]
        tc.stop()
        figures = reasons.gate_figures(skip)
        assert figures is not None and figures["min_gain"] == 1.0 and figures["gain"] <= 1.0
        decision = GateDecision(np.empty((0, 0), dtype=np.int64), figures["balancedness_before"],
                                figures["balancedness_after"], figures["moved_experts"], figures["min_gain"])
        assert skip["reason"] == reasons.skipped(decision).text
        assert skip["reason"].startswith(f"skipped: {decision.why_skipped} (balancedness ")
        assert store.read_cluster().round == 0


def test_the_periodic_trigger_judges_the_members_only(redis_url, cluster_id, tmp_path):
    # issue 34 A: rank 3 drained (16 experts in 32 slots, each on two ranks: nothing orphaned); the periodic
    # trigger sums the members' windows and gates over the members the placement is routed over
    from fdeplb.rounds.gating import mean_balancedness
    from fdeplb.orchestration.membership import operator_fire

    with thread_cluster(redis_url, cluster_id, tmp_path, num_redundant=16, min_gain=1.0) as tc:
        store = tc.store()
        operator_fire(store, 3, "drain", who="operator:test", reason="")
        tc.start_agents(publish_interval_s=0.2)
        wait_for(lambda: all(store.read_load(r) is not None for r in range(4)), 30, store, "windows")
        tc.start_coordinator(interval_s=0.5)
        # the membership round routes over ranks 0..2 first (never gated), then the periodic trigger skips
        skip = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "skip"], 60, store, "skip")[0]
        tc.stop()
        placement = store.current_placement()
        assert placement.members == "0,1,2"
        figures = reasons.gate_figures(skip)
        assert figures["live_ranks"] == [0, 1, 2] and "over members [0, 1, 2]" in skip["reason"]
        load = sum(store.read_load(r).expert_load for r in range(3))
        assert figures["balancedness_before"] == mean_balancedness(load, placement.phy2log, 4, (0, 1, 2))
