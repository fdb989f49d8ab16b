"""Rounds hardened against misuse and bad data: bounded Redis, coalesced requests, poison-proof loops, exact load
sums, range-checked inputs and the routing-table digest. Real Redis, coordinator + agents in threads (numpy weights)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from fdeplb.errors import InputError, StateError
from fdeplb.placement import check_counts, routing_digest
from fdeplb.store import ClusterConfig, Deadlines, Store
from fdeplb.store.scripts import SIGNAL_MAXLEN
from fdeplb.testing import NumpyWeights
from tests.helpers import FAULTS_PROFILE, RawRedis, run_cli, thread_cluster, wait_for

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in most tests


def round_over(store, n):
    def check():
        rec = store.read_cluster()
        return rec.state == "FREE" and rec.round >= n and all(
            store.read_rank(r).state == "IDLE" for r in range(store.ep_size())) and rec
    return check


def cluster_audit(store):
    return [a for a in store.iter_audit() if a["machine"] == "cluster"]


# ---- coalesced requests ------------------------------------------------------------------------------------------
def test_twenty_concurrent_requests_yield_one_round(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start_agents()
        served, barrier = [], threading.Barrier(20)

        def ask():
            s = Store(redis_url, cluster_id)  # one client each, as 20 `fdeplb rearrange` processes would have
            barrier.wait()
            served.append(s.request_round("test"))

        threads = [threading.Thread(target=ask) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert served == [1] * 20  # every request says round 1 serves it
        assert store.read_cluster().requested == 1
        tc.start_coordinator()
        wait_for(round_over(store, 1), 60, store, "round 1")
        # no second round follows: the coordinator idles in FREE with nothing requested
        cursor = store.cursor()
        for _ in range(3):
            store.wait(cursor, 500)
        rec = store.read_cluster()
        assert rec.state == "FREE" and rec.round == 1 and rec.requested == 1
        assert [a["trigger"] for a in cluster_audit(store)].count("start") == 1


def test_requests_during_a_round_are_served_by_it(redis_url, cluster_id, tmp_path, capsys):
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        store = tc.store()
        tc.start()
        assert store.request_round() == 1
        rec = wait_for(lambda: (r := store.read_cluster()).state == "LOAD_SUCC" and r, 60, store, "LOAD_SUCC")
        code, out, _ = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id)
        assert code == 0 and "round 1 will serve this request" in out
        assert {Store(redis_url, cluster_id).request_round() for _ in range(10)} == {1}
        store.request_commit(rec.plan_id)
        wait_for(round_over(store, 1), 60, store, "round 1")
        assert store.read_cluster().requested == 1
        assert store.request_round() == 2  # after it ended, a request asks for the next round


# ---- bad loads: fractional, over the limit in sum --------------------------------------------------------------
def test_fractional_loads_are_refused_never_truncated(redis_url, cluster_id, tmp_path):
    with pytest.raises(InputError, match="fractional value 3.7"):
        check_counts(np.array([[1.0, 3.7]]))
    assert check_counts(np.array([[1.0, 3.0]])).dtype == np.int64
    with thread_cluster(redis_url, cluster_id, tmp_path,
                        deadlines=Deadlines(collecting_ms=1_500, loading_ms=20_000)) as tc:
        store = tc.store()
        raw = RawRedis(redis_url, cluster_id)
        before = raw.snapshot()
        with pytest.raises(InputError, match="fractional"):
            store.publish_load(0, 1, tc.loads[0] + 0.7)
        assert raw.snapshot() == before  # nothing written
        tc.loads = tc.loads + 0.7  # every rank's recorder now reports fractional counts
        tc.start()
        store.request_round()
        rec = wait_for(round_over(store, 1), 60, store, "aborted round")
        assert "collecting deadline passed: no load from ranks [0, 1, 2, 3]" in rec.reason
        assert store.current_placement().plan_id == "" and store.read_snapshot(1) is None


def test_load_sum_above_2_53_across_ranks_aborts_naming_the_limit(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.loads = np.full_like(tc.loads, 2**53)  # each window legal, their sum is 2**55
        tc.start()
        store.request_round()
        rec = wait_for(round_over(store, 1), 60, store, "aborted round")
        assert rec.reason.startswith("load windows of ranks 0..1 sum above 2**53")
        assert store.read_snapshot(1) is None and store.current_placement().plan_id == ""
        assert tc.coordinator.stop_event.is_set() is False and tc.threads[-1].is_alive()


# ---- corrupt stored values: the round aborts naming the key, the next one succeeds ------------------------------
def _corrupt_window(raw, r, **fields):
    base = {"expert_load": np.zeros((3, 16), np.int64).tobytes(), "expert_load:dtype": "<i8",
            "expert_load:shape": "3,16", "round": "1", "published_ms": "1"}
    raw.r.hset(raw.keys.load(r), mapping={**base, **fields})


WINDOW_CORRUPTIONS = {
    "wrong shape": dict(expert_load=np.zeros((2, 16), np.int64).tobytes(), **{"expert_load:shape": "2,16"}),
    "bytes do not fit": dict(expert_load=b"\x01\x02\x03"),
    "float dtype": dict(expert_load=np.zeros((3, 16), np.float64).tobytes(), **{"expert_load:dtype": "<f8"}),
    "negative": dict(expert_load=np.full((3, 16), -5, np.int64).tobytes()),
    "over 2**53": dict(expert_load=np.full((3, 16), 2**60, np.int64).tobytes()),
    "round not a number": dict(round="abc"),
    "object dtype": dict(**{"expert_load:dtype": "|O"}),
}


@pytest.mark.parametrize("kind", list(WINDOW_CORRUPTIONS))
def test_corrupt_load_window_aborts_the_round_and_the_next_one_succeeds(redis_url, cluster_id, tmp_path, kind):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        _corrupt_window(raw, 2, **WINDOW_CORRUPTIONS[kind])
        tc.start()
        store.request_round()
        rec = wait_for(round_over(store, 1), 60, store, "aborted round 1")
        assert rec.reason.startswith("load window of rank 2 is corrupt") and raw.keys.load(2) in rec.reason, \
            rec.reason
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        assert store.current_placement().plan_id == store.read_cluster().plan_id != ""
        assert store.routing_mismatches() == []
        assert tc.threads[-1].is_alive()


def test_corrupt_snapshot_aborts_the_round_and_the_next_one_succeeds(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        raw.r.hset(raw.keys.snapshot(1), mapping={"expert_load": b"garbage!", "expert_load:dtype": "<i8",
                                                  "expert_load:shape": "3,16"})
        tc.start()
        store.request_round()
        rec = wait_for(round_over(store, 1), 60, store, "aborted round 1")
        assert "load snapshot of round 1 is corrupt" in rec.reason and raw.keys.snapshot(1) in rec.reason
        store.request_round()
        wait_for(round_over(store, 2), 60, store, "round 2")
        assert store.current_placement().plan_id != ""


def test_corrupt_plan_aborts_before_commit_and_the_next_round_recomputes_it(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        tc.start()
        store.request_round()
        rec = wait_for(lambda: (r := store.read_cluster()).state == "LOAD_SUCC" and r, 60, store, "LOAD_SUCC")
        bad = np.full((3, 20), 99, np.int64)  # expert ids outside [0, 16)
        raw.r.hset(raw.keys.plan(rec.plan_id), "new_phy2log", bad.tobytes())
        aborted = wait_for(round_over(store, 1), 60, store, "aborted round 1")
        assert f"stored plan {rec.plan_id} is corrupt" in aborted.reason and "expert ids outside" in aborted.reason
        assert store.current_placement().plan_id == ""
        store.request_round()
        rec2 = wait_for(lambda: (r := store.read_cluster()).state == "LOAD_SUCC" and r.round == 2 and r, 60, store,
                        "LOAD_SUCC of round 2")
        assert rec2.plan_id == rec.plan_id  # same inputs, same plan, computed again
        store.request_commit(rec2.plan_id)
        wait_for(round_over(store, 2), 60, store, "round 2")
        assert store.current_placement().plan_id == rec.plan_id and store.routing_mismatches() == []


#: a rank record corrupted in a field other than its state (the coordinator checks only (state, plan_id) per rank
#: at each wake-up; the rank's agent cannot read the record, so the rank never moves), and one without a state
RANK_CORRUPTIONS = {
    "version not a number": lambda raw, key: raw.r.hset(key, "version", "abc"),
    "heartbeat not a number": lambda raw, key: raw.r.hset(key, "heartbeat_ms", "x1"),
    "state deleted": lambda raw, key: raw.r.hdel(key, "state"),
}


@pytest.mark.parametrize("kind", list(RANK_CORRUPTIONS))
def test_corrupt_rank_record_while_loading_aborts_naming_the_key_not_at_the_deadline(redis_url, cluster_id, tmp_path,
                                                                                       kind):
    entered, gate = threading.Event(), threading.Event()

    class Gated(NumpyWeights):  # rank 2 stages only once the test let it: the round waits in LOADING meanwhile
        def stage(self, new_phy2log, budget_bytes):
            if self.ep_rank == 2:
                entered.set()
                gate.wait(60)
            return super().stage(new_phy2log, budget_bytes)

    # a loading deadline far past the test's wait: an abort by the deadline cannot be what the test sees
    deadlines = Deadlines(collecting_ms=20_000, loading_ms=600_000, commit_ms=20_000, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        tc.start(backend_factory=lambda _ckpt, phy2log, r, n: Gated(phy2log, r, n))
        store.request_round()
        assert entered.wait(60)
        RANK_CORRUPTIONS[kind](raw, raw.keys.rank(2))
        try:
            rec = wait_for(round_over_any(store, 1), 60, store, "aborted round 1")
        finally:
            gate.set()
        assert rec.reason.startswith("LOADING failed: CorruptRecordError") and raw.keys.rank(2) in rec.reason, \
            rec.reason
        assert store.current_placement().plan_id == ""


def test_a_rank_record_corrupt_at_the_commit_point_aborts_the_round_instead_of_committing(redis_url, cluster_id,
                                                                                         tmp_path):
    """LOAD_SUCC is the coordinator's last look before the commit point: it reads the ranks' whole records, so one
    corrupt in a field other than (state, plan_id) aborts the round naming the key, and the plan is not committed."""
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        tc.start()
        store.request_round()
        rec = wait_for(lambda: (r := store.read_cluster()).state == "LOAD_SUCC" and r, 60, store, "staged round")
        RANK_CORRUPTIONS["version not a number"](raw, raw.keys.rank(1))
        try:
            store.request_commit(rec.plan_id)
        except StateError:  # the coordinator's next look at LOAD_SUCC (any wake-up) aborted the round already
            pass
        rec = wait_for(round_over_any(store, 1), 60, store, "aborted round 1")
        assert rec.reason.startswith("LOAD_SUCC failed: CorruptRecordError") and raw.keys.rank(1) in rec.reason, \
            rec.reason
        assert store.current_placement().plan_id == ""


def round_over_any(store, n):
    """The cluster is FREE after round ``n`` (whatever the ranks are doing)."""
    return lambda: (rec := store.read_cluster()).state == "FREE" and rec.round >= n and rec


def test_a_step_that_keeps_raising_still_ends_the_round_at_its_deadline(redis_url, cluster_id, tmp_path):
    calls = []

    def planner(expert_load, old_phy2log, config):  # a bug, not a typed error: would have killed the loop
        calls.append(1)
        raise RuntimeError("planner bug")

    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=Deadlines(collecting_ms=2_000)) as tc:
        store = tc.store()
        tc.start_agents()
        coordinator = tc.start_coordinator(planner=planner)
        store.request_round()
        rec = wait_for(round_over(store, 1), 60, store, "aborted round")
        assert rec.reason.startswith("PLANNING failed until its deadline passed: RuntimeError: planner bug")
        assert len(calls) >= 2  # retried while failing, until the deadline fired
        assert tc.threads[-1].is_alive() and coordinator.lease is not None


# ---- bounded state ------------------------------------------------------------------------------------------------
def _drifting_rounds(tc, store, rounds, on_round=None, seed=0):
    """Run ``rounds`` rounds, each with the experts' loads shuffled anew so every round plans a new placement."""
    rng = np.random.default_rng(seed)
    base = tc.loads.copy()
    for n in range(1, rounds + 1):
        tc.loads[...] = base[:, :, rng.permutation(base.shape[2])]
        store.request_round()
        rec = wait_for(round_over(store, n), 120, store, f"round {n}")
        if on_round is not None:
            on_round(n, rec)


