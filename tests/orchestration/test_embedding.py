"""The rank agent embedded in a serving worker: record(), safe points, switch steps, the weight-status machine,
liveness and the periodic trigger. Real Redis, real threads; waits are on events with deadlines."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fdeplb.errors import InputError, StateError
from fdeplb.machines.tables import ClusterState, RankState, WeightState
from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.embedded_agent import EmbeddedAgent
from fdeplb.orchestration.load_window import ExpertLoadWindow
from fdeplb.store import Deadlines
from fdeplb.testing import NumpyWeights
from tests.helpers import FailingReload, RawRedis, header_slots, thread_cluster, wait_for
from tests.orchestration.helpers import Instrumented, Workers, round_done

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in most tests


# ---- record() ---------------------------------------------------------------------------------------------------
def test_record_logical_physical_any_int_dtype_and_int64_totals(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory())
        agent.start()
        L, E, P = tc.config.num_layers, tc.config.num_logical_experts, tc.config.num_physical_experts
        big = np.full((L, E), 2**31 - 1, dtype=np.int32)
        for _ in range(3):
            agent.record(big)
        assert agent.window.total()[0, 0] == 3 * (2**31 - 1)  # exact past 2**31 (int32 would wrap)
        agent.window.clear()
        per_slot = np.arange(L * P, dtype=np.uint16).reshape(L, P)
        agent.record(per_slot)
        phy2log = agent.backend.phy2log
        expected = np.zeros((L, E), np.int64)
        for layer in range(L):
            for slot in range(P):
                expected[layer, phy2log[layer, slot]] += per_slot[layer, slot]
        assert np.array_equal(agent.window.total(), expected)
        import paddle

        agent.record(paddle.to_tensor(np.ones((L, E), np.int64)))
        assert np.array_equal(agent.window.total(), expected + 1)


@pytest.mark.parametrize("bad", [
    np.ones((3, 16), np.float32),                       # float
    np.full((3, 16), np.nan),                           # NaN
    np.ones((3, 16), bool),                             # bool is not a count
    -np.ones((3, 16), np.int64),                        # negative
    np.ones((3, 15), np.int64),                         # wrong shape
    np.ones((3, 21), np.int64),                         # neither E nor P
    np.ones((16,), np.int64),                           # wrong rank
    np.full((3, 16), 2**63, np.uint64),                 # past int64
    [[0.5] * 16] * 3,                                   # fractional, as a list
    [[1] * 16] * 2 + [[1] * 15],                        # ragged list
])
def test_record_refuses_bad_input_and_records_nothing(redis_url, cluster_id, tmp_path, bad):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory())
        agent.start()
        agent.record(np.ones((3, 16), np.int64))
        before, steps = agent.window.total(), len(agent.window)
        with pytest.raises(InputError):
            agent.record(bad)
        assert np.array_equal(agent.window.total(), before) and len(agent.window) == steps


@pytest.mark.parametrize("shape", ["logical", "physical"])
def test_record_refuses_a_step_that_would_wrap_the_int64_window(redis_url, cluster_id, tmp_path, shape):
    """Counts that fit int64 one by one but not summed (per logical expert, or into the window) are refused:
    the window never wraps to negative counts."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), window_steps=2)
        agent.start()
        L, E, P = tc.config.num_layers, tc.config.num_logical_experts, tc.config.num_physical_experts
        top = np.iinfo(np.int64).max
        if shape == "physical":  # every logical expert with a replica sums >= 2 slots of 2**62
            with pytest.raises(InputError, match="int64"):
                agent.record(np.full((L, P), 2**62, np.int64))
            assert len(agent.window) == 0 and not agent.window.total().any()
            return
        agent.record(np.full((L, E), top - 1, np.int64))
        with pytest.raises(InputError, match="int64"):
            agent.record(np.full((L, E), 2, np.int64))
        assert len(agent.window) == 1 and (agent.window.total() == top - 1).all()
        agent.record(np.ones((L, E), np.int64))  # fits exactly
        assert (agent.window.total() == top).all()
        agent.record(np.full((L, E), 5, np.int64))  # the step limit drops the big step first: fits
        assert len(agent.window) == 2 and (agent.window.total() == 6).all()


