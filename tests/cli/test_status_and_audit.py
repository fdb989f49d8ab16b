"""``fdeplb audit`` and ``fdeplb status`` against a real Redis: filters, JSON, export, and typed errors."""

from __future__ import annotations

import json

import pytest

from fdeplb.cli import main
from fdeplb.machines.tables import CLUSTER
from fdeplb.machines.tables import RANK
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.placement import routing_digest
from fdeplb.replay import replay_file
from fdeplb.store import Store
from tests.replay.helpers import PLAN


@pytest.fixture
def store(two_rank_store):
    return two_rank_store


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def where(url: str, store: Store) -> list[str]:
    return ["--redis-url", url, "--cluster", store.cluster]


def test_audit_lines_and_filters(redis_url, fired, capsys):
    code, out, _ = cli(capsys, "audit", *where(redis_url, fired))
    lines = out.splitlines()
    assert code == 0 and len(lines) == 14
    assert "cluster    start    FREE -> COLLECTING  v1" in lines[0] and "actor=test" in lines[0]
    assert f"plan={PLAN}" in lines[2] and "r1" in lines[2]
    _, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--machine", "cluster")
    assert [line.split()[4] for line in out.splitlines()] == [
        "start", "plan", "load", "loaded", "commit", "swapped", "release"]
    _, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--rank", "0")
    assert {line.split()[3] for line in out.splitlines()} == {"rank:0", "weights:0"}
    assert len(out.splitlines()) == 7
    _, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--machine", "weights", "--rank", "0")
    assert [line.split()[4] for line in out.splitlines()] == ["update", "updated"]
    _, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--round", "2")
    assert out == ""


def test_audit_json_and_export(redis_url, fired, capsys, tmp_path):
    code, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--json", "--machine", "rank")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["version"] for r in records] == [1, 2, 3, 4, 5]
    assert all(isinstance(r["ts_ms"], int) and r["id"] and r["key"] == "rank:0" for r in records)
    assert records[0] == {**records[0], "machine": "rank", "from": "IDLE", "to": "LOADING", "trigger": "stage",
                          "plan_id": PLAN, "actor": "test", "fence": ""}
    path = tmp_path / "audit.jsonl"
    code, out, _ = cli(capsys, "audit", *where(redis_url, fired), "--export", str(path))
    assert code == 0 and out == (f"exported 14 audit records, 0 snapshots and 1 plans of cluster {fired.cluster} to "
                                 f"{path} (1 named but no longer in Redis)\n")  # the fired round saved no snapshot
    exported = [json.loads(x) for x in path.read_text().splitlines()]
    assert exported[0]["type"] == "header" and exported[0]["missing"] == {"snapshots": [1], "plans": []}
    assert [x["id"] for x in exported if x["type"] == "audit"] == [e.id for e in fired.iter_audit()]
    assert replay_file(path).transitions == 14
    code, _, err = cli(capsys, "audit", *where(redis_url, fired), "--export", str(tmp_path / "no" / "dir" / "a.jsonl"))
    assert code == 2 and "cannot write" in err


@pytest.mark.parametrize("args,code,message", [
    (["--rank", "1"], 2, "--rank 1 outside the cluster's ranks 0..0"),
    (["--rank", "0", "--machine", "cluster"], 2,
     "--rank selects rank and weights records; it cannot be combined with --machine cluster"),
    (["--round", "-1"], 2, "--round must be >= 0, got -1"),
    (["--rank", "-1"], 2, "--rank must be >= 0, got -1"),
    (["--limit", "0"], 2, "--limit must be >= 1, got 0"),
])
def test_audit_bad_filters(redis_url, fired, capsys, args, code, message):
    got, out, err = cli(capsys, "audit", *where(redis_url, fired), *args)
    assert (got, out) == (code, "") and err == f"error: {message}\n"


def test_audit_bad_machine_is_a_usage_error(redis_url, fired, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["audit", *where(redis_url, fired), "--machine", "gpu"])
    assert exc.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["audit", "status"])
