"""A recording of a cluster that pruned and re-planned replays both ways: retain 1 round, the DeepSeek
policy, two loads alternating over 12 rounds, so plans are pruned and the same (load, placement) recurs, storing a
plan again under a later round. Self-contained and against the live store; and the live audit head anchors the
recording's chain there (a forged round with a recomputed chain fails)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdeplb.recording import export_recording
from fdeplb.replay import chain_of
from tests.helpers import run_cli, thread_cluster, wait_for

ROUNDS = 12


def _round_over(store, n):
    def check():
        rec = store.read_cluster()
        return rec.state == "FREE" and rec.round >= n and all(
            store.read_rank(r).state == "IDLE" for r in range(store.ep_size())) and rec
    return check


@pytest.fixture(scope="module")
def pruned_run(redis_url, tmp_path_factory):
    """(store, recording path, cluster id) of a real 12-round run, threads stopped, the cluster still in Redis."""
    import uuid

    tmp = tmp_path_factory.mktemp("pruned")
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with thread_cluster(redis_url, cluster, tmp, policy="deepseek", retain_rounds=1) as tc:
        store = tc.store()
        loads = [tc.loads.copy(), np.ascontiguousarray(tc.loads[:, :, ::-1])]  # two different real splits
        tc.start()
        for n in range(1, ROUNDS + 1):
            tc.loads[...] = loads[(n - 1) % 2]
            store.request_round(f"pruned replans: round {n}")
            wait_for(_round_over(store, n), 60, store, f"round {n}")
        tc.stop()
        path = tmp / "pruned.jsonl"
        export_recording(store, path)
        tc.alternate = loads
        yield store, path, cluster, tc


def _lines(path):
    return [json.loads(s) for s in path.read_text().splitlines()]


def test_the_run_pruned_and_stored_a_plan_again_under_a_later_round(pruned_run):
    store, path, _, _ = pruned_run
    lines = _lines(path)
    header = lines[0]
    loads = [(a["round"], a["plan_id"]) for a in lines if a.get("type") == "audit"
             and a["machine"] == "cluster" and a["trigger"] == "load"]
    assert len({r for r, _ in loads}) == ROUNDS  # every round planned
    assert header["missing"]["plans"], "nothing was pruned: the scenario does not reproduce the issue"
    stored = {p["plan_id"]: p["round"] for p in lines if p.get("type") == "plan"}
    first = {}
    for r, p in loads:
        first.setdefault(p, r)
    assert any(stored[p] > first[p] for p in stored if p in first), "no plan was stored again by a later round"


def test_self_contained_replay_holds(pruned_run, capsys):
    _, path, _, _ = pruned_run
    code, out, err = run_cli(capsys, "replay", str(path))
    assert code == 0, err
    assert "not checked" in out


def test_replay_against_the_live_store_holds(pruned_run, capsys, redis_url):
    _, path, cluster, _ = pruned_run
    code, out, err = run_cli(capsys, "replay", str(path), "--redis-url", redis_url, "--cluster", cluster, "--json")
    assert code == 0, err
    report = json.loads(out)
    header = _lines(path)[0]
    assert set(header["missing"]["plans"]) <= set(report["plans_unchecked"])
    assert report["plans_checked"]
    assert report["head"] == "matches"


def test_a_forged_round_with_a_recomputed_chain_fails_against_the_live_head(pruned_run, capsys, redis_url,
                                                                             tmp_path):
    _, path, cluster, _ = pruned_run
    lines = _lines(path)
    audit = [i for i, a in enumerate(lines) if a.get("type") == "audit"]
    # forge the last round's abort-free end: rewrite its reason text, then recompute every chain after it
    victim = next(i for i in reversed(audit) if lines[i]["machine"] == "cluster" and lines[i]["trigger"] == "start")
    lines[victim]["reason"] = "forged"
    chain = lines[audit[audit.index(victim) - 1]]["chain"]
    for i in audit[audit.index(victim):]:
        fields = {k: str(v) for k, v in lines[i].items() if k not in ("type", "id", "chain")}
        chain = lines[i]["chain"] = chain_of(chain, fields)
    forged = tmp_path / "forged.jsonl"
    forged.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    code, out, err = run_cli(capsys, "replay", str(forged))
    assert code == 0, err  # self-contained, the recomputed chain holds: only the live head can tell
    code, out, err = run_cli(capsys, "replay", str(forged), "--redis-url", redis_url, "--cluster", cluster)
    assert code == 1
    assert f"line {audit[-1] + 1} " in err and "differs from the live audit's record" in err, err


def _rechain(lines, audit, start):
    chain = lines[audit[start - 1]]["chain"] if start else ""
    for i in audit[start:]:
        fields = {k: str(v) for k, v in lines[i].items() if k not in ("type", "id", "chain")}
        chain = lines[i]["chain"] = chain_of(chain, fields)


def test_a_forged_record_past_the_stream_end_fails_against_the_live_audit(pruned_run, capsys, redis_url, tmp_path):
    _, path, cluster, _ = pruned_run
    lines = _lines(path)
    audit = [i for i, a in enumerate(lines) if a.get("type") == "audit"]
    last, cluster_last = lines[audit[-1]], next(lines[i] for i in reversed(audit) if lines[i]["machine"] == "cluster")
    assert cluster_last["to"] == "FREE"
    ms, seq = map(int, last["id"].split("-"))
    note = {**cluster_last, "id": f"{ms}-{seq + 1}", "from": "FREE", "to": "FREE", "trigger": "alarm",
            "reason": "forged", "ts_ms": last["ts_ms"] + 1}
    note.pop("detail", None)
    lines.insert(audit[-1] + 1, note)
    audit.append(audit[-1] + 1)
    lines[0]["range"]["last_id"] = note["id"]
    lines[0]["contents"]["records"] += 1
    _rechain(lines, audit, len(audit) - 1)
    forged = tmp_path / "appended.jsonl"
    forged.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    code, _, err = run_cli(capsys, "replay", str(forged))
    assert code == 0, err  # the chain holds in the file
    code, _, err = run_cli(capsys, "replay", str(forged), "--redis-url", redis_url, "--cluster", cluster)
    assert code == 1 and "records the cluster never committed" in err, err


def test_a_plan_stored_for_a_round_that_did_not_plan_it_still_fails(pruned_run, capsys, tmp_path):
    _, path, _, _ = pruned_run
    lines = _lines(path)
    loads = {}
    for a in lines:
        if a.get("type") == "audit" and a["machine"] == "cluster" and a["trigger"] == "load":
            loads.setdefault(a["plan_id"], set()).add(a["round"])
    plan = next(p for p in lines if p.get("type") == "plan" and p["plan_id"] in loads)
    other = next(r for r in range(ROUNDS, 0, -1) if r not in loads[plan["plan_id"]] and r > min(loads[plan["plan_id"]]))
    plan["round"] = other
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    code, _, err = run_cli(capsys, "replay", str(edited))
    assert code == 1 and f"stored for round {other}, which did not plan it" in err, err


def test_a_plan_the_live_store_pruned_after_the_export_is_checked_from_the_recording(pruned_run, capsys, redis_url):
    """(Last: it runs the shared cluster on.) Three more rounds after the export prune the plan the export held (the
    then current placement's); the replay against the live store checks it from the recording's copy, and anchors
    the recording's chain to the live record at its end (the stream went on)."""
    store, path, cluster, tc = pruned_run
    (held,) = [p["plan_id"] for p in _lines(path) if p.get("type") == "plan"]
    tc.agents.clear(), tc.threads.clear()
    tc.start()
    for n in range(ROUNDS + 1, ROUNDS + 4):  # 14 plans it again (the loads recur), 15 prunes it
        tc.loads[...] = tc.alternate[(n - 1) % 2]
        store.request_round(f"pruned replans: round {n}")
        wait_for(_round_over(store, n), 60, store, f"round {n}")
    tc.stop()
    capsys.readouterr()  # the cluster's log lines
    assert store.read_plan(held) is None, "the exported plan was not pruned"
    code, out, err = run_cli(capsys, "replay", str(path), "--redis-url", redis_url, "--cluster", cluster, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert held in report["plans_checked"] and held not in report["plans_unchecked"]
    assert report["head"] == "matches record"
