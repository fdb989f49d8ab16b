"""The operator's CLI against a running cluster: ``rearrange --wait`` for each outcome, ``status``'s stale mark and a
cordoned round's staged plan."""

from __future__ import annotations

import json

import pytest
import structlog.testing

from fdeplb.cli import main
from fdeplb.machines.tables import WEIGHTS
from fdeplb.store import Deadlines
from tests.helpers import run_cli as run, thread_cluster, wait_for

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in every test


def rearrange_wait(capsys, url, cluster, *extra):
    return run(capsys, "rearrange", "--redis-url", url, "--cluster", cluster, "--wait", "--timeout", "120", *extra)


def test_rearrange_wait_rearranged_prints_gain_and_moves(redis_url, cluster_id, capsys, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        code, out, err = rearrange_wait(capsys, redis_url, cluster_id)
        assert code == 0, out + err
        assert "round 1 will serve this request" in out
        plan = tc.store().read_plan(tc.store().current_placement().plan_id)
        assert (f"round 1: rearranged, plan {plan.plan_id}: balancedness {plan.balancedness_before:.4f} -> "
                f"{plan.balancedness_after:.4f}") in out
        assert f"{plan.moved_experts} moved experts" in out and plan.moved_experts > 0


def test_rearrange_wait_skipped_exits_0_with_the_rule(redis_url, cluster_id, capsys, tmp_path):
    with structlog.testing.capture_logs() as logs, \
            thread_cluster(redis_url, cluster_id, tmp_path, min_gain=1.0) as tc:
        tc.start()
        code, out, err = rearrange_wait(capsys, redis_url, cluster_id)
        assert code == 0, out + err
        assert "round 1: skipped: planned gain " in out and "<= min_gain 1.0" in out
    # the coordinator logs the gated skip as an info "skip" with its numbers, not as a warning "abort"
    skips = [e for e in logs if e["event"] == "skip"]
    assert [e["log_level"] for e in skips] == ["info"], skips
    assert skips[0]["min_gain"] == 1.0 and skips[0]["gain"] <= 1.0 and "moved_experts" in skips[0]
    assert not [e for e in logs if e["event"] == "abort"]


def test_rearrange_wait_aborted_exits_1_with_the_reason(redis_url, cluster_id, capsys, tmp_path):
    deadlines = Deadlines(collecting_ms=300, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        tc.start_agents([0, 1, 2])
        tc.start_silent_rank(3)  # rank 3 never publishes its load
        tc.start_coordinator()
        code, out, err = rearrange_wait(capsys, redis_url, cluster_id)
        assert code == 1, out + err
        assert "round 1: aborted: collecting deadline passed: no load from ranks [3]" in out


def test_rearrange_wait_times_out_with_exit_6(redis_url, cluster_id, capsys, tmp_path):
    deadlines = Deadlines(collecting_ms=600_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000)
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=deadlines) as tc:
        tc.start_agents([0, 1, 2])
        tc.start_silent_rank(3)
        tc.start_coordinator()
        code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait",
                             "--timeout", "2")
        assert code == 6 and "round 1 not over after 2s" in err
        # the command it suggests runs as printed: `status` needs the Redis URL too (it said `status --cluster ID`,
        # which exits 2 asking for --redis-url)
        hint = err.rsplit("it may still finish: ", 1)[1].strip()
        assert hint == f"fdeplb status --redis-url {redis_url} --cluster {cluster_id}", err
        code, out, err = run(capsys, *hint.split()[1:])
        assert code == 0 and "COLLECTING" in out, out + err


def test_rearrange_says_why_a_round_waits_on_cleared_weights(redis_url, cluster_id, capsys, tmp_path):
    """A round cannot start while weights are cleared: the request says so at once, --wait's timeout names it, and
    the coordinator logs the wait once, not at every retry."""
    with structlog.testing.capture_logs() as logs, thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        store = tc.store()
        store.request_weights("clear", "test")
        wait_for(lambda: all(w.state == "CLEARED" for w in store.read_all(WEIGHTS)), 60, store, "weights CLEARED")
        code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait",
                             "--timeout", "3")
        assert code == 6, out + err
        why = "waits: weights not NORMAL on ranks 0 CLEARED, 1 CLEARED, 2 CLEARED, 3 CLEARED"
        assert f"note: round 1 {why}" in err
        assert f"round 1 not over after 3s (cluster FREE, round 0; it {why}" in err
        store.request_weights("update", "test")
        code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--wait",
                             "--timeout", "120")
        assert code == 0 and "round 1: rearranged" in out, out + err
    waits = [e for e in logs if e["event"] == "start waits"]
    assert len({e["reason"] for e in waits}) == len(waits) >= 1, waits  # once per reason


