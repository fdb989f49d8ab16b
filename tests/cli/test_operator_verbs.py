"""The operator's escape hatches: ``fdeplb round abort|cancel``, ``fdeplb config set``, ``fdeplb cluster
delete``, ``init-cluster`` over an existing cluster, the request TTL and the reasons ``rearrange --wait`` prints;
each against a real Redis, each audited with who and why, each refusal exit 3 with nothing written."""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
import pytest

from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, ClusterState, RankState
from fdeplb.store import Deadlines, Store
from tests.cli.helpers import cli, init_args
from tests.helpers import RawRedis, run_cli, thread_cluster, wait_for


@pytest.fixture
def store(small_store):
    return small_store


# ---- round abort -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_round_abort_before_the_commit_point_is_audited_and_replays(redis_url, cluster_id, capsys, tmp_path):
    from fdeplb.recording import export_recording
    from fdeplb.replay import replay_file

    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        tc.start()
        store = tc.store()
        before = store.current_placement()
        store.request_round("test")
        wait_for(lambda: store.read_cluster().state == "LOAD_SUCC", 60, store, "LOAD_SUCC")
        code, out, err = cli(capsys, store, "round", "abort", "--reason", "wrong plan")
        assert code == 0 and "round 1: aborted from LOAD_SUCC" in out, out + err
        last = [a for a in store.audit() if a["machine"] == "cluster"][-1]
        assert (last["trigger"], last["from"], last["to"], last["fence"]) == ("operator_abort", "LOAD_SUCC", "FREE", "")
        assert last["actor"].startswith("operator:") and last["reason"].endswith(": wrong plan")
        assert json.loads(last["detail"]) == {"by": last["actor"], "round": 1, "state": "LOAD_SUCC"}
        wait_for(lambda: all(r.state is RankState.IDLE for r in store.read_all(RANK)), 60, store,
                 "ranks IDLE, their staging dropped")
        assert store.current_placement().plan_id == before.plan_id  # the old placement stays
        export_recording(store, tmp_path / "run.jsonl")
    report = replay_file(tmp_path / "run.jsonl")  # an unfenced operator abort is a legal cluster transition
    assert report.final["cluster"].state == "FREE"


def test_round_abort_after_the_commit_point_is_refused_saying_so(capsys, store, redis_url):
    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.SWAPPING, version=7, round="4", plan_id="abcd")
    before = raw.snapshot()
    code, _, err = cli(capsys, store, "round", "abort")
    assert code == 3 and "round 4 is SWAPPING: past the commit point" in err and "rolls forward" in err
    assert raw.snapshot() == before


def test_round_abort_without_a_round_names_the_pending_request(capsys, store):
    code, _, err = cli(capsys, store, "round", "abort")
    assert code == 3 and "no round in flight" in err
    store.request_round("test")
    code, _, err = cli(capsys, store, "round", "abort")
    assert code == 3 and "round 1 is requested and not started: `fdeplb round cancel`" in err


# ---- round cancel ----------------------------------------------------------------------------------------------
def test_round_cancel_withdraws_a_pending_request_audited(capsys, store):
    store.request_round("while rank 2 was away")
    code, out, err = cli(capsys, store, "round", "cancel", "--reason", "rank 2 is back, not needed")
    assert code == 0 and "round 1: request withdrawn" in out, out + err
    rec = store.read_cluster()
    assert rec.requested == rec.round == 0
    note = store.audit()[-1]
    assert note["trigger"] == "request_cancelled" and note["actor"].startswith("operator:")
    detail = json.loads(note["detail"])
    assert detail == {"by": note["actor"], "round": 1, "requested_reason": "while rank 2 was away"}
    code, _, err = cli(capsys, store, "round", "cancel")
    assert code == 3 and "no round request is pending" in err