def test_window_keeps_last_steps_and_seconds_and_clears():
    w = ExpertLoadWindow(1, 2, steps=3)
    for i in range(5):
        w.add(np.array([[i, 1]], np.int64))
    assert w.total().tolist() == [[2 + 3 + 4, 3]] and len(w) == 3
    now = [0.0]
    t = ExpertLoadWindow(1, 2, steps=None, seconds=10, clock=lambda: now[0])
    for i in range(4):
        now[0] = i * 5.0
        t.add(np.array([[1, i]], np.int64))
    assert t.total().tolist() == [[3, 1 + 2 + 3]]  # the step at t=0 is older than 10 s at t=15
    t.clear()
    assert t.total().tolist() == [[0, 0]] and len(t) == 0
    with pytest.raises(InputError):
        ExpertLoadWindow(1, 2, steps=None, seconds=None)


@pytest.mark.parametrize("kw", [dict(max_pause_bytes=2**62 + 1), dict(max_pause_bytes=-1),
                                dict(max_pause_bytes=1.5), dict(layers_per_safe_point=4097),
                                dict(layers_per_safe_point=True)])
def test_an_agent_refuses_a_pause_budget_init_cluster_refuses(kw):
    """A rank agent's own pause budget obeys the cluster's rule (:func:`fdeplb.store.cluster_config.check_pause_budget`,
    the one ClusterConfig and init-cluster use), checked when the agent is built, before it touches the store."""
    from fdeplb.orchestration.agent import RankAgent
    from fdeplb.store import ClusterConfig

    name = next(iter(kw))
    with pytest.raises(InputError, match=name):
        RankAgent(None, 0, **kw)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=name):
        ClusterConfig(num_layers=2, num_logical_experts=4, num_physical_experts=4, ep_size=2, **kw)


def test_the_periodic_publication_refuses_a_fractional_window_as_a_round_does(redis_url, cluster_id, tmp_path):
    """The periodic publication (``publish_interval_s``) takes the round's checked path: a fractional window is
    refused with an alarm, not truncated into the store; a whole-numbered one is published."""
    import structlog.testing

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        windows = [np.full((3, 16), 2.5)]
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), publish_interval_s=3600,
                          load_source=lambda _round: windows[-1])
        agent.start()
        store = tc.store()
        with structlog.testing.capture_logs() as logs:
            agent.step()
        assert store.read_load(0) is None
        assert [e for e in logs if e["event"] == "load source failed" and "fractional" in e["error"]], logs
        windows.append(np.full((3, 16), 3.0))
        agent._next_publish = 0.0  # the next interval is due
        agent.step()
        assert store.read_load(0).expert_load.tolist() == [[3] * 16] * 3


def test_a_device_window_with_a_negative_step_is_not_published_and_the_next_one_is(redis_url, cluster_id, tmp_path):
    """Counts recorded as paddle tensors are checked when the window is published: a negative count fails that
    publication with record()'s message (an alarm, nothing in the store), the step is dropped, the next
    publication carries the good steps' window."""
    import paddle
    import structlog.testing

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), publish_interval_s=3600)
        agent.start()
        store = tc.store()
        agent.record(paddle.full([3, 16], 2, dtype="int32"))
        agent.record(paddle.full([3, 16], -1, dtype="int32"))
        with structlog.testing.capture_logs() as logs:
            agent.step()
        assert store.read_load(0) is None
        assert [e for e in logs if e["event"] == "load source failed" and "must be >= 0, found -1" in e["error"]]
        assert len(agent.window) == 1
        agent._next_publish = 0.0  # the next interval is due
        agent.step()
        assert store.read_load(0).expert_load.tolist() == [[2] * 16] * 3


