"""``fdeplb rearrange --plan FILE``: one audited round to an operator's plan on a running thread cluster (replayed);
a plan of the wrong shape, one lacking a logical expert, one leaving an expert on non-members only, garbage, and
one without a coordinator: refused, nothing changed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fdeplb.placement import Placement, write_placement
from fdeplb.placement.digest import routing_digest
from fdeplb.rounds import reasons
from tests.helpers import RawRedis, run_cli, thread_cluster, wait_for, within


def _rearrange(capsys, store, *argv: str):
    return run_cli(capsys, "rearrange", "--redis-url", store.url, "--cluster", store.cluster, *argv)


def _plan_file(tmp_path, phy2log, num_logical_experts, name="plan.json", fmt="sglang"):
    return str(write_placement(Placement.from_phy2log(np.asarray(phy2log, dtype=np.int64), num_logical_experts),
                               tmp_path / name, format=fmt))


@pytest.mark.slow
def test_rearrange_plan_is_one_audited_round_to_that_plan(redis_url, cluster_id, capsys, tmp_path):
    from fdeplb.recording import export_recording
    from fdeplb.replay import replay_file

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        store = tc.store()
        plan = np.roll(store.current_placement().phy2log, 5, axis=1)  # every rank's experts to the next rank
        path = _plan_file(tmp_path, plan, 16, "plan.json", "sglang")
        code, out, err = _rearrange(capsys, store, "--plan", path, "--wait", "--timeout", "60")
        assert code == 0 and "round 1: rearranged" in out, out + err
        # labelled a routing digest: the round reports its own plan id (it hashes the round's load too)
        assert f"plan from {path} supplied: routing digest {routing_digest(plan)}" in out
        assert np.array_equal(store.current_placement().phy2log, plan)
        assert store.supplied_placement() is None  # the round that committed it dropped it
        loads = [a for a in store.audit() if a["machine"] == "cluster" and a["trigger"] == "load"]
        assert len(loads) == 1 and loads[0]["round"] == "1"
        facts = reasons.supplied_of(json.loads(loads[0]["detail"]))
        assert facts == {"kind": "operator", "undoes": 0, "plan_id": routing_digest(plan), "why": path}
        assert loads[0]["reason"] == f"operator: plan {routing_digest(plan)} supplied from {path}"
        export_recording(store, tmp_path / "run.jsonl")
    report = replay_file(tmp_path / "run.jsonl")  # the supplied round and its reason replay
    assert report.final["cluster"].state == "FREE"


@pytest.fixture
def store(small_store):
    return small_store  # E=4 in P=6 slots on 3 ranks: [0, 1, 2, 3, 0, 1], rank 1 alone holds experts 2 and 3


def _refused(capsys, store, redis_url, path, code_expected, words):
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    code, out, err = _rearrange(capsys, store, "--plan", path, "--timeout", "0.5")
    assert code == code_expected and words in err, out + err
    assert raw.snapshot() == before  # nothing supplied, nothing requested, no audit record


def test_a_plan_of_another_shape_is_refused(capsys, store, redis_url, tmp_path):
    _refused(capsys, store, redis_url, _plan_file(tmp_path, [[0, 1, 2, 3, 0, 1, 2, 3, 0]], 4), 2, "shape (1, 9)")
    _refused(capsys, store, redis_url, _plan_file(tmp_path, [[0, 1, 2, 3] * 3], 4, "twelve.json"), 2,
             "shape (1, 12)")
    cut = tmp_path / "cut.json"  # cut to 3 of 6 slots: named by its shape, not by expert 3 it lost
    cut.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2]]}))
    _refused(capsys, store, redis_url, str(cut), 2, "rows of 3 slots (shape (1, 3)), 6 slots per layer")


def test_a_plan_that_drops_an_expert_or_is_garbage_is_refused(capsys, store, redis_url, tmp_path):
    path = tmp_path / "drop.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 0, 1, 2]]}))  # no replica of expert 3
    _refused(capsys, store, redis_url, str(path), 2, "logical expert 3 has no slot")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    _refused(capsys, store, redis_url, str(garbage), 2, str(garbage))
    _refused(capsys, store, redis_url, str(tmp_path / "missing.json"), 2, "missing.json")
    fifo = tmp_path / "fifo"  # opening it for reading would wait for a writer forever: refused at once
    os.mkfifo(fifo)
    within(lambda: _refused(capsys, store, redis_url, str(fifo), 2, f"{fifo}: placement file is a FIFO"), fifo=fifo)


def test_a_plan_for_another_model_or_topology_is_refused(capsys, store, redis_url, tmp_path):
    """A file whose rows are neither the cluster's MoE layers nor its model layers (another model's plan: its first
    rows would be taken), or whose header names another node or group count, is another cluster's plan."""
    rows = [[0, 1, 2, 3, 0, 1], [1, 0, 3, 2, 1, 0]]  # 2 layer rows for a 1-layer model
    _refused(capsys, store, redis_url, _plan_file(tmp_path, rows, 4, "two_layers.json"), 2, "2 layer rows")
    with open(_plan_file(tmp_path, rows[:1], 4, "fd.json", "fdeplb")) as f:
        fdeplb = json.load(f)
    for key, value in (("num_nodes", 3), ("num_groups", 2)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**fdeplb, "num_gpus": 3, key: value}))
        _refused(capsys, store, redis_url, str(path), 2, f"{key} is {value} in the file, 1 was expected")