# ---- config set / init-cluster over an existing cluster --------------------------------------------------------
def test_config_set_changes_settings_audited_with_the_version_bumped(capsys, store):
    code, out, err = cli(capsys, store, "config", "set", "--min-gain", "0.05", "--cordoned", "--commit-ms", "9000",
                         "--request-ttl", "5000", "--reason", "night shift")
    assert code == 0 and "version 0 -> 1" in out, out + err
    cfg = store.read_config(fresh=True)
    assert (cfg.min_gain, cfg.cordoned, cfg.deadlines.commit_ms, cfg.deadlines.request_ttl_ms, cfg.version) == \
        (0.05, True, 9000, 5000, 1)
    note = store.audit()[-1]
    assert note["trigger"] == "config_changed" and note["actor"].startswith("operator:")
    assert json.loads(note["detail"])["changes"] == {
        "min_gain": [0.0, 0.05], "cordoned": [False, True], "deadlines.commit_ms": [600000, 9000],
        "deadlines.request_ttl_ms": [30000, 5000]}
    assert note["reason"].endswith("(night shift)")
    code, out, _ = cli(capsys, store, "config", "show")
    assert code == 0 and json.loads(out)["version"] == 1


def test_config_set_refuses_a_bad_value_and_writes_nothing(capsys, store, redis_url):
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    code, _, err = cli(capsys, store, "config", "set", "--min-gain", "2")
    assert code == 2 and "min_gain must be a finite number in [0, 1]" in err
    assert raw.snapshot() == before


def test_init_cluster_with_other_settings_is_refused_pointing_at_config_set(capsys, redis_url, cluster_id,
                                                                             tmp_path):
    pytest.importorskip("safetensors")
    store = Store(redis_url, cluster_id)
    try:
        assert run_cli(capsys, *init_args(store, tmp_path))[0] == 0
        code, out, _ = run_cli(capsys, *init_args(store, tmp_path))
        assert code == 0 and "exists already, left as it is" in out  # the same settings: idempotent
        code, _, err = run_cli(capsys, *init_args(store, tmp_path, "--min-gain", "0.05"))
        assert code == 3 and "min_gain 0.0 (asked 0.05)" in err and "fdeplb config set" in err
        assert store.read_config(fresh=True).min_gain == 0.0
    finally:
        store.delete_cluster()


# ---- cluster delete --------------------------------------------------------------------------------------------
def test_cluster_delete_refused_while_a_coordinator_leads_unless_forced(capsys, store):
    lease = store.acquire_lease("coordinator@test", 60_000)
    code, _, err = cli(capsys, store, "cluster", "delete")
    assert code == 3 and f"coordinator {lease} holds the lease" in err and "--force" in err
    assert store.key_count() > 0
    store.request_round("x")  # an audit, a plan of keys of every kind
    code, out, err = cli(capsys, store, "cluster", "delete", "--force")
    assert code == 0 and "deleted" in out, out + err
    assert store.key_count() == 0


def test_the_reaper_deletes_a_clusters_keys_when_its_parent_goes(store):
    from fdeplb.reaper import Reaper

    reaper = Reaper()
    reaper.watch_command([sys.executable, "-m", "fdeplb", "cluster", "delete", "--force", "--redis-url", store.url,
                          "--cluster", store.cluster])
    assert store.key_count() > 0
    reaper.close()  # what the parent's death does to the pipe, SIGKILL included
    assert store.key_count() == 0


# ---- request TTL and what --wait says ----------------------------------------------------------------------------
@contextlib.contextmanager
def _cluster_that_cannot_start(redis_url, cluster_id, tmp_path):
    """A thread cluster with a leader whose rounds cannot start (rank 2's weights CLEARED) and requests expire after
    1.5 s; yields its store."""
    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000,
                          request_ttl_ms=1_500)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        store = tc.store()
        raw = RawRedis(redis_url, cluster_id)
        raw.force(raw.keys.weights(2), "CLEARED", version=2)
        for r in range(4):  # every rank up (the start guard counts unregistered ranks): only the weights hold it
            tc.start_silent_rank(r)
        tc.start_coordinator()
        wait_for(lambda: store.lease_info().holder, 30, store, "a leader")
        yield store