def test_a_rounds_publication_refused_for_a_bad_device_step_is_retried_once_without_it(redis_url, cluster_id,
                                                                                         tmp_path):
    """QA MED 2: a round's collection whose device window was refused for a negative step (dropped then) publishes
    the rest at the next step instead of waiting out collecting_ms; a second refusal in the same round is final
    (no retry storm)."""
    import dataclasses

    import paddle

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = RankAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None)
        agent.start()
        store = tc.store()
        collecting = dataclasses.replace(store.read_cluster(), state=ClusterState.COLLECTING, round=1)
        agent.record(paddle.full([3, 16], 2, dtype="int32"))
        agent.record(paddle.full([3, 16], -1, dtype="int32"))
        agent._load_step(collecting)  # refused: the negative step is dropped
        assert store.load_round(0) is None and len(agent.window) == 1
        agent._load_step(collecting)
        agent._send()
        assert store.load_round(0) == 1 and store.read_load(0).expert_load.tolist() == [[2] * 16] * 3

        second = dataclasses.replace(collecting, round=2)
        for _ in range(2):  # refused, retried, refused again: no third try in round 2
            agent.record(paddle.full([3, 16], -1, dtype="int32"))
            agent._load_step(second)
        assert len(agent.window) == 1 and agent.window.refused_steps == 3
        agent._load_step(second)
        agent._send()
        assert store.load_round(0) == 1