def test_a_plan_whose_rows_the_cluster_cannot_match_names_the_fix_and_one_naming_its_layers_is_taken(
        capsys, store, redis_url, tmp_path):
    """QA: SGLang's plan of every model layer (dense ones too) for a cluster created without --layer-ids read 'a
    plan of another model'. The message names the fix (the cluster's --layer-ids / --num-model-layers, or a plan in
    fdeplb format); a file naming its layers (TensorRT-LLM's keys, fdeplb's layer_ids) gives the cluster's."""
    from fdeplb.cli.operate import _plan_of

    rows = [[0, 1, 2, 3, 0, 1], [1, 0, 3, 2, 1, 0], [2, 3, 0, 1, 2, 3]]
    path = _plan_file(tmp_path, rows, 4, "three.json")
    _refused(capsys, store, redis_url, path, 2, "3 layer rows (sglang: one per model layer, no layer ids)")
    err = run_cli(capsys, "rearrange", "--redis-url", store.url, "--cluster", store.cluster, "--plan", path)[2]
    assert "created without --layer-ids" in err and "--num-model-layers" in err and "fdeplb format" in err, err
    trt = tmp_path / "keys.yaml"
    trt.write_text("num_slots: 6\ninitial_global_assignments:\n  0: [1, 0, 3, 2, 1, 0]\n  7: [0, 1, 2, 3, 0, 1]\n")
    assert _plan_of(store.read_config(), str(trt)).tolist() == [[1, 0, 3, 2, 1, 0]]
    with open(_plan_file(tmp_path, rows[:2], 4, "fd.json", "fdeplb")) as f:
        doc = json.load(f)
    named = tmp_path / "named.json"
    named.write_text(json.dumps({**doc, "num_gpus": 3, "layer_ids": [5, 6]}))
    _refused(capsys, store, redis_url, str(named), 2, "2 layer rows (model layers 5-6, none for [0])")


def test_a_plan_that_routes_to_a_non_member_is_refused(capsys, store, redis_url, tmp_path):
    from fdeplb.machines.tables import MemberState

    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.member(1), MemberState.SUSPECT, version=1)  # as a lapsed heartbeat would
    code, out, err = run_cli(capsys, "rank", "exclude", "--rank", "1", "--redis-url", store.url,
                             "--cluster", store.cluster)
    assert code == 0 and "SUSPECT -> EXCLUDED" in out, out + err
    # experts 2 and 3 only on rank 1 (EXCLUDED): they would have no route
    _refused(capsys, store, redis_url, _plan_file(tmp_path, [[0, 1, 2, 3, 0, 1]], 4), 2,
             "without a replica on an ACTIVE member")


def test_without_a_coordinator_a_good_plan_changes_nothing(capsys, store, redis_url, tmp_path):
    _refused(capsys, store, redis_url, _plan_file(tmp_path, [[2, 3, 0, 1, 2, 3]], 4), 3,
             "no coordinator holds the lease")


