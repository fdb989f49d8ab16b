"""Replaying an exported audit through the tables: a real round replays and its plans reproduce; a tampered export
fails at the first inconsistency with a typed error naming the line."""

from __future__ import annotations

import json
import uuid

import pytest

from fdeplb.cli import main
from fdeplb.recording import audit_dict
from fdeplb.errors import InputError, exit_code
from fdeplb.replay import ReplayError, check_plans, parse_lines, replay, replay_file
from tests.helpers import RawRedis, thread_cluster, wait_for
from tests.replay.helpers import PLAN


@pytest.fixture
def lines(fired) -> list[str]:
    return [json.dumps(audit_dict(e)) for e in fired.iter_audit()]


def test_fired_round_replays(lines):
    report = replay(parse_lines(lines))
    assert (report.records, report.transitions, report.skipped) == (14, 14, 0)
    assert {k: (s.state, s.code, s.version) for k, s in report.final.items()} == {
        "cluster": ("FREE", 0, 7), "rank:0": ("IDLE", 0, 5), "weights:0": ("NORMAL", 0, 2)}
    assert [p.plan_id for p in report.plans] == [PLAN]


def test_alarms_join_the_chain_and_are_skipped(fired):
    rec = fired.read_cluster()
    fired.append_alarm(rec, actor="test", reason="a test alarm")
    lines = [json.dumps(audit_dict(e)) for e in fired.iter_audit()]
    report = replay(parse_lines(lines))
    assert (report.transitions, report.skipped, report.chained) == (14, 1, 15)
    assert report.chain == fired.audit_head()
    forged = json.loads(lines[-1])
    forged.update({"from": "DONE", "to": "DONE"})  # an alarm for a state the cluster was not in
    with pytest.raises(ReplayError, match=r"line 15 .*alarm for cluster DONE v7, but the cluster is FREE v7"):
        replay(parse_lines(lines[:-1] + [json.dumps(forged)]))


def tampered(lines: list[str], index: int, **changes) -> list[str]:
    rec = json.loads(lines[index])
    rec.update(changes)
    return lines[:index] + [json.dumps(rec)] + lines[index + 1:]


@pytest.mark.parametrize("index,changes,message", [
    (2, {"to": "LOAD_SUCC"}, r"line 3 \(audit id .*\): cluster load goes PLANNING -> LOADING per the table, but "
                             r"the record says -> LOAD_SUCC"),
    (4, {"version": 3}, r"line 5 .*rank:0 version gap: v1 -> v3 \(expected v2\)"),
    (1, {"from": "FREE"}, r"line 2 .*cluster is COLLECTING v1 in the replay, but the record says from FREE"),
    (0, {"trigger": "commit"}, r"line 1 .*trigger 'commit' is not allowed from state FREE"),
    (0, {"machine": "gpu"}, r"line 1 .*unknown machine 'gpu'"),
    (3, {"key": "cluster"}, r"line 4 .*key cluster is a cluster record, not rank"),
    (3, {"id": "1-0"}, r"line 4 .*out of stream order"),
])
def test_tampered_export_fails_at_first_inconsistency(lines, index, changes, message):
    with pytest.raises(ReplayError, match=message):
        replay(parse_lines(tampered(lines, index, **changes)))


def test_dropped_record_is_caught(lines):
    kept = lines[:4] + lines[5:]  # rank:0 staged (v2) dropped
    with pytest.raises(ReplayError, match=r"line 5 .*chain .* is not the hash of this record and its predecessor's "
                                          r"chain .*a record before it was dropped"):
        replay(parse_lines(kept))
    # without the chains (an export of a stream older than them) the records themselves give it away
    bare = [json.dumps({k: v for k, v in json.loads(x).items() if k != "chain"}) for x in kept]
    with pytest.raises(ReplayError, match=r"line 7 .*rank:0 is LOADING v1 in the replay, but the record says from "
                                          r"LOADED"):
        replay(parse_lines(bare))


@pytest.mark.parametrize("bad,message", [
    ("{not json", r"line 3: not JSON"),
    ("[1, 2]", r"line 3: expected a JSON object, got list"),
    ('{"machine": "cluster"}', r"line 3: audit record without key, from, to, trigger, version"),
])
def test_bad_lines_fail_with_their_number(lines, bad, message):
    with pytest.raises(ReplayError, match=message) as err:
        replay(parse_lines(lines[:2] + [bad] + lines[2:]))
    assert isinstance(err.value, InputError) and exit_code(err.value) == 1  # a damaged recording: a verdict


def test_made_up_plan_does_not_reproduce(fired, lines):
    report = replay(parse_lines(lines))
    with pytest.raises(ReplayError, match=rf"line 3 .*plan {PLAN} of round 1: \(snapshot, old placement, policy, "
                                          r"topology\) hash to [0-9a-f]{16}"):
        check_plans(fired, report)
    raw = RawRedis(fired.url, fired.cluster)
    raw.r.delete(raw.keys.plan(PLAN))
    with pytest.raises(ReplayError, match="not stored"):
        check_plans(fired, report)