def test_clear_stat_request_empties_every_window(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agents = [EmbeddedAgent(tc.store(), r, backend_factory=NumpyWeights.factory()).start()
                  for r in range(tc.config.ep_size)]
        try:
            for a in agents:
                a.record(np.ones((3, 16), np.int64))
            store = tc.store()
            n = store.request_clear_stat("test")
            wait_for(lambda: all(store.read_rank(r).clear_stat == n for r in range(4)), 30, store, "clear_stat")
            assert all(len(a.window) == 0 for a in agents)
        finally:
            for a in agents:
                a.close()


def test_every_rank_switches_at_the_same_step_and_only_at_safe_points(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agents = []
        for r in range(tc.config.ep_size):
            agents.append(EmbeddedAgent(tc.store(), r, backend_factory=Instrumented.factory(), verify_all=True,
                                        block_ms=500 if r == 3 else 50, publish_interval_s=None).start())
        tc.start_coordinator()
        store = tc.store()
        try:
            with Workers(agents, tc.loads, slow=3) as workers:
                wait_for(lambda: all(store.read_rank(r).step > 0 for r in range(4)), 30, store, "step reports")
                store.request_round("test")
                rec = wait_for(lambda: round_done(store, 1), 60, store, "round 1")
                assert rec.reason == "" and rec.switch_step > 0
                ranks = [store.read_rank(r) for r in range(4)]
                assert [x.applied_step for x in ranks] == [rec.switch_step] * 4, ranks
                assert [x.late_steps for x in ranks] == [0] * 4
                store.request_weights("clear", "test")
                wait_for(lambda: all(store.read_weights(r).state is WeightState.CLEARED for r in range(4)), 60,
                         store, "cleared")
                clear_step = store.read_cluster().weights_switch_step
                assert [store.read_rank(r).applied_step for r in range(4)] == [clear_step] * 4
                store.request_weights("update", "test")
                wait_for(lambda: all(store.read_weights(r).state is WeightState.NORMAL for r in range(4)), 60,
                         store, "updated")
                update_step = store.read_cluster().weights_switch_step
                assert [store.read_rank(r).applied_step for r in range(4)] == [update_step] * 4
            steps = min(len(p) for p in workers.placements)
            for s in range(steps):  # at every step every rank served the same placement (or none)
                assert len({workers.placements[r][s] for r in range(4)}) == 1, f"ranks disagree at step {s + 1}"
            changes = [c for a in agents for c in a.backend.changes]
            assert {c[0] for c in changes} == {"swap", "clear", "reload_in"}
            assert all(inside and thread.startswith("worker") for _, inside, thread in changes), changes
        finally:
            for a in agents:
                a.close()


class _LateAgent(EmbeddedAgent):
    """An agent whose background thread, once staged (rank LOADED) or with a weight request pending, does not look
    at the commit or the request until ``gate`` is set: the rank that learns of a change late (a loaded host, a
    GIL-starved thread)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.held = threading.Event()

    def _hold(self):
        while not self.gate.is_set() and not self.stop_event.is_set():
            self.held.set()
            self.gate.wait(0.05)

    def step(self, *args, **kwargs):
        if self.rank.read().state is RankState.LOADED:  # staged: the commit comes (only this thread moves it)
            self._hold()
        return super().step(*args, **kwargs)

    def _weights_step(self, cluster, w):
        if cluster.weights_request > w.request:
            self._hold()
        return super()._weights_step(cluster, w)


def test_a_rank_that_learns_late_switches_at_the_same_step_as_the_others(redis_url, cluster_id, tmp_path):
    """The race the switch step must survive: rank 3's background thread learns of the commit (and of each weight
    request) only after the other ranks are armed and the lockstep workers ran 100 more steps, and rank 3's
    worker is the slow one. The switch step is fixed only once rank 3 is armed, from the current step counters,
    so every rank still switches at one step, with no late switch and no step where the placements disagree."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agents = [EmbeddedAgent(tc.store(), r, backend_factory=Instrumented.factory(), verify_all=True,
                                publish_interval_s=None).start() for r in range(3)]
        late = _LateAgent(tc.store(), 3, backend_factory=Instrumented.factory(), verify_all=True,
                          publish_interval_s=None).start()
        agents.append(late)
        tc.start_coordinator()
        store = tc.store()

        def held_while_others_armed(key: str) -> int:
            """Wait until rank 3 is held and ranks 0-2 are armed for ``key``, let 100 steps pass; the step then."""
            wait_for(lambda: late.held.is_set() and all(store.read_rank(r).armed == key for r in range(3)), 60,
                     store, f"ranks 0-2 armed for {key}, rank 3 held")
            start = agents[0].steps
            wait_for(lambda: agents[0].steps >= start + 100, 60, None, "100 steps with rank 3 not armed")
            assert store.read_rank(3).armed != key and late.steps >= start + 99  # lockstep: rank 3 ran too
            released_at = agents[0].steps
            late.held.clear()
            late.gate.set()
            return released_at

        def switched_together(what: str, switch_step: int, released_at: int) -> None:
            assert switch_step > released_at, f"{what}: switch step {switch_step} fixed before rank 3 was armed"
            ranks = [store.read_rank(r) for r in range(4)]
            assert [x.applied_step for x in ranks] == [switch_step] * 4, (what, ranks)
            assert [x.late_steps for x in ranks] == [0] * 4, (what, ranks)

        try:
            with Workers(agents, tc.loads, slow=3) as workers:
                wait_for(lambda: all(a.steps > 0 for a in agents), 30, None, "workers stepping")
                store.request_round("test")
                rec = wait_for(lambda: store.read_cluster().state is ClusterState.SWAPPING and
                               store.read_cluster(), 60, store, "commit")
                released = held_while_others_armed(f"swap:1:{rec.plan_id}")
                rec = wait_for(lambda: round_done(store, 1), 60, store, "round 1")
                switched_together("swap", rec.switch_step, released)
                for action, state in (("clear", WeightState.CLEARED), ("update", WeightState.NORMAL)):
                    late.gate.clear()
                    n = store.request_weights(action, "test")
                    released = held_while_others_armed(f"weights:{n}")
                    wait_for(lambda: all(store.read_weights(r).state is state and store.read_weights(r).request == n
                                         for r in range(4)), 60, store, action)
                    switched_together(action, store.read_cluster().weights_switch_step, released)
            steps = min(len(p) for p in workers.placements)
            for s in range(steps):  # at every step every rank served the same placement (or none)
                assert len({workers.placements[r][s] for r in range(4)}) == 1, f"ranks disagree at step {s + 1}"
            assert all(a.late_switches == 0 for a in agents)
            assert all(inside for a in agents for _, inside, _ in a.backend.changes)
        finally:
            for a in agents:
                a.close()


