"""Nothing waits forever on one rank: a weight clear / update whose switch step is not
fixed within ``deadlines.weights_ms`` is cancelled (every rank back to its previous weight state, audited, a late arm
refused), and any exception while staging marks the rank LOAD_FAILED with its cause. Real Redis, thread clusters."""

from __future__ import annotations

import threading

import pytest

from fdeplb.errors import GuardError
from fdeplb.machines.tables import WEIGHTS, ClusterState, RankState, WeightState
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.rounds import reasons
from fdeplb.store import Deadlines, Store
from fdeplb.store.scripts import WEIGHTS_CANCEL_ARGV, WEIGHTS_CANCEL_KEYS, WEIGHTS_CANCEL_REPLIES, script_text
from fdeplb.testing import NumpyWeights
from tests.helpers import RawRedis, header_slots, thread_cluster, wait_for
from tests.orchestration.helpers import CANCEL_DEADLINES, embedded

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in most tests


def _cancelled(store, n):
    return store.read_cluster().weights_cancelled == n and all(
        store.read_weights(r).state not in (WeightState.CLEARING, WeightState.UPDATING)
        for r in range(store.ep_size()))


def _notes(store, n):
    return [a for a in store.audit() if a["trigger"] == "weights_cancelled" and f" {n} cancelled" in a["reason"]]


def test_a_clear_rank_3_never_arms_for_is_cancelled_every_rank_back_to_normal_and_a_second_request_works(
        redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=CANCEL_DEADLINES) as tc:
        with embedded(tc, serving=[0, 1, 2]) as (agents, start):
            tc.start_coordinator()
            store = tc.store()
            n = store.request_weights("clear", "test")
            wait_for(lambda: _cancelled(store, n), 30, store, "the clear cancelled")
            rec = store.read_cluster()
            assert rec.weights_switch_step == 0 and rec.held_by == [3] and "ranks [3]" in rec.weights_cancel_reason
            assert [store.read_weights(r).state for r in range(4)] == [WeightState.NORMAL] * 4
            assert all(a.serving for a in agents)  # nobody freed its weights
            notes = _notes(store, n)
            assert len(notes) == 1 and reasons.held_back(notes[0]) == [3], notes
            assert reasons.detail_of(notes[0]) == {"ranks": [3], "request": n, "action": "clear", "weights_ms": 300}
            cancels = [a for a in store.audit() if a["machine"] == WEIGHTS.name and a["trigger"] == "cancel"]
            assert sorted(a["key"] for a in cancels) == [f"weights:{r}" for r in range(4)]
            assert {(a["from"], a["to"]) for a in cancels} == {(WeightState.CLEARING, WeightState.NORMAL)}
            assert not [a for a in store.audit() if a["trigger"] == "alarm"]  # cancelled, not alarmed
            # a rank's late arm for the withdrawn request is refused, and writes nothing
            assert store.arm_switch(3, f"weights:{n}", 10_000, "weights_switch_step", {"weights_request": n},
                                    withdrawn={"weights_cancelled": n})[:2] == (0, "cancelled")
            assert store.read_rank(3).armed != f"weights:{n}"
            # with every worker at its safe points, the next request is carried out everywhere
            start(3)
            m = store.request_weights("clear", "test again")
            wait_for(lambda: all(store.read_weights(r).state is WeightState.CLEARED and
                                 store.read_weights(r).request == m for r in range(4)), 30, store, "cleared")
            assert store.read_cluster().weights_switch_step > 0 and not any(a.serving for a in agents)