def test_redis_memory_stays_flat_over_many_rounds(redis_url, cluster_id, tmp_path):
    # FDEPLB_FAULTS=full: 200 rounds (~48 s on 2 cores); the short profile 60, 50 past the round-10 reference and
    # many times retain_rounds (3), so pruning, trimming and the retained rounds all cycle
    rounds = 200 if FAULTS_PROFILE == "full" else 60
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=32, num_experts=128, num_redundant=16,
                        ep_size=4) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        tc.start()
        samples = {}

        def sample(n, rec):
            # the audit grows by design; events and signal are capped streams (trimmed by whole stream nodes)
            streams = {raw.keys.audit.encode(), raw.keys.events.encode(), raw.keys.signal.encode()}
            assert raw.r.xlen(raw.keys.signal) <= SIGNAL_MAXLEN + 100  # 100: Redis' stream-node-max-entries
            keys = [k for k in raw.r.scan_iter(match=f"fdeplb:[{{]{cluster_id}[}}]:*") if k not in streams]
            # SAMPLES 0: every field counted (the default samples 5 fields of a hash and extrapolates: +-50 % here)
            data = sum(raw.r.memory_usage(k, samples=0) or 0 for k in keys)
            used = store.memory_used() - sum(raw.r.memory_usage(k, samples=0) or 0 for k in streams)
            samples[n] = (used, data, len(keys), rec.plan_id)

        _drifting_rounds(tc, store, rounds, sample)
        assert len({p for *_, p in samples.values()}) > rounds // 2  # (almost) every round planned anew
        used10, data10, keys10, _ = samples[10]
        used_worst = max(s[0] for n, s in samples.items() if n >= 10)
        data_worst = max(s[1] for n, s in samples.items() if n >= 10)
        print(f"\nused_memory w/o streams: round 10 {used10} B, worst after {used_worst} B "
              f"({100 * (used_worst / used10 - 1):+.2f}%); fdeplb keys: {data10} -> {data_worst} B "
              f"({100 * (data_worst / data10 - 1):+.2f}%); {rounds} rounds; audit {store.audit_length()} records")
        assert data_worst <= data10 * 1.05, f"the cluster's keys grew {data10} -> {data_worst} B"
        # the server's used_memory also holds the clients' buffers (one connection per agent thread): 10% here
        assert used_worst <= used10 * 1.10, f"used_memory (without the streams) grew {used10} -> {used_worst} B"
        # DBSIZE of the cluster bounded: only the retained rounds vary (a skipped round stores no plan)
        assert max(s[2] for n, s in samples.items() if n >= 10) <= keys10 + tc.config.retain_rounds
        retained = store.retained_keys()
        assert max(retained.values()) - min(retained.values()) < tc.config.retain_rounds
        assert "plan:" in store.read_cluster().pruned
        assert store.audit_length() == len(list(store.iter_audit()))  # the audit stays complete by default