# ---- the offline workflow: record -> plan -> validate -> commit (README "Offline plans") -------------------------
@pytest.mark.slow
def test_record_plan_validate_commit_end_to_end(redis_url, cluster_id, capsys, tmp_path):
    from fdeplb.placement import read_expert_load, read_placement

    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start(publish_interval_s=0.2)
        store = tc.store()
        wait_for(lambda: all(store.read_load(r) is not None for r in range(4)), 30, store, "every window published")
        flags = ("--redis-url", store.url, "--cluster", store.cluster)
        load_file, old_file, plan_file = (str(tmp_path / n) for n in ("load.json", "old.json", "plan.json"))
        code, out, err = run_cli(capsys, "load", "--export", load_file, *flags)  # record
        assert code == 0 and "wrote the load of ranks [0, 1, 2, 3]" in out, out + err
        summed = sum(store.read_load(r).expert_load for r in range(4))
        assert np.array_equal(read_expert_load(load_file).expert_load, summed)
        code, out, err = run_cli(capsys, "status", *flags, "--placement-out", old_file)
        assert code == 0, out + err
        code, out, err = run_cli(capsys, "rebalance", "--load", load_file, "--old", old_file, "--num-replicas", "20",
                                 "--num-gpus", "4", "--policy", "balanced", "--out", plan_file)  # plan
        assert code == 0 and "gate: goes on" in out, out + err  # validate: the gain gate a round applies
        code, out, err = _rearrange(capsys, store, "--plan", plan_file, "--wait", "--timeout", "60")  # commit
        assert code == 0 and "round 1: rearranged" in out, out + err
        planned = read_placement(plan_file, num_logical_experts=16, num_gpus=4).placement.phy2log
        assert np.array_equal(store.current_placement().phy2log, planned)


def test_load_export_without_a_window_is_refused(capsys, store, tmp_path):
    code, _, err = run_cli(capsys, "load", "--export", str(tmp_path / "load.json"), "--redis-url", store.url,
                           "--cluster", store.cluster)
    assert code == 3 and "has published a load window yet" in err and not (tmp_path / "load.json").exists()
    # QA: step 1 of the offline workflow on a fresh cluster: the error says what publishes a window
    assert "publishes its window when a round collects" in err and "run a round first (`fdeplb rearrange" in err


def test_every_file_the_offline_workflow_writes_named_gz_is_gzip_and_reads_back(capsys, store, tmp_path):
    """``load --export``, ``status --placement-out`` and ``rebalance --out`` named ``*.gz`` write gzip, which the
    readers (``rebalance --load/--old``, ``rearrange --plan``) expect of that name."""
    from fdeplb.placement import read_expert_load, read_placement

    for rank in range(3):
        store.publish_load(rank, 0, np.array([[4 + rank, 3, 2, 1]], dtype=np.int64))
    flags = ("--redis-url", store.url, "--cluster", store.cluster)
    load, old, plan = (tmp_path / n for n in ("l.json.gz", "o.json.gz", "p.json.gz"))
    assert run_cli(capsys, "load", "--export", str(load), *flags)[0] == 0
    assert run_cli(capsys, "status", *flags, "--placement-out", str(old))[0] == 0
    code, out, err = run_cli(capsys, "rebalance", "--load", str(load), "--old", str(old), "--num-replicas", "6",
                             "--num-gpus", "3", "--out", str(plan))
    assert code == 0, out + err
    assert all(f.read_bytes()[:2] == b"\x1f\x8b" for f in (load, old, plan))  # gzip's magic
    assert read_expert_load(load).expert_load.tolist() == [[15, 9, 6, 3]]
    assert read_placement(old).placement.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert read_placement(plan, num_logical_experts=4, num_gpus=3).placement.phy2log.shape == (1, 6)


