"""What the fault suites share: a coordinator process and its stop, waiting on an event of the cluster's stream
with a deadline, a round's gate made to let a planned round through, and a peer-transfer cluster of worker
processes (one of them hanging mid-expert)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from fdeplb.store import ClusterConfig, Deadlines, Store
from tests.helpers import real_traces_28x64, wait_for


def spawn_coordinator(cluster, holder: str, failpoints: str = "", lease_ms: int = 1_000) -> subprocess.Popen:
    log = open(cluster.workdir / f"{holder}.log", "ab")
    env = dict(os.environ, FDEPLB_FAILPOINTS=failpoints, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fdeplb", "coordinator", "--redis-url", cluster.redis_url, "--cluster",
         cluster.store.cluster, "--holder", holder, "--lease-ms", str(lease_ms), "--log-level", "INFO"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.wait(timeout=30)


def wait_event(store: Store, cursor: dict, timeout_s: float = 60.0, **match) -> dict:
    """Wait for an events-stream entry whose fields include ``match``; returns its fields."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for entry in store.wait(cursor, 500):
            if entry["kind"] and all(entry[k] == str(v) for k, v in match.items()):
                return entry.fields
    raise AssertionError(f"no event {match} within {timeout_s}s")


def skip_round_that_would_be_gated(store: Store) -> None:
    """The workers alternate between two traces by round parity: if the next round would replay the trace of
    the current placement's round (a plan that moves nothing, gated), run that gated round first. Needs a
    coordinator running."""
    plan_id = store.current_placement().plan_id
    rec = store.read_cluster()
    if not plan_id:
        return
    planned_round = store.read_plan(plan_id).round
    if (rec.round + 1 - planned_round) % 2 == 0:
        store.request_round(reason="skip a gated round")
        wait_for(settled(store, rec.round + 1), 60, store, "the gated round")
        assert "gated" in last_cluster_transition(store)["reason"]


def settled(store: Store, round_: int):
    """A predicate: the cluster is FREE at round ``round_`` or later and every rank IDLE."""
    def check():
        rec = store.read_cluster()
        ranks = [store.read_rank(r) for r in range(store.read_config().ep_size)]
        return rec.state == "FREE" and rec.round >= round_ and all(r.state == "IDLE" for r in ranks)
    return check


def last_cluster_transition(store: Store):
    return [a for a in store.iter_audit() if a["machine"] == "cluster" and a["trigger"] != "alarm"][-1]


PEER_EP = 4


def peer_cluster(redis_url: str, real_data, tmp_path, name: str, hang_rank: int):
    """A 28 x 64 cluster of ``PEER_EP`` numpy worker processes that take moved experts from each other, rank
    ``hang_rank``'s server hanging in the middle of the first expert it sends (failpoint ``peer.hang=sending``),
    every rank ready, and a coordinator thread not yet started: ``(store, cluster, coordinator, thread)``."""
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.placement import initial_placement
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id

    traces = real_traces_28x64(real_data, tmp_path)
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=PEER_EP,
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=60_000, commit_ms=30_000,
                                               swapping_ms=30_000))
    store = Store(redis_url, new_cluster_id(name))
    cluster = LocalCluster(store=store, redis_url=redis_url, config=config, trace=traces, workdir=tmp_path,
                           backend="numpy", peer_secret=f"{name}-secret")
    cluster.init(initial_placement(28, 64, 72).phy2log)
    coordinator = Coordinator(Store(redis_url, store.cluster), lease_ms=1_500)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    try:
        for r in range(PEER_EP):
            cluster.start_rank(r, env={"FDEPLB_FAILPOINTS": "peer.hang=sending"} if r == hang_rank else None)
        cluster.wait_ready(timeout_s=120)
    except BaseException:
        cluster.stop()
        store.delete_cluster()
        raise
    return store, cluster, coordinator, thread