def test_replay_cli_on_a_fired_round(lines, tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    path.write_text("\n".join(lines) + "\n")  # records only, no header (no plans to recompute without Redis)
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cluster      FREE [0]  v7  (7 transitions, last release)" in out
    assert ("replay OK: 14 transitions of 3 records, 0 notes (alarms, skips, start refusals), chain verified over "
            "14 records, 1 plans") in out
    path.write_text("\n".join(tampered(lines, 6, version=9)) + "\n")
    assert main(["replay", str(path)]) == 1  # a mismatch is a verdict (exit 1), not a usage error
    assert "error: line 7 " in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: recording not found" in capsys.readouterr().err
    assert main(["replay", str(path), "--redis-url", "redis://127.0.0.1:1"]) == 2  # --cluster missing


def test_real_round_exports_replays_and_reproduces_its_plan(redis_url, tmp_path, capsys):
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with thread_cluster(redis_url, cluster, tmp_path) as tc:
        store = tc.store()
        tc.start_agents()
        tc.start_coordinator()
        store.request_round()
        wait_for(lambda: (rec := store.read_cluster()).state == "FREE"  # one read: no race
                 and rec.round == 1
                 and all(store.read_rank(r).state == "IDLE" for r in range(4)),
                 60, store, "round 1 over")
        tc.stop()
        path = tmp_path / "audit.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster, "--export", str(path)]) == 0
        capsys.readouterr()
        report = replay_file(path)
        assert report.final["cluster"].state == "FREE" and report.final["cluster"].version == 7
        assert all(report.final[f"rank:{r}"].state == "IDLE" for r in range(4))
        plan_id = store.current_placement().plan_id
        assert check_plans(store, report) == [plan_id]
        assert main(["replay", str(path), "--redis-url", redis_url, "--cluster", cluster]) == 0
        assert "1 plans recomputed and identical" in capsys.readouterr().out
        # a stored plan that the planner does not produce is caught
        raw = RawRedis(redis_url, cluster)
        new = store.plan_phy2log(plan_id)
        raw.r.hset(raw.keys.plan(plan_id), "new_phy2log", new[:, ::-1].copy().tobytes())
        assert main(["replay", str(path), "--redis-url", redis_url, "--cluster", cluster]) == 1
        assert "gives a different new_phy2log" in capsys.readouterr().err


# ---- the audited reasons a replay reads back -----------------------------------------------------------------------
def test_reasons_carry_their_facts_as_detail_and_derive_the_text():
    import json

    from fdeplb.rounds import reasons

    stale = {3: 2412, 1: 5000}
    refused = reasons.refusal(stale)
    assert refused.text == "start refused: stale ranks 1 (heartbeat 5000 ms ago), 3 (heartbeat 2412 ms ago)"
    assert refused.detail == {"stale_ranks": [{"ep_rank": 1, "heartbeat_age_ms": 5000},
                                              {"ep_rank": 3, "heartbeat_age_ms": 2412}]}
    record = {"reason": "forged text", "detail": json.dumps(refused.detail)}
    assert reasons.stale_ranks(record) == stale  # the structure is read, never the text, when it is there
    assert reasons.stale_ranks({"reason": refused.text}) == stale  # schema 1: the text alone
    beats = {0: (12, 2000), 1: (7, 0)}
    fresh = reasons.fresh(beats)
    assert fresh.text == "start after a refusal: heartbeats 0 12 ms ago (ttl 2000 ms), 1 7 ms ago (no ttl)"
    assert reasons.heartbeats({"reason": "", "detail": json.dumps(fresh.detail)}) == beats
    assert reasons.heartbeats({"reason": fresh.text}) == beats
    for bad in ("", "start refused: stale ranks ", "start refused: stale ranks one (heartbeat 5 ms ago)",
                "start after a refusal: heartbeats 0 12 ms ago"):
        assert reasons.stale_ranks({"reason": bad}) is None and reasons.heartbeats({"reason": bad}) is None
    for corrupt in ("[1, 2]", "not json", "7"):
        with pytest.raises(ValueError):
            reasons.stale_ranks({"reason": "", "detail": corrupt})
    assert reasons.gate(0.5, 0.7, 3, 0.1) is None  # moves experts and gains more than min_gain: the round goes on
    assert reasons.gate(0.5, 0.55, 3, 0.1) == ("gated: skipped: planned gain 0.0500 <= min_gain 0.1 (balancedness "
                                               "0.5000 -> 0.5500, 3 moved experts)")
    assert reasons.gate(0.5, 0.7, 0, 0.0).startswith("gated: skipped: the plan moves no expert")
    external = reasons.external_commit("")
    assert external.text == "external commit requested by operator" and external.detail == {"requested_by": "operator"}
    assert reasons.requested_by({"reason": external.text}) == "operator"
    assert reasons.requested_by({"reason": "", "detail": '{"requested_by":"http"}'}) == "http"
    assert reasons.requested_by({"reason": "something else"}) is None
