"""The replay's membership checks on real recordings (tests/replays/membership.jsonl and
weights_cancel.jsonl, from tests/replays/generate.py): each membership change raises the generation by exactly
one, every transition carries the generation in force, no committed placement routes to an EXCLUDED rank, and a
weight cancel only follows a withdrawal of a request no rank applied, back to the state it came from. Each check
has a mutation of a real recording, its chain recomputed and its header made to match, that the checks before issue
22 let through (the re-placement plan routed back to the lost rank is also caught later by its recomputation; the
routing check reports it first)."""

from __future__ import annotations

import json
import re

import pytest

from fdeplb.cli import main
from fdeplb.replay import replay_file
from tests.replay.helpers import REPLAYS, index_of, lines_of, rechain, renumber

MEMBERSHIP = REPLAYS / "membership.jsonl"


def test_the_membership_recording_shows_the_loss_the_exclusion_and_the_rejoin():
    report = replay_file(MEMBERSHIP)
    trail = [(r["trigger"], r["generation"], r["fence"] != "") for r in report.audit if r["key"] == "member:2"]
    assert trail == [("suspect", "1", True), ("exclude", "2", False), ("rejoin", "3", False),
                     ("admit", "4", False)]  # the coordinator suspects (fenced), the operator excludes
    assert [r.outcome for r in report.rounds] == ["committed", "committed"]
    replaced = report.stored_plans[report.rounds[0].plan_id]
    assert replaced.topology["live_ranks"] == [0, 1, 3] and replaced.generation == 2
    assert report.final["member:2"].state == "ACTIVE"
    assert json.loads(MEMBERSHIP.read_text().splitlines()[0])["start"]["generation"] == 0


def forge_header(lines):
    """The header (not in the chain) made to match the records, as a careful forger would: their count and range."""
    audit = [r for r in lines if r.get("type") == "audit"]
    lines[0]["contents"]["records"] = len(audit)
    lines[0]["range"].update(first_id=audit[0]["id"], last_id=audit[-1]["id"])
    return lines


def _member_line(lines, trigger):
    return index_of(lines, key="member:2", trigger=trigger)


def bump_generation(lines):
    plan = lines[index_of(lines, key="cluster", trigger="plan")]
    plan["generation"] = str(int(plan["generation"]) + 1)
    return rechain(lines)


def rejoin_by_two(lines):
    rejoin = lines[_member_line(lines, "rejoin")]
    rejoin["generation"] = str(int(rejoin["generation"]) + 1)
    return rechain(lines)


def start_under_an_older_generation(lines):
    second = [i for i, r in enumerate(lines) if r.get("key") == "cluster" and r.get("trigger") == "start"][-1]
    lines[second]["generation"] = str(int(lines[second]["generation"]) - 1)
    return rechain(lines)


def drop_membership_record(lines):
    del lines[_member_line(lines, "admit")]  # rank 2 stays REJOINING: nothing but the generation tells
    return forge_header(rechain(lines))


def membership_without_generation(lines):
    del lines[_member_line(lines, "exclude")]["generation"]
    return rechain(lines)


def route_to_the_excluded_rank(lines):
    """The re-placement plan's new_phy2log put back to its old one: experts 6 and 7 routed to rank 2 only."""
    replaced = lines[index_of(lines, key="cluster", trigger="commit")]["plan_id"]
    plan = lines[index_of(lines, type="plan", plan_id=replaced)]
    plan["new_phy2log"] = plan["old_phy2log"]
    return lines


def exclude_a_second_rank_mid_round(lines):
    """A forged exclusion of rank 1 (operator: suspect + exclude, unfenced) between LOAD_SUCC and the commit, every
    later generation renumbered and the chain recomputed: each record then follows from the ones before it, but
    the committed plan still routes rank 1's experts to rank 1."""
    at = index_of(lines, key="cluster", trigger="commit")
    forged = [dict(lines[_member_line(lines, "exclude")], key="member:1", version=v, trigger=t, generation=str(g),
                   **{"from": f, "to": to}) for v, t, f, to, g in
              ((1, "suspect", "ACTIVE", "SUSPECT", 3), (2, "exclude", "SUSPECT", "EXCLUDED", 4))]
    for rec in lines[at:]:
        if rec.get("type") == "audit" and rec.get("generation", "") != "":
            rec["generation"] = str(int(rec["generation"]) + 2)
    lines[at:at] = forged
    return forge_header(renumber(lines))


def _weights_line(lines, key, trigger, nth=0):
    return [i for i, r in enumerate(lines) if r.get("key") == key and r.get("trigger") == trigger][nth]


