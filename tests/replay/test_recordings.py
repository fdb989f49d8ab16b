"""Recordings of tests/replays/ (produced by tests/replays/generate.py from real runs) replay with no Redis; mutated
copies fail with their reason; the what-if report runs on each; --until and --into; the audit chain of the live
scripts; ``fdeplb audit --follow``."""

from __future__ import annotations

import json
import re
import threading

import pytest

from fdeplb.cli import main
from fdeplb.recording import audit_dict
from fdeplb.replay import chain_of, replay_file
from fdeplb.store import Store
from fdeplb.store import scripts
from tests.replay.helpers import HAPPY, RECORDINGS, REPLAYS, SCHEMA1, fire_round, index_of, lines_of, rechain, \
    renumber


def test_every_scenario_has_a_recording():
    from tests.replays.generate import SCENARIOS

    assert {p.stem for p in RECORDINGS} == set(SCENARIOS) >= {"happy", "load_failed", "takeover", "gated_skip",
                                                              "stale_rank", "weights", "cordoned_http",
                                                              "membership", "weights_cancel"}


@pytest.mark.parametrize("path", RECORDINGS + SCHEMA1, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recording_replays_without_redis_and_whatif_runs(path, capsys):
    # no --redis-url: nothing here can reach a Redis
    assert main(["replay", str(path), "--policy", "balanced"]) == 0
    out = capsys.readouterr().out
    report = replay_file(path)
    assert report.chained == report.records > 0
    assert f"chain verified over {report.records} records" in out
    assert f"{len(report.plans)} plans recomputed and identical" in out
    if report.rounds:  # weights_cancel has weight requests only
        assert "what-if: policy balanced" in out
        assert re.search(r"^  1 +(committed|aborted)", out, re.M)
    else:
        assert "what-if: no round of the recording has a snapshot to replan" in out


def test_recordings_say_what_happened():
    happy, failed = replay_file(REPLAYS / "happy.jsonl"), replay_file(REPLAYS / "load_failed.jsonl")
    assert [r.outcome for r in happy.rounds] == ["committed"] and happy.placement_plan == happy.rounds[0].plan_id
    assert failed.rounds[0].outcome == "aborted" and "failed to load" in failed.rounds[0].reason
    assert failed.placement_plan == ""
    gated = replay_file(REPLAYS / "gated_skip.jsonl")
    assert gated.rounds[0].reason.startswith("gated:") and not gated.plans
    takeover = replay_file(REPLAYS / "takeover.jsonl")
    fences = [r["fence"] for r in takeover.audit if r["machine"] == "cluster"]
    assert len(set(fences)) == 2 and fences == sorted(fences, key=lambda f: int(f.split(":")[0]))


def test_later_recordings_say_what_happened():
    from fdeplb.rounds import reasons

    stale = replay_file(REPLAYS / "stale_rank.jsonl")
    refusal, start = stale.audit[0], stale.audit[1]
    assert refusal["trigger"] == "start_refused" and 1 in reasons.stale_ranks(refusal)
    beats = reasons.heartbeats(start)
    assert start["trigger"] == "start" and beats[1][0] <= beats[1][1]  # rank 1 fresh again, within its TTL
    assert [r.outcome for r in stale.rounds] == ["committed"]
    weights = replay_file(REPLAYS / "weights.jsonl")
    assert [r["trigger"] for r in weights.audit if r["key"] == "weights:1"] == [
        "clear", "cleared", "update", "update_failed", "update", "updated"]
    assert all(weights.final[f"weights:{r}"].state == "NORMAL" for r in range(2))
    updated = [r["plan_id"] for r in weights.audit if r["trigger"] == "updated"]
    assert updated and set(updated) == {weights.placement_plan} != {""}  # the round's placement, not the initial
    cordoned = replay_file(REPLAYS / "cordoned_http.jsonl")
    assert cordoned.header["config"]["cordoned"]
    (commit,) = [r for r in cordoned.audit if r["trigger"] == "commit"]
    assert commit["reason"] == "external commit requested by http"
    assert cordoned.placement_plan == commit["plan_id"]


def test_gated_round_numbers_are_recomputed(capsys):
    assert main(["replay", str(REPLAYS / "gated_skip.jsonl")]) == 0
    assert "1 gated rounds recomputed and identical" in capsys.readouterr().out


def drop_record(lines):
    """Drop a rank's ``staged`` record that another rank's record follows (so that only the chain can tell; which
    rank that is depends on the recorded run's interleaving)."""
    for i, rec in enumerate(lines[:-1]):
        after = lines[i + 1]
        if rec.get("trigger") == "staged" and after.get("key", "").startswith("rank:") and after["key"] != rec["key"]:
            del lines[i]
            return lines
    raise AssertionError("no staged record followed by another rank's record")


def swap_records(lines):
    """Two neighbouring ``stage`` records of different ranks swapped: each still follows from its own rank's
    record, so only the order (stream ids, chain) gives it away."""
    i = next(i for i in range(len(lines) - 1)
             if lines[i].get("trigger") == lines[i + 1].get("trigger") == "stage")
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return lines


def edit_plan(lines):
    plan = lines[index_of(lines, type="plan")]
    data = plan["new_phy2log"]["data"]
    data[0], data[1] = data[1], data[0]
    return lines


def forge_fence(lines):
    lines[index_of(lines, key="cluster", trigger="commit")]["fence"] = "0:" + lines[1]["actor"]
    return rechain(lines)


def forge_load_succ(lines):
    """The cluster's LOAD_SUCC moved before the last rank's staged record (ids kept in order, chain recomputed)."""
    loaded = index_of(lines, key="cluster", trigger="loaded")
    last_staged = max(i for i, rec in enumerate(lines) if rec.get("trigger") == "staged")
    ids = [lines[i]["id"] for i in range(last_staged, loaded + 1)]
    moved = [lines[loaded]] + lines[last_staged:loaded]
    for rec, rid in zip(moved, ids):
        rec["id"] = rid
    lines[last_staged:loaded + 1] = moved
    return rechain(lines)


def edit_field(name, value):
    def edit(lines):
        lines[index_of(lines, key="cluster", trigger="load")][name] = value
        return lines
    return edit


def forge_rank(lines):
    rec = dict(lines[index_of(lines, key="rank:0", trigger="stage")], key="rank:99", version=1)
    lines.insert(index_of(lines, key="rank:0", trigger="stage"), rec)
    return rechain(lines)


def drop_plan_line(lines):
    del lines[index_of(lines, type="plan")]
    return lines


def move(lines, index: int, to: int, **changes):
    """Move the record at ``index`` to position ``to`` (after the pop), with ``changes``; renumbered, rechained."""
    lines.insert(to, dict(lines.pop(index), **changes))
    return renumber(lines)


def _set_detail(rec: dict, reason) -> None:
    """Write a forged :class:`~fdeplb.rounds.reasons.Reason` into ``rec`` as the coordinator would (text and
    detail together): a careful forger."""
    rec["reason"], rec["detail"] = reason.text, json.dumps(reason.detail, sort_keys=True, separators=(",", ":"))


def start_without_fresh_heartbeats(lines):
    start = lines[index_of(lines, key="cluster", trigger="start")]
    start["reason"] = ""
    start.pop("detail", None)
    return rechain(lines)


def start_with_old_heartbeat(lines):
    from fdeplb.rounds import reasons

    start = lines[index_of(lines, key="cluster", trigger="start")]
    beats = reasons.heartbeats(start)
    beats[1] = (5000, beats[1][1])
    _set_detail(start, reasons.fresh(beats))
    return rechain(lines)


def start_with_old_heartbeat_in_text(lines):  # schema 1: the text is all there is
    start = lines[index_of(lines, key="cluster", trigger="start")]
    start["reason"] = re.sub(r"(heartbeats |, )1 \d+ ms ago", r"\g<1>1 5000 ms ago", start["reason"])
    return rechain(lines)


def start_text_not_its_detail(lines):
    start = lines[index_of(lines, key="cluster", trigger="start")]
    start["reason"] = start["reason"].replace("ms ago", "ms  ago", 1)
    return rechain(lines)


def refusal_detail_not_json(lines):
    lines[index_of(lines, trigger="start_refused")]["detail"] = "{not json"
    return rechain(lines)


def refusal_mid_round(lines):
    refusal = lines.pop(index_of(lines, trigger="start_refused"))
    lines.insert(index_of(lines, key="cluster", trigger="load"), refusal)  # between plan and load
    lines[index_of(lines, trigger="start_refused")].update({"from": "PLANNING", "to": "PLANNING", "version": 2})
    return renumber(lines)


def refusal_of_a_stray_rank(lines):
    from fdeplb.rounds import reasons

    _set_detail(lines[index_of(lines, trigger="start_refused")], reasons.refusal({7: 9000}))
    return rechain(lines)


def clear_mid_round(lines):
    return move(lines, index_of(lines, key="weights:0", trigger="clear"), index_of(lines, key="cluster", trigger="plan"))


def normal_after_failed_update(lines):
    failed = index_of(lines, key="weights:1", trigger="update_failed")
    forged = dict(lines[failed], trigger="updated", **{"from": "CLEARED", "to": "NORMAL"}, reason="")
    forged["version"] += 1
    lines.insert(failed + 1, forged)
    return renumber(lines)


def failed_update_as_updated(lines):
    failed = lines[index_of(lines, key="weights:1", trigger="update_failed")]
    failed.update(trigger="updated", to="NORMAL", reason="")
    lines[index_of(lines, key="weights:1", trigger="update", version=5)]["from"] = "NORMAL"
    return rechain(lines)


def update_into_initial_placement(lines):
    last = max(i for i, rec in enumerate(lines) if rec.get("trigger") == "updated" and rec["key"] == "weights:0")
    lines[last]["plan_id"] = ""
    return rechain(lines)


def drop_commit(lines):
    del lines[index_of(lines, key="cluster", trigger="commit")]
    return lines


def commit_without_request(lines):
    commit = lines[index_of(lines, key="cluster", trigger="commit")]
    commit["reason"] = ""
    commit.pop("detail", None)
    return rechain(lines)


def commit_request_only_in_text(lines):  # the text claims a request the detail does not carry
    commit = lines[index_of(lines, key="cluster", trigger="commit")]
    commit["detail"] = "{}"
    return rechain(lines)


def gate_numbers_edited(lines):
    gated = lines[index_of(lines, key="cluster", trigger="abort")]
    gated["reason"] = re.sub(r"-> (\d\.\d{4})", lambda m: f"-> {float(m[1]) + 0.01:.4f}", gated["reason"])
    return rechain(lines)


def gate_figures_edited(lines):
    gated = lines[index_of(lines, key="cluster", trigger="abort")]
    detail = json.loads(gated["detail"])
    detail["gate"]["balancedness_after"] += 1e-9  # invisible in the 4-decimal text
    gated["detail"] = json.dumps(detail, sort_keys=True, separators=(",", ":"))
    return rechain(lines)


def min_gain_lowered(lines):
    lines[0]["config"]["min_gain"] = 0.0  # the header is outside the chain: checked against the gate's record
    return lines


MUTATIONS = {
    "dropped record": (drop_record, r"line \d+ .*chain .*a record before it was dropped"),
    "two records swapped": (swap_records, r"line \d+ .*chain .*dropped, reordered or forged"),
    "two records swapped, chain recomputed": (lambda lines: rechain(swap_records(lines)),
                                              r"line \d+ .*out of stream order"),
    "edited plan": (edit_plan, r"plan [0-9a-f]{16} of round 1: recomputing the 'deepseek' plan gives a different "
                               r"new_phy2log"),
    "forged fence": (forge_fence, r"line \d+ .*fence 0 goes backwards \(after fence 1\)"),
    "forged LOAD_SUCC": (forge_load_succ, r"line \d+ .*guard ranks_in\(LOADED, same plan\) did not hold when cluster "
                                          r"loaded committed: rank:\d is LOADING, not LOADED"),
    "edited actor": (edit_field("actor", "mallory"), r"line 4 .*fence 1:\S+ belongs to \S+, but the actor is "
                                                     r"'mallory'"),
    "edited reason": (edit_field("reason", "nothing to see"), r"line 4 .*chain .*this one was edited"),
    "edited timestamp": (edit_field("ts_ms", 1), r"line 4 .*chain .*this one was edited"),
    "forged rank": (forge_rank, r"line \d+ .*'rank:99' is not a rank record of this cluster \(ranks 0..3\)"),
    "dropped plan line": (drop_plan_line, r"line 1: the header lists plan [0-9a-f]{16}, but the recording has no "
                                          r"such plan line"),
    # (a) a stale rank refusing a start
    "stale_rank: start over a stale rank": (start_without_fresh_heartbeats, r"line 3 .*cluster start over stale "
                                            r"rank 1 \(start refused at line 2 .*\): the start shows no heartbeat"),
    "stale_rank: start over an old heartbeat": (start_with_old_heartbeat, r"line 3 .*cluster start over stale rank "
                                                r"1 .*its heartbeat 5000 ms old \(ttl 2000 ms\)"),
    "stale_rank: start text not what its detail says": (start_text_not_its_detail, r"line 3 .*reason .* is not what "
                                                        r"its detail says"),
    "stale_rank: refusal detail not JSON": (refusal_detail_not_json, r"line 2 .*detail is not what a start_refused "
                                                                     r"record carries"),
    "schema1/stale_rank: start over an old heartbeat": (start_with_old_heartbeat_in_text, r"line 3 .*cluster start "
                                                        r"over stale rank 1 .*its heartbeat 5000 ms old"),
    "stale_rank: refusal mid-round": (refusal_mid_round, r"line 4 .*start_refused while the cluster is PLANNING"),
    "stale_rank: refusal of a stray rank": (refusal_of_a_stray_rank, r"line 2 .*start_refused names ranks \[7\]; "
                                                                    r"the cluster has ranks 0..1"),
    # (b) a weight clear and update
    "weights: clear while a round is past FREE": (clear_mid_round, r"line 3 .*guard cluster_in\(FREE\) did not hold "
                                                  r"when weights:0 clear committed: cluster is COLLECTING"),
    "weights: NORMAL after a failed update": (normal_after_failed_update, r"line \d+ .*trigger 'updated' is not "
                                                                          r"allowed from state CLEARED"),
    "weights: failed update forged as updated": (failed_update_as_updated, r"line \d+ .*weights:1 updated into "
                                                 r"placement initial, but the cluster's current placement is "
                                                 r"[0-9a-f]{16}"),
    "weights: update into the initial placement": (update_into_initial_placement, r"line \d+ .*weights:0 updated "
                                                   r"into placement initial"),
    # (c) a cordoned round committed over HTTP
    "cordoned_http: dropped commit": (drop_commit, r"line \d+ .*guard cluster_in\(SWAPPING, same plan\) did not "
                                                   r"hold when rank:\d swap committed: cluster is LOAD_SUCC"),
    "cordoned_http: commit without a request": (commit_without_request, r"line \d+ .*cluster commit of a cordoned "
                                                                        r"cluster without an external request"),
    "cordoned_http: request only in the text": (commit_request_only_in_text, r"line \d+ .*cluster commit of a "
                                                                             r"cordoned cluster without an external"),
    # a gated skip
    "gated_skip: figures edited in the detail": (gate_figures_edited, r"line 4 .*gated round 1 records the gate's "
                                                                      r"figures .*; recomputing"),
    "schema1/gated_skip: numbers edited": (gate_numbers_edited, r"line 4 .*gated round 1 says .*; recomputing its "
                                                                r"'deepseek' plan gives 'gated: skipped: "),
    "gated_skip: numbers edited": (gate_numbers_edited, r"line 4 .*gated round 1 says .*; recomputing its 'deepseek' "
                                                        r"plan gives 'gated: skipped: "),
    "gated_skip: min_gain lowered": (min_gain_lowered, r"line 1: the header's configuration has min_gain 0.0 for "
                                                       r"round 1, but its gate \(at line 4 .*\) judged with min_gain 1.0"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_recording_fails_with_its_reason(name, tmp_path, capsys):
    mutate, reason = MUTATIONS[name]
    recording, sep, _ = name.partition(": ")
    path = tmp_path / "mutated.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in mutate(lines_of(recording if sep else "happy"))) + "\n")
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.search(reason, err), err


def test_rechained_copy_of_a_good_recording_still_replays(tmp_path):
    """The forgeries above are caught by the records' checks, not only because their chain broke."""
    path = tmp_path / "same.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in rechain(lines_of())) + "\n")
    assert replay_file(path).transitions == replay_file(HAPPY).transitions


# ---- --until, --into -----------------------------------------------------------------------------------------------
def test_until_prints_the_state_at_that_record(capsys):
    assert main(["replay", str(HAPPY), "--until", "3"]) == 0
    out = capsys.readouterr().out
    assert "state after 3:" in out and "cluster      LOADING [1]  v3" in out
    loaded_id = next(x["id"] for x in lines_of() if x.get("trigger") == "loaded")
    assert main(["replay", str(HAPPY), "--until", loaded_id]) == 0
    out = capsys.readouterr().out
    assert "cluster      LOAD_SUCC [2]  v4" in out and "rank:0       LOADED [1]  v2" in out
    assert main(["replay", str(HAPPY), "--until", "99"]) == 2
    assert main(["replay", str(HAPPY), "--until", "nope"]) == 2


def test_into_rebuilds_a_new_cluster_and_refuses_an_existing_one(redis_url, cluster_id, tmp_path, capsys):
    assert main(["replay", str(HAPPY), "--into", redis_url, "--cluster", cluster_id]) == 0
    store = Store(redis_url, cluster_id)
    try:
        report = replay_file(HAPPY)
        rec = store.read_cluster()
        assert (rec.state, rec.version, rec.round) == ("FREE", 7, 1)
        assert store.current_placement().plan_id == report.placement_plan
        assert store.read_rank(2).version == 5 and store.audit_head() == report.chain
        # the rebuilt cluster exports a recording that replays the same
        again = tmp_path / "again.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(again)]) == 0
        assert main(["replay", str(again)]) == 0
        capsys.readouterr()
        assert main(["replay", str(HAPPY), "--into", redis_url, "--cluster", cluster_id]) == 3
        assert "exists" in capsys.readouterr().err
        assert main(["replay", str(HAPPY), "--into", redis_url]) == 2  # --cluster missing
    finally:
        store.delete_cluster()


# ---- the chain in the live scripts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script,keys,argv", [("commit", scripts.COMMIT_KEYS, scripts.COMMIT_ARGV),
                                              ("audit", scripts.AUDIT_KEYS, scripts.AUDIT_ARGV),
                                              ("lease", scripts.LEASE_KEYS, scripts.LEASE_ARGV)])
def test_lua_headers_name_the_slots_scripts_py_lays_out(script, keys, argv):
    text = scripts.script_text(script)
    assert tuple(re.findall(r"^-- KEYS\[\d+\]\s+(\w+)", text, re.M)) == keys
    assert tuple(re.findall(r"^-- ARGV\[\d+\]\s+(\w+)", text, re.M)) == argv


def test_live_chain_links_every_record(redis_url, cluster_id):
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.store import ClusterConfig
    import numpy as np

    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=1),
                 np.arange(4, dtype=np.int64).reshape(1, 4))
    try:
        fire_round(store)
        store.append_alarm(store.read_cluster(), actor="test", reason="alarm in the chain")
        chain = ""
        for entry in store.iter_audit():
            chain = chain_of(chain, audit_dict(entry))
            assert entry["chain"] == chain
        assert store.audit_head() == chain
    finally:
        store.delete_cluster()