@pytest.mark.parametrize("fmt, name", [("trtllm", "x.json"), ("sglang", "x.yaml"), ("fdeplb", "x.yml.gz")])
def test_status_and_rebalance_follow_one_rule_for_a_placement_files_name(capsys, store, tmp_path, fmt, name):
    """A trtllm placement is YAML, named *.yaml; the others are JSON, never named *.yaml (it would read back as
    YAML): ``status --placement-out`` and ``rebalance --out`` refuse the same names the same way, writing nothing."""
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"counts": [[5, 3, 2, 1]]}))
    out_file = tmp_path / name
    words = f"{'an' if fmt == 'fdeplb' else 'a'} {fmt} placement is {'YAML' if fmt == 'trtllm' else 'JSON'}"
    code, out, err = run_cli(capsys, "status", "--redis-url", store.url, "--cluster", store.cluster,
                             "--placement-out", str(out_file), "--format", fmt)
    assert code == 2 and out == "" and err.startswith(f"error: --placement-out {out_file}: {words}")
    code, out, err = run_cli(capsys, "rebalance", "--load", str(load), "--num-replicas", "6", "--num-gpus", "3",
                             "--out", str(out_file), "--format", fmt)
    assert code == 2 and out == "" and err.startswith(f"error: --out {out_file}: {words}")
    assert not out_file.exists()


def test_load_export_named_yaml_is_refused_before_reading_the_cluster(capsys, store, tmp_path):
    code, _, err = run_cli(capsys, "load", "--export", str(tmp_path / "load.yaml"), "--redis-url", store.url,
                           "--cluster", store.cluster)
    assert code == 2 and "a load dump is JSON" in err and not (tmp_path / "load.yaml").exists()


def test_an_operator_plan_is_tried_by_one_round_only(store, redis_url):
    """FREE requests the round an operator's plan waits for; once a round after the one it was supplied in has
    ended without committing it (an abort), it is dropped, never retried in a loop."""
    from fdeplb.machines.tables import ClusterState
    from fdeplb.orchestration.rollback import request_supplied, supply_operator_plan

    supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "test")
    assert request_supplied(store) and store.read_cluster().requested == 1
    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.FREE, version=9, round="1", requested="1")  # round 1 aborted
    assert not request_supplied(store) and store.supplied_placement() is None


def test_round_cancel_withdraws_an_operator_plan_with_its_request(capsys, store):
    """`fdeplb round cancel` of the round an operator's plan waits for (the way out after a Ctrl-C of `rearrange
    --plan --wait`) drops the plan in the same transaction: FREE's entry work does not request it again."""
    from fdeplb.orchestration.rollback import request_supplied, supply_operator_plan

    digest = supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "plan.json")
    store.request_round("operator")
    code, out, err = run_cli(capsys, "round", "cancel", "--redis-url", store.url, "--cluster", store.cluster)
    assert code == 0 and "round 1: request withdrawn" in out and f"plan {digest}" in out, out + err
    assert store.supplied_placement() is None and not request_supplied(store)
    note = [a for a in store.audit() if a["trigger"] == "request_cancelled"][-1]
    assert json.loads(note["detail"])["dropped_supplied"]["plan_id"] == digest


def test_a_second_plan_while_one_waits_names_the_waiting_plan(store):
    from fdeplb.errors import StateError
    from fdeplb.orchestration.rollback import supply_operator_plan

    digest = supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "first.json")
    with pytest.raises(StateError, match=f"operator: plan {digest} supplied from first.json\\): `fdeplb round cancel`"):
        supply_operator_plan(store, np.array([[3, 2, 1, 0, 3, 2]]), "second.json")


def test_round_cancel_leaves_a_rollback_waiting(store):
    from fdeplb.orchestration.operator import cancel_request
    from fdeplb.orchestration.rollback import request_supplied

    store.supply_placement(np.array([[2, 3, 0, 1, 2, 3]]), reasons.supplied_round(
        "rollback", 0, "", "probe_mismatch").detail["supplied"])
    store.request_round("rollback")
    assert cancel_request(store, by="test") == (1, "")
    assert store.supplied_placement() is not None and request_supplied(store)


def test_ctrl_c_during_rearrange_plan_wait_says_the_plan_waits_and_how_to_withdraw_it(capsys, store, monkeypatch,
                                                                                     tmp_path):
    """Ctrl-C ends the wait, not the round: the plan stays supplied and the message says how to withdraw it."""
    from fdeplb.cli import operate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(operate, "_wait_for_lease", lambda store, timeout_s: "coordinator-under-test")
    monkeypatch.setattr(operate, "wait_for_round", interrupted)
    plan = np.array([[2, 3, 0, 1, 2, 3]])
    code, out, err = _rearrange(capsys, store, "--plan", _plan_file(tmp_path, plan, 4), "--wait", "--timeout", "5")
    assert code == 130 and store.supplied_placement() is not None, out + err
    assert f"round 1 still goes on to the plan with routing digest {routing_digest(plan)}" in err, err
    assert "fdeplb round cancel" in err, err