def test_a_rank_past_the_switch_step_applies_at_once_and_raises_the_alarm(redis_url, cluster_id, tmp_path):
    """The explicit path for a rank that finds itself past the switch step (here: a request written with a switch
    step already in the past, as a rank that could not reach Redis at its armed safe points would find it): it
    applies at its next safe point, records late_steps and raises an audited alarm."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agents = [EmbeddedAgent(tc.store(), r, backend_factory=Instrumented.factory(), publish_interval_s=None)
                  .start() for r in range(4)]
        store = tc.store()
        try:
            with Workers(agents, tc.loads):
                wait_for(lambda: all(a.steps >= 10 for a in agents), 30, None, "10 steps")
                RawRedis(redis_url, cluster_id).r.hset(RawRedis(redis_url, cluster_id).keys.rearrange, mapping={
                    "weights_request": 1, "weights_action": "clear", "weights_switch_step": 3})
                wait_for(lambda: all(store.read_weights(r).state is WeightState.CLEARED for r in range(4)), 60,
                         store, "cleared")
            ranks = [store.read_rank(r) for r in range(4)]
            assert all(x.late_steps == x.applied_step - 3 > 0 for x in ranks), ranks
            alarms = [a for a in store.iter_audit() if a["trigger"] == "alarm"]
            assert len(alarms) == 4 and all("past the switch step 3" in a["reason"] for a in alarms)
            assert all(a.late_switches == 1 for a in agents)
        finally:
            for a in agents:
                a.close()


def test_arm_switch_fixes_the_step_once_every_rank_is_armed(redis_url, cluster_id, tmp_path):
    """Store.arm_switch (lua/switch.lua) on its own: waiting until every rank is armed for the same change, then
    fixed at the largest armed step + margin, then the same for everyone; gone once the change is not current."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        n = store.request_weights("clear", "test")

        def arm(rank, step, margin=2, armed=f"weights:{n}"):
            return store.arm_switch(rank, armed, step, "weights_switch_step", {"weights_request": n}, margin)[:2]

        assert arm(0, 7) == (0, "waiting")
        assert arm(1, 40) == (0, "waiting")
        assert arm(2, 50, armed="weights:0") == (0, "waiting")  # armed for another change: does not count
        assert arm(2, 9) == (0, "waiting")
        assert arm(3, 12, margin=3) == (43, "fixed")  # max(7, 40, 9, 12) + 3
        assert store.read_cluster().weights_switch_step == 43
        assert arm(0, 8) == (43, "set")
        assert [store.read_rank(r).armed_step for r in range(4)] == [8, 40, 9, 12]
        assert store.request_weights("update", "test") == n + 1  # supersedes; resets the switch step
        assert store.read_cluster().weights_switch_step == 0
        assert arm(0, 9) == (0, "gone")
        assert store.read_cluster().weights_switch_step == 0
        with pytest.raises(InputError):
            arm(0, 9, margin=0)
        with pytest.raises(InputError):
            store.arm_switch(0, "x", 1, "no_such_field", {})
        RawRedis(redis_url, cluster_id).force(RawRedis(redis_url, cluster_id).keys.weights(2),
                                              WeightState.CLEARING.value)
        with pytest.raises(StateError, match="ranks \\[2\\]"):  # one request at a time once a rank started it
            store.request_weights("update", "test")
        assert store.read_cluster().weights_request == n + 1


def test_switch_lua_header_matches_its_python_slots():
    from fdeplb.store.scripts import SWITCH_ARGV, SWITCH_KEYS, SWITCH_STATUSES, script_text

    assert header_slots("switch", "KEYS") == list(SWITCH_KEYS)
    assert header_slots("switch", "ARGV") == list(SWITCH_ARGV)
    assert all(f"'{status}'" in script_text("switch") for status in SWITCH_STATUSES)