def test_an_update_from_cleared_that_is_cancelled_goes_back_to_cleared(redis_url, cluster_id, tmp_path):
    """The cancel returns to the state the update came from: CLEARED (cancel_to_cleared), never NORMAL with the
    weights not loaded."""
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=CANCEL_DEADLINES) as tc:
        with embedded(tc, serving=[0, 1, 2, 3]) as (agents, _start):
            tc.start_coordinator()
            store = tc.store()
            n = store.request_weights("clear", "test")
            wait_for(lambda: all(store.read_weights(r).request == n and store.read_weights(r).state
                                 is WeightState.CLEARED for r in range(4)), 30, store, "cleared")
        with embedded(tc, serving=[0, 1]) as (agents, _start):  # ranks 2, 3: workers hung
            m = store.request_weights("update", "test")
            wait_for(lambda: _cancelled(store, m), 30, store, "the update cancelled")
            assert [store.read_weights(r).state for r in range(4)] == [WeightState.CLEARED] * 4
            assert store.read_cluster().held_by == [2, 3] and reasons.held_back(_notes(store, m)[0]) == [2, 3]
            back = [a for a in store.audit() if a["machine"] == WEIGHTS.name and a["trigger"] == "cancel_to_cleared"]
            assert sorted(a["key"] for a in back) == [f"weights:{r}" for r in range(4)]
            assert {(a["from"], a["to"]) for a in back} == {(WeightState.UPDATING, WeightState.CLEARED)}


# ---- the race: a cancel and the last arm, from two clients ----------------------------------------------------------
def _armed_but_one(raw: RawRedis, store: Store, n: int) -> None:
    """Weight request ``n`` with every rank CLEARING for it (at its switch step), ranks 0..2 armed, rank 3 not."""
    raw.r.hset(raw.keys.rearrange, mapping={"weights_request": str(n), "weights_action": "clear",
                                            "weights_switch_step": "0"})
    for r in range(4):
        raw.force(raw.keys.weights(r), WeightState.CLEARING, version=n, request=str(n), prior=WeightState.NORMAL.value,
                  at_switch="1")
        raw.r.hset(raw.keys.rank(r), mapping={"armed": "", "armed_step": "0"})
    for r in range(3):
        assert _arm(store, r, n, 100 + r)[1] == "waiting"


def _arm(store, r, n, step):
    return store.arm_switch(r, f"weights:{n}", step, "weights_switch_step", {"weights_request": n},
                            withdrawn={"weights_cancelled": n})[:2]