# ---- audit --follow ------------------------------------------------------------------------------------------------
def test_audit_follow_prints_records_as_they_commit(redis_url, cluster_id, capsys):
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.store import ClusterConfig
    import numpy as np

    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=1),
                 np.arange(4, dtype=np.int64).reshape(1, 4))
    rc: list[int] = []
    follower = threading.Thread(target=lambda: rc.append(main(
        ["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--follow", "--json", "--limit", "14"])))
    try:
        follower.start()
        fire_round(store)  # 14 records, committed while the follower blocks on the stream
        follower.join(timeout=60)
        assert not follower.is_alive() and rc == [0]
        printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [p["id"] for p in printed] == [e.id for e in store.iter_audit()]
    finally:
        store.delete_cluster()


def test_whatif_table_keeps_a_long_policy_name_apart_from_the_columns():
    import io

    from fdeplb.cli.replay_view import print_whatif

    out = io.StringIO()
    print_whatif([{"round": 7, "outcome": "committed", "recorded_plan": "20f7ebf51d577116", "policy": "topology_aware",
                   "balancedness_before": 0.9098, "balancedness_recorded": 0.9999, "moved_recorded": 436,
                   "balancedness_new": 0.9999, "moved_new": 436}], out)
    header, row = out.getvalue().splitlines()[1:]
    assert header.split() == ["round", "outcome", "recorded", "plan", "before", "recorded", "moved", "topology_aware",
                              "moved"]
    assert header.index("topology_aware") + len("topology_aware") == row.index("0.9999 ", row.index("436")) + 6