# ---- the weight-status machine -----------------------------------------------------------------------------------
def test_vllm_55228_update_after_rebalance_reloads_the_current_placement(redis_url, cluster_id, tmp_path):
    """Placement [0,1,2,3] -> [0,2,1,3], then clear and update: every slot's checksum matches the expert its
    current phy2log names (reloading the initial placement would put experts 1 and 2 in each other's slots)."""
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=1, num_experts=4, num_redundant=0, ep_size=2,
                        backend="paddle") as tc:
        tc.loads[...] = np.array([[[5, 5, 1, 1]], [[5, 5, 1, 1]]])
        tc.start_agents()
        tc.start_coordinator(planner=lambda load, old, cfg: np.array([[0, 2, 1, 3]]))
        store = tc.store()
        store.request_round("test")
        wait_for(lambda: round_done(store, 1), 60, store, "round 1")
        assert store.current_placement().phy2log.tolist() == [[0, 2, 1, 3]]
        store.request_weights("clear", "test")
        wait_for(lambda: all(store.read_weights(r).state is WeightState.CLEARED for r in range(2)), 60, store,
                 "cleared")
        for a in tc.agents:  # memory returned: no tensor holds storage
            assert a.backend.cleared
            assert not any(t._is_initialized() for layers in a.backend.live.tensors.values() for t in layers)
        store.request_weights("update", "test")
        wait_for(lambda: all(store.read_weights(r).state is WeightState.NORMAL for r in range(2)), 60, store,
                 "updated")
        placement = store.current_placement()
        for a in tc.agents:
            assert a.backend.phy2log.tolist() == [[0, 2, 1, 3]]
            verified, total = a.backend.verify()  # CRC of every slot against its phy2log expert's checkpoint
            assert verified == total == 2
            assert store.read_weights(a.ep_rank).plan_id == placement.plan_id
        reader = tc.agents[0].backend.reader
        slot1 = tc.agents[0].backend.live.slot(0, 1)
        from fdeplb.weights.staging import expert_checksum

        assert expert_checksum(slot1) == expert_checksum(reader.read_expert(0, 2))  # slot 1 holds expert 2


def test_failed_update_is_recorded_and_not_normal(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents(backend_factory=NumpyWeights.factory())
        tc.agents[1].stop_event.set()
        tc.threads[1].join(10)
        tc.start_agent(1, backend_factory=FailingReload.factory())
        tc.start_coordinator()
        store = tc.store()
        store.request_weights("update", "test")
        wait_for(lambda: store.read_weights(1).state is WeightState.CLEARED, 30, store, "failed update")
        w = store.read_weights(1)
        assert "update failed" in w.reason and "missing" in w.reason
        wait_for(lambda: all(store.read_weights(r).state is WeightState.NORMAL for r in (0, 2, 3)), 30, store,
                 "the other ranks updated")
        assert [a["trigger"] for a in store.iter_audit() if a["key"] == "weights:1"] == ["update", "update_failed"]
        store.request_round("test")  # no round while a rank is not NORMAL: the start waits
        assert store.read_cluster().state is ClusterState.FREE


# ---- liveness and the periodic trigger ---------------------------------------------------------------------------
def test_stale_rank_refuses_a_start_with_the_reason(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents(heartbeat_ttl_ms=2_000)
        store = tc.store()
        tc.agents[2].stop_event.set()
        tc.threads[2].join(10)
        wait_for(lambda: 2 in store.stale_ranks(), 30, store, "rank 2 stale")
        tc.start_coordinator()
        store.request_round("test")
        note = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "start_refused"], 30, store,
                        "refusal")[0]
        assert "stale ranks 2" in note["reason"] and note["from"] == note["to"] == "FREE"
        rec = store.read_cluster()
        assert rec.state is ClusterState.FREE and rec.round == 0 and "stale ranks 2" in rec.reason
        tc.start_agent(2, heartbeat_ttl_ms=2_000)  # the rank comes back: the round starts and completes
        wait_for(lambda: round_done(store, 1), 60, store, "round 1")
        from fdeplb.rounds import reasons

        (start,) = [a for a in store.iter_audit() if a["trigger"] == "start"]
        assert start["detail"]  # structured: the replay reads the heartbeats from the detail, not the text
        beats = reasons.heartbeats(start)  # the start shows rank 2 fresh again, for a replay to check
        assert beats is not None and set(beats) == {0, 1, 2, 3} and beats[2][0] <= beats[2][1] == 2_000


def test_periodic_trigger_skips_a_balanced_load_and_rearranges_a_skewed_one(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, num_redundant=0) as tc:
        skewed = tc.loads.copy()
        tc.loads[...] = 100  # every expert equally loaded: balancedness 1.0
        tc.start_agents(publish_interval_s=0.2)
        store = tc.store()
        wait_for(lambda: all(store.read_load(r) is not None for r in range(4)), 30, store, "windows")
        tc.start_coordinator(interval_s=0.5, min_balancedness=0.95)
        skip = wait_for(lambda: [a for a in store.iter_audit() if a["trigger"] == "skip"], 30, store, "skip")[0]
        assert skip["reason"].startswith("skipped: balancedness 1.0000 >= threshold 0.95")
        assert store.read_cluster().round == 0 and store.read_cluster().reason.startswith("skipped:")
        tc.loads[...] = skewed
        rec = wait_for(lambda: round_done(store, 1), 60, store, "a periodic round")
        assert rec.requested_reason.startswith("interval")
        assert store.current_placement().plan_id == rec.plan_id != ""