def test_a_cancel_racing_the_last_arm_exactly_one_wins(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw, store = RawRedis(redis_url, cluster_id), tc.store()
        arming, cancelling = tc.store(), tc.store()  # two clients, two connections
        outcomes = set()
        for n in range(1, 31):
            _armed_but_one(raw, store, n)
            barrier = threading.Barrier(2)
            got = {}

            def arm():
                barrier.wait()
                got["arm"] = _arm(arming, 3, n, 200)

            def cancel():
                barrier.wait()
                got["cancel"] = cancelling.cancel_weights(n, held_by=[3], reason="test", actor="test")

            threads = [threading.Thread(target=f) for f in (arm, cancel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            rec = store.read_cluster()
            (switch, arm_status), (cancel_status, _) = got["arm"], got["cancel"]
            if arm_status == "fixed":  # the arm won: the cancel saw the switch step and wrote nothing
                assert cancel_status == "switched" and rec.weights_cancelled != n and rec.weights_switch_step == switch
            else:  # the cancel won: the arm was refused and fixed nothing
                assert (arm_status, cancel_status) == ("cancelled", "cancelled"), got
                assert rec.weights_cancelled == n and rec.weights_switch_step == 0
            outcomes.add(arm_status)
        assert outcomes <= {"fixed", "cancelled"} and outcomes  # (which one wins is up to the scheduler)


def test_a_cancel_is_refused_with_nothing_written_once_the_switch_step_is_fixed_or_a_rank_applied_it(
        redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw, store = RawRedis(redis_url, cluster_id), tc.store()
        _armed_but_one(raw, store, 1)
        assert _arm(store, 3, 1, 50)[1] == "fixed"
        before = raw.snapshot()
        assert store.cancel_weights(1, held_by=[3], reason="late", actor="test")[0] == "switched"
        assert raw.snapshot() == before
        # a threaded agent (no switch step) may be applying it right now; another rank carried it out already
        _armed_but_one(raw, store, 2)
        raw.r.hset(raw.keys.weights(1), "at_switch", "0")
        before = raw.snapshot()
        assert store.cancel_weights(2, held_by=[3], reason="x", actor="test")[0] == "applied"
        assert store.cancel_weights(1, held_by=[3], reason="x", actor="test")[0] == "gone"  # superseded
        assert raw.snapshot() == before
        raw.force(raw.keys.weights(1), WeightState.CLEARED, version=9, at_switch="1")
        before = raw.snapshot()
        assert store.cancel_weights(2, held_by=[3], reason="x", actor="test")[0] == "applied"
        assert raw.snapshot() == before
        raw.force(raw.keys.weights(1), WeightState.CLEARING, version=2)
        assert store.cancel_weights(2, held_by=[3], reason="x", actor="test")[0] == "cancelled"
        assert store.cancel_weights(2, held_by=[3], reason="x", actor="test")[0] == "already"


def test_the_cancel_transitions_are_refused_unless_the_request_was_withdrawn_from_that_state(
        redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw, store = RawRedis(redis_url, cluster_id), tc.store()
        _armed_but_one(raw, store, 1)
        h = RecordHandle(store, WEIGHTS, 0, actor="test")
        before = raw.snapshot()
        with pytest.raises(GuardError, match="was not cancelled"):
            h.fire("cancel")
        assert raw.snapshot() == before
        assert store.cancel_weights(1, held_by=[3], reason="x", actor="test")[0] == "cancelled"
        raw.force(raw.keys.weights(0), WeightState.UPDATING, version=1)  # prior NORMAL
        with pytest.raises(GuardError, match="came from NORMAL, not CLEARED"):
            h.fire("cancel_to_cleared")
        assert h.fire("cancel").state is WeightState.NORMAL


def test_weights_cancel_lua_header_matches_its_python_slots():
    assert header_slots("weights_cancel", "KEYS") == list(WEIGHTS_CANCEL_KEYS)
    assert header_slots("weights_cancel", "ARGV") == list(WEIGHTS_CANCEL_ARGV)
    assert all(f"'{reply}'" in script_text("weights_cancel") for reply in WEIGHTS_CANCEL_REPLIES)


# ---- any exception while staging ---------------------------------------------------------------------------------
class FailingStage(NumpyWeights):
    """A rank whose staging raises what a paddle out-of-memory or a bug would: not a WeightError."""

    error: BaseException = RuntimeError("CUDA out of memory: tried to allocate 2.00 GiB")

    def stage(self, new_phy2log, budget_bytes=None):
        raise self.error


class FailingStageMemory(FailingStage):
    error = MemoryError("host staging buffer")


@pytest.mark.parametrize("backend,cause", [(FailingStage, "RuntimeError: CUDA out of memory"),
                                           (FailingStageMemory, "MemoryError: host staging buffer")])
def test_a_staging_exception_marks_the_rank_load_failed_and_the_abort_names_it(
        redis_url, cluster_id, tmp_path, backend, cause):
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=Deadlines(
            collecting_ms=20_000, loading_ms=60_000, commit_ms=20_000, swapping_ms=20_000)) as tc:
        for r in range(tc.config.ep_size):
            tc.start_agent(r, backend_factory=(backend if r == 1 else NumpyWeights).factory())
        tc.start_coordinator()
        store = tc.store()
        store.request_round("test")
        rec = wait_for(lambda: (r := store.read_cluster()).state is ClusterState.FREE and r.round == 1 and r, 30,
                       store, "round 1 aborted")
        assert f"rank 1 failed to load: staging failed: {cause}" in rec.reason, rec.reason
        fails = [a for a in store.audit() if a["key"] == "rank:1" and a["trigger"] == "fail"]
        assert len(fails) == 1 and cause in fails[0]["reason"]
        assert (fails[0]["from"], fails[0]["to"]) == (RankState.LOADING, RankState.LOAD_FAILED)
        # one failure, not an alarm every second until the loading deadline
        assert not [a for a in store.audit() if a["trigger"] == "alarm"]
        assert store.current_placement().plan_id == ""  # the old placement stays