def test_bad_cluster_and_redis(redis_url, store, capsys, command):
    url = redis_url
    code, _, err = cli(capsys, command, "--redis-url", url, "--cluster", "t-never-initialised")
    assert code == 2 and err.startswith("error: no cluster 't-never-initialised' at ")
    code, _, err = cli(capsys, command, "--redis-url", "redis://127.0.0.1:1/0", "--cluster", store.cluster)
    assert code == 7 and err.startswith("error: cannot reach Redis at redis://127.0.0.1:1/0: ")
    code, _, err = cli(capsys, command, "--redis-url", "http://127.0.0.1:1", "--cluster", store.cluster)
    assert code == 2 and err.startswith("error: bad Redis URL 'http://127.0.0.1:1'")
    assert "unknown scheme 'http'" in err and "redis+cluster://" in err and "redis+sentinel://" in err
    code, _, err = cli(capsys, command, "--redis-url", url, "--cluster", "no/such")
    assert code == 2 and "cluster id must match" in err


def test_status_mid_round(redis_url, store, capsys):
    lease = store.acquire_lease("coord-a", 60_000)
    now = store.now_ms()
    RecordHandle(store, CLUSTER, actor="coord-a", fence=lease).fire(
        "start", round_=3, changes={"round": 3, "deadline_ms": now + 30_000})
    store.update(CLUSTER, alarm="swapping deadline passed", requested=3)
    store.update(RANK, 1, heartbeat_ms=now - 2_500)
    store.register_rank(1, {"pid": 1})
    code, out, _ = cli(capsys, "status", *where(redis_url, store), "--json")
    status = json.loads(out)
    c = status["rearrange"]
    assert code == 0 and (c["state"], c["code"], c["version"], c["round"], c["requested"]) == (
        "COLLECTING", 1, 1, 3, 3)
    assert 0 < c["deadline_left_ms"] <= 30_000 and c["alarm"] == "swapping deadline passed"
    assert c["lease_holder"] == lease and 0 < c["lease_ttl_ms"] <= 60_000
    assert status["placement"] == {"plan_id": "", "version": 0, "corrupt": False,
                                   "routing_digest": routing_digest(store.current_placement().phy2log)}
    assert status["corrupt"] == []
    assert [r["routing"] for r in status["ranks"]] == ["not_reported"] * 2 and status["routing_mismatches"] == []
    r0, r1 = status["ranks"]
    assert (r0["state"], r0["load_result"], r0["weights"], r0["weights_code"], r0["registered"]) == (
        "IDLE", 0, "NORMAL", 0, False)
    assert r0["heartbeat_age_ms"] is None and r1["heartbeat_age_ms"] >= 2_500 and r1["registered"]
    code, out, _ = cli(capsys, "status", *where(redis_url, store))
    assert code == 0
    assert "  rearrange  COLLECTING [1]  v1  round 3 (requested 3)  plan -\n" in out
    assert "  ALARM      swapping deadline passed\n" in out
    assert f"  lease      {lease}  (ttl " in out and "  placement  initial  v0  routing digest " in out
    assert "s left\n" in out.splitlines()[2] + "\n"
    rows = out.splitlines()[-2:]
    assert rows[0].split() == ["0", "IDLE", "0", "NORMAL", "0", "ACTIVE", "-", "-", "unreported", "-", "not",
                               "registered"]
    assert rows[1].split()[:7] == ["1", "IDLE", "0", "NORMAL", "0", "ACTIVE", "-"] and rows[1].endswith("s ago")


def test_status_after_a_round(redis_url, fired, capsys):
    code, out, _ = cli(capsys, "status", *where(redis_url, fired), "--json")
    status = json.loads(out)
    assert code == 0 and status["rearrange"]["state"] == "FREE" and status["rearrange"]["version"] == 7
    assert status["placement"] == {"plan_id": PLAN, "version": 1, "corrupt": False,
                                   "routing_digest": routing_digest(fired.current_placement().phy2log)}
    assert status["ranks"][0]["plan_id"] == PLAN and status["ranks"][0]["version"] == 5
    assert status["ranks"][0]["weights_version"] == 2