def test_pruning_keeps_the_current_placement_plan_and_audit_trim_exports_first(redis_url, cluster_id, tmp_path):
    export = tmp_path / "audit.jsonl"
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        total_audit = 0
        tc.start()
        _drifting_rounds(tc, store, 2)
        current = store.current_placement().plan_id
        tc.loads[...] = tc.loads.copy()  # the same loads from now on
        # rounds that move nothing (gated skips) push the committed plan's round out of the window
        for n in range(3, 3 + tc.config.retain_rounds + 2):
            store.request_round()
            rec = wait_for(round_over(store, n), 60, store, f"round {n}")
            assert rec.reason.startswith("gated")
        assert store.read_plan(current) is not None  # the current placement's plan is kept
        assert store.read_snapshot(1) is None  # older snapshots are gone
        total_audit = store.audit_length()
        n = store.trim_audit(5, str(export), str(tmp_path), fence="")
        assert n == total_audit - 5 and store.audit_length() == 5
        lines = [json.loads(x) for x in export.read_text().splitlines()]
        sid = lambda i: tuple(int(x) for x in i.split("-"))  # noqa: E731
        assert len(lines) == n and lines[0]["trigger"] == "start"
        assert sid(lines[-1]["id"]) < sid(store.audit()[0].id)
        assert raw.audit_len() == 5