def test_ctrl_c_during_rearrange_commit_wait_prints_the_same_line(capsys, store, monkeypatch):
    """QA: `rearrange --commit ID --wait` exited 130 on Ctrl-C without a word; now the line the --plan path prints:
    the round goes on, to that plan, and `round abort` ends it before its commit point (no request to cancel)."""
    from fdeplb.cli import operate
    from fdeplb.store import Store

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "request_commit", lambda self, plan_id, by: None)  # as for a staged round
    monkeypatch.setattr(operate, "wait_for_round", interrupted)
    code, out, err = _rearrange(capsys, store, "--commit", "0123abcd", "--wait", "--timeout", "5")
    flags = f"--redis-url {store.url} --cluster {store.cluster}"
    assert code == 130 and "commit of plan 0123abcd requested" in out, out + err
    assert err.strip() == (f"interrupted: round 0 still goes on to plan 0123abcd; `fdeplb round abort {flags}` ends "
                           f"it before its commit point"), err


def test_a_round_that_starts_while_a_plan_is_supplied_refuses_it(store, redis_url):
    # QA: the FREE check and the write were two steps; a round passing PLANNING in between left the plan to be
    # dropped later. Now the check runs again inside the WATCHed write: a round started meanwhile refuses it.
    from fdeplb.errors import StateError
    from fdeplb.orchestration.rollback import supply_operator_plan

    raw = RawRedis(redis_url, store.cluster)
    plan = np.array([[0, 1, 2, 3, 2, 3]] * store.read_config().num_layers, dtype=np.int64)
    real_read = store.supplied_placement
    started = []

    def a_round_starts_meanwhile():  # the check reads the waiting placement: a coordinator moves on right then
        if not started:
            started.append(True)
            raw.r.hset(raw.keys.rearrange, "state", "COLLECTING")
        return real_read()

    store.supplied_placement = a_round_starts_meanwhile
    with pytest.raises(StateError, match="is in COLLECTING"):
        supply_operator_plan(store, plan, "race")
    store.supplied_placement = real_read
    assert started and store.supplied_placement() is None


def test_a_request_while_a_plan_is_staged_says_its_round_goes_to_that_plan(capsys, store, monkeypatch, tmp_path):
    """QA: a plain `rearrange` while an operator's plan waits coalesces into the plan's round, which goes to that
    plan and plans no load: the line says so (it said only that the round "will serve this request")."""
    from fdeplb.cli import operate
    from fdeplb.orchestration.rollback import supply_operator_plan

    monkeypatch.setattr(operate, "_wait_for_lease", lambda store, timeout_s: "coordinator-under-test")
    code, out, err = _rearrange(capsys, store)  # nothing staged: the line as before
    assert code == 0 and out.startswith("round 1 will serve this request; coordinator coordinator-under-test"), out
    store.withdraw_request(None, trigger="request_cancelled", actor="test", reason="test")
    digest = supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "staged.json")
    store.request_round("operator plan")
    code, out, err = _rearrange(capsys, store)
    assert code == 0, out + err
    assert out.startswith(f"round 1 will serve this request, but it goes to the placement supplied for it, not to "
                          f"a plan of the load: operator: plan {digest} supplied from staged.json (`fdeplb round "
                          f"cancel` withdraws both); coordinator coordinator-under-test"), out


def test_a_plan_with_a_reason_the_request_refuses_supplies_nothing(capsys, store, redis_url, monkeypatch, tmp_path):
    """QA: `rearrange --plan FILE --reason TEXT` with a control character in TEXT exited 2 at the request, after
    the plan was supplied (left waiting with no request); now refused first, nothing written."""
    from fdeplb.cli import operate

    monkeypatch.setattr(operate, "_wait_for_lease", lambda store, timeout_s: "coordinator-under-test")
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    code, out, err = _rearrange(capsys, store, "--plan", _plan_file(tmp_path, [[2, 3, 0, 1, 2, 3]], 4),
                                "--reason", "bad\x1b[2Jreason")
    assert code == 2 and "control characters" in err and out == "", out + err
    assert raw.snapshot() == before


