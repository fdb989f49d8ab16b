"""An operator deletes a cluster under running processes (issue 34 item 6): ``cluster delete --force`` leaves a
tombstone (who, when; a TTL) in the transaction that deletes the keys; the agents and the coordinator that find
the cluster gone see it, stop touching the cluster and say so (the sim worker and ``fdeplb coordinator`` exit 0
with one line); ``init-cluster`` removes it. Without a tombstone (Redis lost its data) they recover as before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fdeplb.cli import main
from fdeplb.errors import CorruptRecordError
from fdeplb.store.liveness import Tombstone
from tests.helpers import wait_for
from tests.sim.helpers import two_rank_cluster, worker_process, write_trace


def _keys(store) -> list[str]:
    return sorted(k.decode() for k in store._client.scan_iter(match=store._keys.pattern))


def test_the_tombstone_is_written_with_the_delete_and_removed_by_init(redis_url, cluster_id, monkeypatch):
    store = two_rank_cluster(redis_url, cluster_id)
    assert store.tombstone() is None
    store.delete_cluster()  # a clean-up (the tests', the demo's): no tombstone
    assert _keys(store) == [] and store.tombstone() is None
    store = two_rank_cluster(redis_url, cluster_id)
    monkeypatch.setenv("USER", "alice")
    assert main(["cluster", "delete", "--redis-url", redis_url, "--cluster", cluster_id]) == 0
    tomb = store.tombstone()
    assert isinstance(tomb, Tombstone) and tomb.by.startswith("operator:alice") and tomb.keys > 0
    assert 0 < tomb.ttl_ms <= 3_600_000 and _keys(store) == [store._keys.deleted] and store.key_count() == 0
    assert store.heartbeat(0) is None and _keys(store) == [store._keys.deleted]  # a heartbeat writes no record anew
    store = two_rank_cluster(redis_url, cluster_id)  # init-cluster: the cluster exists again
    assert store.tombstone() is None and store.heartbeat(0) is not None
    store._client.set(store._keys.deleted, "not json")  # a value fdeplb did not write: named, not taken for one
    with pytest.raises(CorruptRecordError, match="deleted: not a tombstone"):
        store.tombstone()


@pytest.mark.slow
def test_agents_and_a_coordinator_stop_when_an_operator_deletes_their_cluster(redis_url, cluster_id, tmp_path):
    store = two_rank_cluster(redis_url, cluster_id)
    trace = write_trace(tmp_path, 2, 8)
    ttl = ("--heartbeat-ttl-ms", "1000")
    workers = [worker_process(redis_url, cluster_id, "--rank", "0", *ttl, trace=trace),  # a threaded agent
               worker_process(redis_url, cluster_id, "--rank", "1", *ttl, "--step-ms", "5", trace=trace)]  # an engine
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fdeplb", "coordinator", "--redis-url", redis_url, "--cluster", cluster_id,
         "--lease-ms", "900", "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ))
    procs = [*workers, coordinator]
    try:
        wait_for(lambda: (store.lease_info().holder and len(store.rank_info()) == 2
                          and all(p.poll() is None for p in procs)) or any(p.poll() is not None for p in procs),
                 120, store, "both ranks registered and the coordinator leading")
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        assert main(["cluster", "delete", "--force", "--redis-url", redis_url, "--cluster", cluster_id]) == 0
        for p in procs:  # each finds the tombstone at its next look, says so and exits 0
            out, err = p.communicate(timeout=60)
            stopped = [ln for ln in err.splitlines() if ln.startswith("stopped: ")]
            assert p.returncode == 0 and len(stopped) == 1, (p.args, p.returncode, err[-2000:])
            assert f"cluster {cluster_id!r} was deleted by " in stopped[0], stopped
        # nothing of the cluster was written again: no heartbeat, lease, fence, live report or event
        assert _keys(store) == [store._keys.deleted] and store.key_count() == 0, \
            store._client.xrange(store._keys.events)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=60)
        store.delete_cluster()