def cancel_without_withdrawal(lines):
    del lines[index_of(lines, trigger="weights_cancelled")]
    return forge_header(rechain(lines))


def cancel_of_an_applied_request(lines):
    """weights:0 applied update 2 (updated, not cancelled) before the withdrawal; its later records fixed up."""
    i = _weights_line(lines, "weights:0", "cancel_to_cleared")
    applied = dict(lines.pop(i), trigger="updated", to="NORMAL")
    applied.pop("detail", None)
    applied["reason"] = ""
    lines.insert(index_of(lines, trigger="weights_cancelled"), applied)
    lines[_weights_line(lines, "weights:0", "update", 1)]["from"] = "NORMAL"  # an update from NORMAL is legal
    return forge_header(renumber(lines))


def cancel_to_the_wrong_state(lines):
    """weights:1's update from CLEARED cancelled to NORMAL (cancel, not cancel_to_cleared): never NORMAL with the
    weights not loaded."""
    i = _weights_line(lines, "weights:1", "cancel_to_cleared")
    lines[i].update(trigger="cancel", to="NORMAL")
    lines[_weights_line(lines, "weights:1", "update", 1)]["from"] = "NORMAL"
    return rechain(lines)


MUTATIONS = {
    "membership: a generation bumped": (bump_generation, r"line 6 .*cluster plan under generation 3, but the "
                                                         r"generation in force is 2$"),
    "membership: a membership change by two": (rejoin_by_two, r"line 27 .*membership member:2 rejoin makes "
                                               r"generation 4, but the generation in force is 2: a membership "
                                               r"change raises it by exactly one \(to 3\)"),
    "membership: a start under an older generation": (start_under_an_older_generation, r"line 29 .*cluster start "
                                                      r"under generation 3, but the generation in force is 4 "
                                                      r"\(made under an older membership"),
    "membership: a membership record dropped": (drop_membership_record, r"line 28 .*cluster start under generation "
                                                r"4, but the generation in force is 3"),
    "membership: a membership record without its generation": (membership_without_generation, r"line 4 .*member:2 "
                                                               r"exclude carries no generation"),
    "membership: log2phy routed to the excluded rank": (route_to_the_excluded_rank, r"line 15 .*the committed plan "
                                                        r"[0-9a-f]{16} \(generation 2\) routes to excluded ranks "
                                                        r"\[2\]: 4 logical experts have no replica on another rank"),
    "membership: a second rank excluded under the commit": (exclude_a_second_rank_mid_round, r"line 17 .*the "
                                                            r"committed plan [0-9a-f]{16} \(generation 4\) routes to "
                                                            r"excluded ranks \[1, 2\]"),
    "weights_cancel: a cancel without a withdrawal": (cancel_without_withdrawal, r"line 8 .*guard withdrawn\(CLEARED\) "
                                                      r"did not hold when weights:1 cancel_to_cleared committed: "
                                                      r"weight request 2 of weights:1 was not withdrawn"),
    "weights_cancel: a cancel of a request a rank applied": (cancel_of_an_applied_request, r"line 9 .*weight request "
                                                             r"2 withdrawn, but weights:0 applied it \(line 8"),
    "weights_cancel: a cancel to the wrong state": (cancel_to_the_wrong_state, r"line 9 .*guard withdrawn\(NORMAL\) "
                                                    r"did not hold when weights:1 cancel committed: weights:1 came "
                                                    r"from CLEARED"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_recording_fails_with_its_reason(name, tmp_path, capsys):
    mutate, reason = MUTATIONS[name]
    recording, _, _ = name.partition(": ")
    path = tmp_path / "mutated.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in mutate(lines_of(recording))) + "\n")
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert re.search(reason, err), err


def test_into_rebuilds_the_membership_generation(redis_url, cluster_id, tmp_path):
    from fdeplb.machines.tables import MEMBERSHIP as MEMBER_TABLE
    from fdeplb.store import Store

    assert main(["replay", str(MEMBERSHIP), "--into", redis_url, "--cluster", cluster_id]) == 0
    store = Store(redis_url, cluster_id)
    try:
        assert store.read_cluster().generation == 4 and store.read(MEMBER_TABLE, 2).generation == 4
        assert store.read(MEMBER_TABLE, 0).generation == 0
        again = tmp_path / "again.jsonl"  # the rebuilt cluster exports a recording that replays the same
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(again)]) == 0
        assert main(["replay", str(again)]) == 0
    finally:
        store.delete_cluster()