@pytest.mark.slow
def test_a_request_that_cannot_start_expires_audited_and_wait_says_why(redis_url, cluster_id, capsys, tmp_path):
    with _cluster_that_cannot_start(redis_url, cluster_id, tmp_path) as store:
        code, out, err = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait",
                                 "--timeout", "60")
        assert code == 1, out + err
        assert "note: round 1 waits: weights not NORMAL on ranks 2 CLEARED" in err
        assert "round 1: not started: round 1 request expired: not started" in out
        rec = store.read_cluster()
        assert rec.state is ClusterState.FREE and rec.requested == rec.round == 0
        note = [a for a in store.audit() if a["trigger"] == "request_expired"][-1]
        detail = json.loads(note["detail"])
        assert detail["round"] == 1 and detail["request_ttl_ms"] == 1_500 and detail["age_ms"] > 1_500
        assert "weights" in detail["waited_on"] and note["fence"]  # the leader's, fenced


@pytest.mark.slow
def test_an_operator_plan_whose_request_expires_is_dropped_with_it(redis_url, cluster_id, capsys, tmp_path):
    """Else FREE's entry work requests its round again, to expire again every request_ttl_ms and fire whenever the
    cluster can start, minutes later."""
    from fdeplb.placement import Placement, write_placement

    with _cluster_that_cannot_start(redis_url, cluster_id, tmp_path) as store:
        plan = np.roll(store.current_placement().phy2log, 5, axis=1)
        path = write_placement(Placement.from_phy2log(plan, 16), tmp_path / "plan.json", format="sglang")
        code, out, err = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--plan",
                                 str(path), "--wait", "--timeout", "60")
        assert code == 1 and "request expired" in out, out + err
        assert store.supplied_placement() is None  # dropped by the expiry's own transaction
        note = [a for a in store.audit() if a["trigger"] == "request_expired"][-1]
        assert json.loads(note["detail"])["dropped_supplied"]["kind"] == "operator"


def test_rearrange_wait_says_no_coordinator_holds_the_lease(capsys, store):
    store.acquire_lease("gone@test", 400)  # a coordinator that then died: its lease lapses
    code, out, err = cli(capsys, store, "rearrange", "--wait", "--timeout", "3")
    assert code == 6, out + err
    assert f"note: round 1 waits: no coordinator holds the lease of cluster {store.cluster}" in err
    assert "it waits: no coordinator holds the lease" in err


def test_rearrange_wait_prints_the_stale_rank_refusal_at_once(capsys, store):
    store.request_round("test")
    store.update(CLUSTER, reason="start refused: stale ranks 2 (heartbeat 16000 ms ago)")
    store.acquire_lease("lead@test", 60_000)
    code, out, err = cli(capsys, store, "rearrange", "--wait", "--timeout", "1")
    assert code == 6
    assert "note: round 1 waits: start refused: stale ranks 2 (heartbeat 16000 ms ago)" in err
    assert "round 1 not over after 1s (cluster FREE, round 0; it waits: start refused: stale ranks 2" in err


def test_weights_refusal_is_unchanged_for_a_single_blocker(store):
    from fdeplb.cli.operate import start_blockers

    store.acquire_lease("lead@test", 60_000)
    assert start_blockers(store) == ""
    RawRedis(store.url, store.cluster).force(store._keys.weights(0), "CLEARED", version=2)
    assert store.read(WEIGHTS, 0).state == "CLEARED"
    assert start_blockers(store).startswith("waits: weights not NORMAL on ranks 0 CLEARED")


@pytest.mark.slow
def test_a_recording_with_a_config_change_replays_its_gates_with_the_changed_min_gain(redis_url, cluster_id, capsys,
                                                                                      tmp_path):
    from fdeplb.recording import export_recording
    from fdeplb.replay import check_gates, replay_file

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        store = tc.store()
        code, out, err = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait")
        assert code == 0 and "round 1: rearranged" in out, out + err
        assert cli(capsys, store, "config", "set", "--min-gain", "1")[0] == 0
        tc.loads = tc.loads[:, :, ::-1].copy()  # another load: round 2 plans a real gain, which min_gain 1 gates
        code, out, err = run_cli(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait")
        assert code == 0 and "round 2: skipped: planned gain" in out and "<= min_gain 1.0" in out, out + err
        export_recording(store, tmp_path / "run.jsonl")
    report = replay_file(tmp_path / "run.jsonl")
    assert report.config_changes and report.config_changes[0][1]["min_gain"] == [0.0, 1.0]
    check_gates(report)  # with the header's min_gain 0 it would say the gate let round 2 through
    assert 2 in report.gates_checked
