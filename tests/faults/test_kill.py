"""Kill tests with real processes: SIGKILL the coordinator in every state, kill ranks while LOADING and
SWAPPING, and SIGSTOP a coordinator past its lease. The cluster must converge every time.

One cluster (4 worker processes, Qwen2-57B dumps alternating per round) serves the whole module; every test
leaves it FREE with every rank IDLE and every worker alive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from contextlib import contextmanager

import pytest

from fdeplb.machines.tables import CLUSTER
from fdeplb.replay.start_state import NOT_TRANSITIONS
from fdeplb.store import ClusterConfig, Deadlines, Store
from tests.faults.helpers import (last_cluster_transition, settled, skip_round_that_would_be_gated, spawn_coordinator,
                                  stop_process, wait_event)
from tests.helpers import real_traces_28x64, wait_for

pytestmark = pytest.mark.slow

EP = 4
#: the workers hold paddle tensors where paddle is installed, numpy arrays (fdeplb.testing) elsewhere
BACKEND = "paddle" if importlib.util.find_spec("paddle") else "numpy"


@pytest.fixture(scope="module")
def proc_cluster(redis_url, real_data, tmp_path_factory):
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id

    workdir = tmp_path_factory.mktemp("kill")
    traces = real_traces_28x64(real_data, workdir)
    checkpoint = {}
    if BACKEND == "paddle":
        from fdeplb.weights import write_synthetic_checkpoint

        ckpt = write_synthetic_checkpoint(workdir / "ckpt", 28, 64, hidden=8, intermediate=4)
        checkpoint = {"path": str(ckpt), "preset": "ernie"}
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=EP,
                           checkpoint=checkpoint,
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=6_000, commit_ms=30_000,
                                               swapping_ms=30_000))
    store = Store(redis_url, new_cluster_id("kill"))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=config, trace=traces, workdir=workdir,
                           backend=BACKEND)
    cluster.init(initial_placement(28, 64, 72).phy2log)
    cluster.start_ranks()
    cluster.wait_ready(timeout_s=120)
    yield cluster
    cluster.stop()
    store.delete_cluster()


def check_converged(store: Store) -> None:
    """Every rank holds the cluster's current placement, verified; audit versions per record have no gaps."""
    plan_id = store.current_placement().plan_id
    for r in range(EP):
        rec = store.read_rank(r)
        assert rec.live_plan_id == plan_id, (r, rec)
        if plan_id:
            assert rec.slots_verified == rec.slots_total == 28 * 72 // EP
    versions: dict[str, list[int]] = {}
    for a in store.iter_audit():
        if a["trigger"] not in NOT_TRANSITIONS:  # notes (alarms, refusals, ...) carry the version they saw
            versions.setdefault(a["key"], []).append(int(a["version"]))
    for key, v in versions.items():
        assert v == list(range(1, len(v) + 1)), (key, v)


@pytest.mark.parametrize("state", CLUSTER.states)
def test_coordinator_sigkilled_in_each_state(proc_cluster, state):
    store = proc_cluster.store
    round_ = store.read_cluster().round + 1
    cursor = store.cursor()
    victim = spawn_coordinator(proc_cluster, f"A-{state}", failpoints=f"coordinator.hang={state}")
    successor = None
    try:
        store.request_round(reason=f"kill in {state}")
        wait_event(store, cursor, kind="failpoint", name="coordinator.hang", state=state, holder=f"A-{state}")
        stop_process(victim, signal.SIGKILL)
        successor = spawn_coordinator(proc_cluster, f"B-{state}")
        wait_for(settled(store, round_), 90, store, f"round {round_} after a kill in {state}")
    finally:
        stop_process(victim, signal.SIGKILL)
        if successor is not None:
            stop_process(successor)
    last = last_cluster_transition(store)
    assert (last["from"], last["to"], last["trigger"], last["round"]) == ("DONE", "FREE", "release", str(round_))
    check_converged(store)


def _restart_rank(cluster, ep_rank: int, failpoints: str = "") -> None:
    cursor = cluster.store.cursor()
    cluster.kill_rank(ep_rank, signal.SIGTERM)
    cluster.start_rank(ep_rank, env={"FDEPLB_FAILPOINTS": failpoints})
    cluster.wait_ready([ep_rank], timeout_s=120, after=cursor)