def test_a_pending_change_is_applied_once_when_two_threads_call_at_safe_point(redis_url, cluster_id, tmp_path):
    """A worker with two threads reaching at_safe_point together (an overlap scheduler, a hostile integrator): the
    pending change of the live experts runs exactly once, and the second caller returns only once it is applied
    (it never steps on half-changed tensors)."""
    from fdeplb.orchestration.safe_points import SafePointOp

    class _NotingLock:
        def __init__(self):
            self.lock, self.waiting = threading.Lock(), threading.Event()

        def __enter__(self):
            self.waiting.set()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = EmbeddedAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None)
        RankAgent.start(agent)  # no background loop: the op below is the only change pending
        agent.switch._apply_lock = noting = _NotingLock()
        inside, release, runs, returned = threading.Event(), threading.Event(), [], {}

        def change():
            runs.append(threading.current_thread().name)
            inside.set()
            assert release.wait(30)

        def call(name):
            returned[name] = (agent.at_safe_point(), list(runs))

        agent.switch.op = SafePointOp(("test",), 0, None, change)
        first = threading.Thread(target=call, args=("first",), name="first")
        first.start()
        assert inside.wait(30)
        noting.waiting.clear()
        second = threading.Thread(target=call, args=("second",), name="second")
        second.start()
        wait_for(lambda: len(runs) > 1 or noting.waiting.is_set(), 30, None, "second caller at the safe point")
        release.set()
        first.join(30)
        second.join(30)
        assert runs == ["first"], runs
        assert returned["first"][0] is True and returned["second"] == (False, ["first"]) and agent.switch.op.done.is_set()
        assert agent.at_safe_point() is False and runs == ["first"]
        agent.close()


def test_a_weight_request_other_ranks_carried_out_at_once_is_not_cancelled_but_alarmed_naming_the_rank(
        redis_url, cluster_id, tmp_path):
    """Ranks 0..2 are threaded agents (no safe points: they clear at once); rank 3's worker never reaches a safe
    point. Past ``deadlines.weights_ms`` the request cannot be cancelled (ranks 0..2 applied it: cancelling would
    mark them NORMAL with freed weights), so the coordinator raises one audited alarm naming rank 3, as before the
    cancel existed. (A request no rank applied is cancelled: tests/orchestration/test_weights_cancel.py.)"""
    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000,
                          weights_ms=300)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        tc.start_agents(range(3))
        agent = EmbeddedAgent(tc.store(), 3, backend_factory=NumpyWeights.factory(), publish_interval_s=None,
                              block_ms=50).start()
        stop = threading.Event()

        def worker():  # a serving loop: one safe point per step
            while not stop.is_set():
                agent.at_safe_point()
                stop.wait(0.01)

        t = threading.Thread(target=worker, daemon=True)
        try:
            tc.start_coordinator()
            store = tc.store()
            n = store.request_weights("clear", "test")

            def weights_alarms():
                return [a for a in store.audit() if a["trigger"] == "alarm" and f"weight clear {n}" in a["reason"]]

            alarms = wait_for(weights_alarms, 30, store, "the weights alarm")
            assert "ranks [3] never reached a safe point" in alarms[0]["reason"], alarms[0]["reason"]
            assert "not cancelled" in alarms[0]["reason"] and store.read_cluster().weights_cancelled != n
            assert store.read_weights(3).state is WeightState.CLEARING
            assert [store.read_weights(r).state for r in range(3)] == [WeightState.CLEARED] * 3
            assert len(weights_alarms()) == 1  # raised once per request
        finally:
            stop.set()
            if t.is_alive():
                t.join(10)
            agent.close()