def test_a_supplied_placement_whose_facts_hold_a_control_character_is_refused(store, redis_url):
    """The facts make the round's request reason (`fdeplb rearrange --plan` keeps the file's path in them): one
    with a newline could never be requested (the coordinator's FREE work failed every pass); refused, nothing
    written."""
    from fdeplb.errors import InputError
    from fdeplb.orchestration.rollback import supply_operator_plan

    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    with pytest.raises(InputError, match="why 'plan\\\\n.json' holds a control character"):
        supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "plan\n.json")
    assert raw.snapshot() == before


def test_a_commit_of_a_plan_committed_already_says_so(capsys, store, redis_url):
    """QA: of concurrent `rearrange --commit X` (and the HTTP commit) the losers said "cluster is FREE with plan
    X; a commit is only accepted in LOAD_SUCC for the staged plan (asked: X)", as if X were not the one staged."""
    from fdeplb.machines.tables import ClusterState

    store.change_config({"cordoned": True}, actor="test")
    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.FREE, version=7, round="1", requested="1", plan_id="0123abcd")
    raw.r.hset(raw.keys.placement, "plan_id", "0123abcd")  # the round committed it
    before = raw.snapshot()
    code, out, err = _rearrange(capsys, store, "--commit", "0123abcd")
    assert code == 3 and "plan 0123abcd is committed already" in err and "nothing to commit" in err, out + err
    code, out, err = _rearrange(capsys, store, "--commit", "feedbeef")  # another plan: the refusal as before
    assert code == 3 and "a commit is only accepted in LOAD_SUCC for the staged plan (asked: 'feedbeef')" in err
    assert raw.snapshot() == before


def test_a_request_while_a_supplied_round_is_in_flight_names_no_cancel(capsys, store, monkeypatch, redis_url):
    """The plan's round has started (here staged in LOAD_SUCC): `round cancel` no longer withdraws it."""
    from fdeplb.cli import operate
    from fdeplb.machines.tables import ClusterState
    from fdeplb.orchestration.rollback import supply_operator_plan

    monkeypatch.setattr(operate, "_wait_for_lease", lambda store, timeout_s: "coordinator-under-test")
    digest = supply_operator_plan(store, np.array([[2, 3, 0, 1, 2, 3]]), "staged.json")
    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.LOAD_SUCC, version=4, round="1", requested="1", plan_id="p1")
    code, out, err = _rearrange(capsys, store)
    assert code == 0 and f"operator: plan {digest} supplied from staged.json; coordinator" in out, out + err
    assert "round cancel" not in out


def test_a_stored_supplied_placement_whose_facts_hold_a_control_character_is_corrupt_and_dropped(store, redis_url):
    """One written before the writer refused it (the QA wedge: FREE's entry work failed every pass requesting its
    round with that text) reads as corrupt: the coordinator's FREE work drops it once, then goes on."""
    from fdeplb.errors import CorruptRecordError
    from fdeplb.orchestration.rollback import request_supplied
    from fdeplb.store import arrays

    raw = RawRedis(redis_url, store.cluster)
    facts = {"kind": "operator", "undoes": 0, "plan_id": "7264444d4688326f", "why": "POST by http:op (a\u0000b)"}
    raw.r.hset(raw.keys.supplied_placement, mapping={**arrays.encode("phy2log", np.array([[2, 3, 0, 1, 2, 3]])),
                                                     "facts": json.dumps(facts)})
    with pytest.raises(CorruptRecordError, match="why .* holds a control character"):
        store.supplied_placement()
    with pytest.raises(CorruptRecordError, match="control character .*; dropped, the next round is planned from"):
        request_supplied(store)  # the pass that meets it: dropped, the error raised once (an audited alarm)
    assert store.supplied_placement() is None and not request_supplied(store)
    assert store.read_cluster().requested == 0  # no round requested with the bad text
