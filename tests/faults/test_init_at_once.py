"""Redis restarted empty and ``fdeplb init-cluster`` run again *at once* with the same arguments (the runbook's first
step), over 4 real worker processes (numpy experts) that kept running and a real redis-server SIGKILLed and started
again empty on the same port: ``init-cluster`` waits for the live ranks' reports (``--adopt-wait-ms``), every rank
registers again within 2 heartbeat TTLs, ``rearrange --wait`` exits 0 and every rank's routing is ``match``. Then the
same loss mid-swap with one worker stopped before its swap (it holds another placement than the others): the
others' placement is adopted, and the stopped worker, continued, loads it from the checkpoint (audited
``placement_loaded``) and registers; no worker is restarted."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from fdeplb.machines.tables import RANK
from fdeplb.orchestration.recovery import PLACEMENT_LOADED
from fdeplb.placement import routing_digest
from fdeplb.status import unhealthy_ranks
from fdeplb.store import Store
from tests.faults.helpers import settled, spawn_coordinator, stop_process
from tests.helpers import real_traces_28x64, wait_for
from tests.servers import RedisServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]
EP, TTL_MS = 4, 3_000


def _fdeplb(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fdeplb", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


def _quietly(fn):
    def check():
        try:
            return fn()
        except Exception:  # noqa: BLE001 - Redis restarting, records gone
            return False
    return check


def _lose_redis(server: RedisServer) -> None:
    """SIGKILL Redis, remove its data, start it again empty on the same port."""
    server.kill(signal.SIGKILL)
    for p in server.directory.iterdir():
        if p.name != "redis.log":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    server.start()


def _registered_again(store: Store) -> None:
    """Every rank registered and fresh within 2 heartbeat TTLs (the acceptance's bound)."""
    wait_for(_quietly(lambda: unhealthy_ranks(store) == (EP, {})), 2 * TTL_MS / 1000, store,
             "every rank registered again, fresh")


def _round_and_routing(store: Store, url: str) -> None:
    """``rearrange --wait`` exits 0 and ``fdeplb status`` shows every rank's routing ``match``."""
    done = _fdeplb("rearrange", "--redis-url", url, "--cluster", store.cluster, "--wait", "--timeout", "90")
    assert done.returncode == 0, done.stdout + done.stderr
    status = _fdeplb("status", "--redis-url", url, "--cluster", store.cluster, "--json")
    assert status.returncode == 0, status.stderr
    ranks = json.loads(status.stdout)["ranks"]
    assert [r["routing"] for r in ranks] == ["match"] * EP, ranks


def test_init_cluster_at_once_after_redis_lost_its_data_recovers_without_a_restart(real_data, tmp_path):
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id
    from fdeplb.weights import write_synthetic_checkpoint

    traces = real_traces_28x64(real_data, tmp_path)
    write_synthetic_checkpoint(tmp_path / "ckpt", 28, 64, hidden=4, intermediate=4)
    server = RedisServer(tmp_path / "redis")
    store = Store(server.url, new_cluster_id("atonce"))
    init = ["init-cluster", "--redis-url", server.url, "--cluster", store.cluster, "--num-layers", "28",
            "--num-logical-experts", "64", "--num-redundant-experts", "8", "--ep-size", str(EP), "--checkpoint",
            str(tmp_path / "ckpt"), "--adopt-wait-ms", str(TTL_MS + TTL_MS // 4)]
    made = _fdeplb(*init)
    assert made.returncode == 0, made.stdout + made.stderr
    cluster = LocalCluster(store=store, redis_url=server.url, config=store.read_config(), trace=traces,
                           workdir=tmp_path, backend="numpy")
    coordinator = None
    try:
        for r in range(EP):
            cluster.start_rank(r, "--heartbeat-ttl-ms", str(TTL_MS))
        cluster.wait_ready(timeout_s=120)
        verified: set[int] = set()  # past start-up (a worker whose Redis goes away before its loop runs exits)
        cursor = store.cursor(events_from="0-0")
        wait_for(lambda: verified.update(int(e["rank"]) for e in store.wait(cursor, 200)
                                         if e["kind"] == "rank_verified") or len(verified) == EP, 60, store,
                 "every worker in its loop")

        # 1. Redis lost its data; init-cluster with the same arguments at once: it waits for the live reports
        _lose_redis(server)
        again = _fdeplb(*init)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"{EP} of {EP} ranks reported" in again.stdout, (again.stdout,
                                                                 [cluster.log_tail(r, 5) for r in range(EP)])
        _registered_again(store)
        coordinator = spawn_coordinator(cluster, "co1", lease_ms=1_000)
        _round_and_routing(store, server.url)

        # 2. mid-swap: cordoned round staged, rank 3 stopped before its swap, the commit swaps ranks 0-2 only
        assert _fdeplb("config", "set", "--redis-url", server.url, "--cluster", store.cluster,
                       "--cordoned").returncode == 0
        for _ in range(3):  # the traces alternate by round: one of two rounds is gated
            round_ = store.request_round("staged for a mid-swap loss")
            wait_for(lambda: store.read_cluster().state in ("LOAD_SUCC", "FREE") and
                     store.read_cluster().round >= round_ and
                     (store.read_cluster().state == "LOAD_SUCC" or settled(store, round_)()), 90, store,
                     f"round {round_} staged or skipped")
            if store.read_cluster().state == "LOAD_SUCC":
                break
        plan = store.read_cluster().plan_id
        assert store.read_cluster().state == "LOAD_SUCC" and plan
        held = store.current_placement().phy2log
        cluster.procs[3].send_signal(signal.SIGSTOP)
        store.request_commit(plan, by="test")
        wait_for(lambda: all(store.read(RANK, r).live_plan_id == plan for r in range(3)), 60, store,
                 "ranks 0-2 swapped")
        stop_process(coordinator, signal.SIGKILL)
        coordinator = None
        _lose_redis(server)
        again = _fdeplb(*init)  # rank 3 is stopped: it does not report; the others' placement is adopted
        assert again.returncode == 0, again.stdout + again.stderr
        assert "3 of 4 ranks reported" in again.stdout and "ranks [3] did not" in again.stdout, again.stdout
        adopted = store.current_placement()
        assert adopted.plan_id == plan and not np.array_equal(adopted.phy2log, held)
        cluster.procs[3].send_signal(signal.SIGCONT)
        _registered_again(store)
        loaded = [a for a in store.iter_audit() if a["trigger"] == PLACEMENT_LOADED]
        assert [a["key"].rsplit(":", 1)[1] for a in loaded] == ["3"], loaded
        assert store.read_rank(3).routing_digest == routing_digest(adopted.phy2log)
        coordinator = spawn_coordinator(cluster, "co2", lease_ms=1_000)
        _round_and_routing(store, server.url)
        for r in range(EP):  # said once each: no refusal, no restart
            assert "not registering" not in (tmp_path / f"rank{r}.log").read_text(), cluster.log_tail(r, 40)
    finally:
        try:
            if cluster.procs.get(3) is not None and cluster.procs[3].poll() is None:
                cluster.procs[3].send_signal(signal.SIGCONT)
            if coordinator is not None:
                stop_process(coordinator, signal.SIGKILL)
            cluster.stop()
        finally:
            server.close()