def test_status_marks_a_rank_whose_heartbeat_is_stale(redis_url, cluster_id, capsys, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents(heartbeat_ttl_ms=1_000)  # status marks a rank stale past its own heartbeat TTL
        tc.agents[2].stop_event.set()  # rank 2's agent stops beating, as a killed worker would
        store = tc.store()

        def status():
            code, out, _ = run(capsys, "status", "--redis-url", redis_url, "--cluster", cluster_id, "--json")
            assert code == 0
            return json.loads(next(l for l in out.splitlines() if l.startswith('{"cluster"')))

        wait_for(lambda: status()["ranks"][2]["stale"], 60, store, "rank 2 marked stale")
        ranks = status()["ranks"]
        assert ranks[2]["heartbeat_age_ms"] > 1000
        code, out, _ = run(capsys, "status", "--redis-url", redis_url, "--cluster", cluster_id)
        line = next(l for l in out.splitlines() if l.strip().startswith("2 "))
        assert "STALE (> 1.0 s)" in line


def test_status_of_a_cordoned_round_shows_the_staged_plan_and_the_commit_command(redis_url, cluster_id, capsys,
                                                                                 tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        tc.start()
        store = tc.store()
        store.request_round()
        wait_for(lambda: store.read_cluster().state == "LOAD_SUCC", 60, store, "LOAD_SUCC")
        plan = store.read_plan(store.read_cluster().plan_id)
        code, out, _ = run(capsys, "status", "--redis-url", redis_url, "--cluster", cluster_id)
        assert code == 0
        assert (f"staged     plan {plan.plan_id}: balancedness {plan.balancedness_before:.4f} -> "
                f"{plan.balancedness_after:.4f}, {plan.moved_experts} moved experts") in out
        command = f"fdeplb rearrange --redis-url {redis_url} --cluster {cluster_id} --commit {plan.plan_id}"
        assert f"commit     {command}" in out
        assert main(command.split()[1:]) == 0  # the printed command works
        wait_for(lambda: store.read_cluster().state == "FREE" and store.current_placement().plan_id == plan.plan_id,
                 60, store, "the committed round")


def test_rearrange_wait_on_a_cordoned_cluster_ends_when_staged_and_commit_wait_follows_the_round(
        redis_url, cluster_id, capsys, tmp_path):
    """A cordoned round waits in LOAD_SUCC for the operator: ``--wait`` returns then (not after --timeout) with
    the staged plan and the command; ``--commit PLAN --wait`` follows the committed round to its end."""
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        tc.start()
        store = tc.store()
        code, out, err = rearrange_wait(capsys, redis_url, cluster_id)
        assert code == 0, out + err
        rec = store.read_cluster()
        assert rec.state == "LOAD_SUCC" and rec.round == 1
        plan = store.read_plan(rec.plan_id)
        command = f"fdeplb rearrange --redis-url {redis_url} --cluster {cluster_id} --commit {plan.plan_id}"
        assert (f"round 1: staged, plan {plan.plan_id}: balancedness {plan.balancedness_before:.4f} -> "
                f"{plan.balancedness_after:.4f}") in out
        assert f"{plan.moved_experts} moved experts; the cluster is cordoned: it commits on {command}\n" in out
        # asked again while staged: the staged round serves it, and --wait says so at once
        code, out, err = rearrange_wait(capsys, redis_url, cluster_id)
        assert code == 0 and f"round 1: staged, plan {plan.plan_id}" in out, out + err
        code, out, err = run(capsys, *command.split()[1:], "--wait", "--timeout", "120")
        assert code == 0, out + err
        assert f"round 1: rearranged, plan {plan.plan_id}: balancedness" in out
        assert store.read_cluster().state == "FREE" and store.current_placement().plan_id == plan.plan_id


def test_status_marks_a_rank_whose_routing_digest_differs_from_the_placement(redis_url, cluster_id, capsys, tmp_path,
                                                                           monkeypatch):
    from fdeplb.api import Credentials, create_app
    from fdeplb.machines.tables import RANK
    from fdeplb.placement import routing_digest
    from tests.api_helpers import PASSWORD, USER, served

    def status(*where):
        code, out, err = run(capsys, "status", *where, "--json")
        assert code == 0, err
        got = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"cluster"')))  # (server logs)
        code, text, err = run(capsys, "status", *where)
        assert code == 0, err
        return got, text

    monkeypatch.setenv("FDEPLB_API_USER", USER)
    monkeypatch.setenv("FDEPLB_API_PASSWORD", PASSWORD)
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        assert rearrange_wait(capsys, redis_url, cluster_id)[0] == 0  # every rank swapped to a new placement
        store = tc.store()
        expected = routing_digest(store.current_placement().phy2log)
        with served(create_app(store, Credentials(USER, PASSWORD))) as url:
            for where in (["--redis-url", redis_url, "--cluster", cluster_id], ["--url", url]):
                got, text = status(*where)  # consistent: every rank holds the placement's tables
                assert got["placement"]["routing_digest"] == expected and got["routing_mismatches"] == []
                assert [(r["routing"], r["routing_digest"]) for r in got["ranks"]] == [("match", expected)] * 4
                assert "MISMATCH" not in text and f"routing digest {expected}" in text
            store.update(RANK, 3, routing_digest="0" * 16)  # rank 3 reports other routing tables
            for where in (["--redis-url", redis_url, "--cluster", cluster_id], ["--url", url]):
                got, text = status(*where)
                assert got["routing_mismatches"] == [3]
                assert [r["routing"] for r in got["ranks"]] == ["match"] * 3 + ["mismatch"]
                assert "ROUTING MISMATCH  rank 3 holds routing tables that differ from the placement's" in text
                line = next(ln for ln in text.splitlines() if ln.strip().startswith("3 "))
                assert "MISMATCH" in line and f"(digest {'0' * 16} != {expected})" in line
                assert all("MISMATCH" not in ln for ln in text.splitlines() if ln.strip()[:2] in ("0 ", "1 ", "2 "))


def test_status_shows_swap_pending_while_ranks_wait_for_their_safe_point(redis_url, cluster_id, capsys, tmp_path):
    """Past the commit point the placement is new but a rank's routing tables change only at its worker's safe
    point: until then status says "swap pending" (not MISMATCH) for it; once every rank swapped, "match"."""
    from fdeplb.status import cluster_status
    from fdeplb.orchestration.embedded_agent import EmbeddedAgent
    from tests.orchestration.helpers import Instrumented, Workers

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        agents = [EmbeddedAgent(tc.store(), r, backend_factory=Instrumented.factory(), publish_interval_s=None,
                                load_source=lambda _round, r=r: tc.loads[r]).start() for r in range(4)]
        try:
            tc.start_coordinator()
            store.request_round()  # no worker calls at_safe_point yet: the ranks stage, commit, then wait armed
            wait_for(lambda: store.read_cluster().state == "SWAPPING" and all(
                store.read_rank(r).state == "SWAPPING" for r in range(4)), 60, store, "ranks armed in SWAPPING")
            got = cluster_status(store)
            assert [r["routing"] for r in got["ranks"]] == ["swap_pending"] * 4 and got["routing_mismatches"] == []
            code, text, _ = run(capsys, "status", "--redis-url", redis_url, "--cluster", cluster_id)
            assert code == 0 and "swap pending" in text and "MISMATCH" not in text
            with Workers(agents, tc.loads):
                wait_for(lambda: store.read_cluster().state == "FREE" and store.read_cluster().round == 1 and all(
                    store.read_rank(r).state == "IDLE" for r in range(4)), 60, store, "round 1 over")
            got = cluster_status(store)
            assert [r["routing"] for r in got["ranks"]] == ["match"] * 4
        finally:
            for a in agents:
                a.close()