def test_routing_digests_match_the_placement_after_swaps_and_restarts(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start()
        assert store.routing_mismatches() == []  # reported at start-up for the initial placement
        _drifting_rounds(tc, store, 1)
        assert store.routing_mismatches() == []
        expected = routing_digest(store.current_placement().phy2log)
        assert {store.read_rank(r).routing_digest for r in range(4)} == {expected}
        store.update(__import__("fdeplb.machines.tables", fromlist=["RANK"]).RANK, 3, routing_digest="0" * 16)
        assert store.routing_mismatches() == [(3, "0" * 16, expected)]


# ---- inputs -------------------------------------------------------------------------------------------------------
def _init(url, cluster, *extra):
    return ("init-cluster", "--redis-url", url, "--cluster", cluster, "--num-layers", "2",
            "--num-logical-experts", "8", "--num-redundant-experts", "4", "--ep-size", "4",
            "--checkpoint", "/nonexistent/ckpt", *extra)


@pytest.mark.parametrize("option,value,message", [
    ("--num-layers", "1000000000", "num_layers must be at most"),
    ("--num-layers", str(10**30), "num_layers must be at most"),
    ("--num-logical-experts", str(10**30), "must be at most"),
    ("--num-redundant-experts", str(10**30), "must be at most"),
    ("--ep-size", "0", "ep_size must be a positive integer"),
    ("--min-gain", "nan", "min_gain must be a finite number"),
    ("--min-gain", "inf", "min_gain must be a finite number"),
    ("--min-gain", "-1", "min_gain must be a finite number"),
    ("--loading-ms", str(10**30), "deadlines.loading_ms must be in"),
    ("--collecting-ms", "0", "collecting"),
    ("--retain-rounds", "0", "retain_rounds must be in"),
    ("--audit-keep", "10", "set audit_export_path"),
])
def test_init_cluster_refuses_out_of_range_options(redis_url, cluster_id, capsys, option, value, message):
    args = list(_init(redis_url, cluster_id))
    if option in args:
        args[args.index(option) + 1] = value
    else:
        args += [option, value]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err, err
    assert "Traceback" not in err
    assert Store(redis_url, cluster_id).key_count() == 0


def test_table_memory_is_bounded():
    with pytest.raises(InputError, match="MiB per placement table"):
        ClusterConfig(num_layers=4_096, num_logical_experts=65_536, num_physical_experts=65_536, ep_size=1)
    with pytest.raises(InputError, match="deadlines.swapping_ms"):
        Deadlines(swapping_ms=float("inf"))


@pytest.mark.parametrize("value", ["0", "10", str(10**30)])
def test_coordinator_lease_is_range_checked(redis_url, cluster_id, capsys, value):
    run_cli(capsys, *_init(redis_url, cluster_id))
    code, _, err = run_cli(capsys, "coordinator", "--redis-url", redis_url, "--cluster", cluster_id,
                           "--lease-ms", value)
    assert code == 2 and "lease_ms must be an integer in [300, 3600000]" in err
    Store(redis_url, cluster_id).delete_cluster()