@contextmanager
def rank_killed_in(cluster, ep_rank: int, state: str):
    """Run a round (under a fresh coordinator) in which rank ``ep_rank`` is SIGKILLed on reaching ``state``;
    yields the round number once the rank is dead. The coordinator is stopped on exit."""
    store = cluster.store
    _restart_rank(cluster, ep_rank, f"rank.hang={state}")
    coordinator = spawn_coordinator(cluster, f"C-{state.lower()}")
    try:
        skip_round_that_would_be_gated(store)
        round_ = store.read_cluster().round + 1
        cursor = store.cursor()
        store.request_round(reason=f"kill rank {ep_rank} while {state}")
        wait_event(store, cursor, kind="failpoint", name="rank.hang", rank=ep_rank)
        cluster.kill_rank(ep_rank, signal.SIGKILL)
        yield round_
    finally:
        stop_process(coordinator)


def test_rank_killed_while_loading_aborts_the_round(proc_cluster):
    store = proc_cluster.store
    before = store.current_placement()
    with rank_killed_in(proc_cluster, 2, "LOADING") as round_:
        wait_for(lambda: (r := store.read_cluster()).state == "FREE" and
                 r.round >= round_, 60, store, "the aborted round")
        last = last_cluster_transition(store)
        assert (last["from"], last["trigger"]) == ("LOADING", "abort")
        assert "loading deadline passed: ranks [" in last["reason"]
        assert 2 in json.loads(last["reason"].split("ranks ", 1)[1].split(" not")[0])  # others may be slow too
        after = store.current_placement()
        assert after.plan_id == before.plan_id and (after.phy2log == before.phy2log).all()
        # the restarted rank finds its dead round and drops it
        proc_cluster.start_rank(2)
        wait_for(settled(store, round_), 90, store, "rank 2 back to IDLE")
        check_converged(store)


def test_rank_killed_while_swapping_restarts_and_completes(proc_cluster):
    store = proc_cluster.store
    with rank_killed_in(proc_cluster, 1, "SWAPPING") as round_:
        assert store.read_cluster().state == "SWAPPING"  # past the commit point
        proc_cluster.start_rank(1)  # a restarted rank loads the cluster's current placement
        wait_for(settled(store, round_), 90, store, "the round to complete after the restart")
        last = last_cluster_transition(store)
        assert (last["from"], last["to"]) == ("DONE", "FREE")
        check_converged(store)


def test_deposed_coordinator_commits_nothing(proc_cluster):
    """A stops itself (SIGSTOP) right before committing in LOADING; its lease lapses; B finishes the round;
    A is continued (SIGCONT) and its commit is refused by the fence."""
    store = proc_cluster.store
    helper = spawn_coordinator(proc_cluster, "helper")
    try:
        skip_round_that_would_be_gated(store)
    finally:
        stop_process(helper)
    round_ = store.read_cluster().round + 1
    cursor = store.cursor()
    a = spawn_coordinator(proc_cluster, "A-stopped", failpoints="coordinator.stop=LOADING")
    b = None
    try:
        store.request_round(reason="deposed coordinator")
        wait_event(store, cursor, kind="failpoint", name="coordinator.stop", holder="A-stopped")
        wait_for(lambda: store.lease_info().holder is None, 30, what="A's lease to lapse")
        stopped_at = store.last_audit_id()
        b = spawn_coordinator(proc_cluster, "B-leader")
        wait_for(settled(store, round_), 90, store, "B to finish the round")
        os.killpg(a.pid, signal.SIGCONT)
        fenced = wait_event(store, cursor, kind="fenced", holder="A-stopped")
        assert "not the lease holder" in fenced["error"]
        after = [x for x in store.audit(f"({stopped_at}", "+")]
        assert after and all(x["actor"] != "A-stopped" for x in after)
        assert any(x["actor"] == "B-leader" and x["trigger"] == "loaded" for x in after)
        check_converged(store)
    finally:
        stop_process(a, signal.SIGKILL)
        if b is not None:
            stop_process(b)
