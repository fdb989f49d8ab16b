"""``fdeplb rank exclude|drain|readmit`` and the membership part of ``fdeplb status`` and the metrics, against a real
Redis: each legal command an audited member transition with who and why and a generation; each illegal one exit 3
with nothing written; a bad rank or reason exit 2."""

from __future__ import annotations

import json

import pytest

from fdeplb.machines.tables import MEMBERSHIP, MemberState
from fdeplb.store import Store
from tests.helpers import RawRedis, run_cli

M = MemberState


@pytest.fixture
def store(small_store):
    return small_store


def rank_cmd(capsys, store: Store, command: str, r: int, *extra: str):
    return run_cli(capsys, "rank", command, "--redis-url", store.url, "--cluster", store.cluster, "--rank", str(r),
                   *extra)


def test_drain_then_readmit_is_audited_with_who_and_why(capsys, store):
    code, out, _ = rank_cmd(capsys, store, "drain", 2, "--reason", "host maintenance")
    assert code == 0 and "ACTIVE -> DRAINING" in out and "generation 1" in out
    entry = store.audit()[-1]
    assert (entry["key"], entry["trigger"], entry["generation"]) == ("member:2", "drain", "1")
    assert entry["actor"].startswith("operator:") and entry["reason"] == "operator drain: host maintenance"
    assert json.loads(entry["detail"]) == {"by": entry["actor"], "ranks": [2]}
    assert store.read(MEMBERSHIP, 2).actor == entry["actor"]
    code, out, _ = rank_cmd(capsys, store, "readmit", 2)
    assert code == 0 and "DRAINING -> ACTIVE" in out and store.read_cluster().generation == 2


def test_exclude_needs_a_suspect_rank(capsys, store, redis_url):
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    code, _, err = rank_cmd(capsys, store, "exclude", 1)
    assert code == 3 and "exclude" in err and "ACTIVE" in err
    assert raw.snapshot() == before  # refused: nothing written
    raw.force(raw.keys.member(1), M.SUSPECT, version=1)
    code, out, _ = rank_cmd(capsys, store, "exclude", 1, "--reason", "dead GPU")
    assert code == 0 and "SUSPECT -> EXCLUDED" in out
    code, _, err = rank_cmd(capsys, store, "drain", 1)  # not from EXCLUDED
    assert code == 3
    status = json.loads(run_cli(capsys, "status", "--redis-url", store.url, "--cluster", store.cluster, "--json")[1])
    assert status["generation"] == 1 and status["live_ranks"] == [0, 2]
    assert [r["membership"] for r in status["ranks"]] == ["ACTIVE", "EXCLUDED", "ACTIVE"]
    assert status["degraded"] == {"orphans": [[0, 2], [0, 3]], "ranks": [1]}
    code, text, _ = run_cli(capsys, "status", "--redis-url", store.url, "--cluster", store.cluster)
    assert code == 0 and "members    0, 2 ACTIVE  (generation 1)" in text and "DEGRADED   2 experts" in text
    assert any(line.split()[:1] == ["1"] and "EXCLUDED" in line.split() for line in text.splitlines())


@pytest.mark.parametrize("extra,message", [(("--rank", "3"), "--rank"), (("--rank", "-1"), "--rank"),
                                           (("--rank", "0", "--reason", "a\nb"), "control")])
def test_bad_rank_or_reason_is_exit_2(capsys, store, extra, message):
    code, _, err = run_cli(capsys, "rank", "drain", "--redis-url", store.url, "--cluster", store.cluster, *extra)
    assert code == 2 and message in err
    assert all(m.state is M.ACTIVE for m in store.read_all(MEMBERSHIP))


def test_metrics_count_ranks_per_membership_state(store):
    from fdeplb.api.prometheus import ClusterCollector

    from fdeplb.orchestration.membership import operator_fire

    operator_fire(store, 0, "drain", who="operator:test", reason="")
    families = {f.name: f for f in ClusterCollector(store).collect()}
    by_state = {s.labels["state"]: s.value for s in families["fdeplb_membership_ranks"].samples}
    assert by_state == {"ACTIVE": 2, "SUSPECT": 0, "DRAINING": 1, "EXCLUDED": 0, "REJOINING": 0}
    assert families["fdeplb_membership_generation"].samples[0].value == 1


def test_placement_route_names_live_slots_only(store):
    from fdeplb.api import service
    from fdeplb.orchestration.membership import operator_fire

    full = service.placement(store, None)
    assert full["live_ranks"] == [0, 1, 2] and full["logcnt"] == [[2, 2, 1, 1]]
    operator_fire(store, 2, "drain", who="operator:test", reason="")
    # routes follow the members the placement was committed for, not the membership records: unchanged until the
    # membership round commits (every engine switches its tables at that round's switch step)
    assert service.placement(store, None) == full
    store._client.hset(store._keys.placement, "members", "0,1")  # what that round's commit writes
    part = service.placement(store, None)  # slots 4, 5 (experts 0, 1) leave the routes
    assert part["live_ranks"] == [0, 1] and part["logcnt"] == [[1, 1, 1, 1]]
    assert not {4, 5} & {p for row in part["log2phy"][0] for p in row}
    assert part["phy2log"] == full["phy2log"]  # the placement itself is unchanged


def test_init_cluster_takes_the_exclusion_deadline(capsys, redis_url, cluster_id, tmp_path):
    from fdeplb.weights import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", 1, 4, hidden=4, intermediate=2)
    code, _, err = run_cli(capsys, "init-cluster", "--redis-url", redis_url, "--cluster", cluster_id,
                           "--num-layers", "1", "--num-logical-experts", "4", "--num-redundant-experts", "0",
                           "--ep-size", "2", "--checkpoint", str(ckpt), "--exclude-ms", "4500")
    assert code == 0, err
    s = Store(redis_url, cluster_id)
    assert s.read_config().deadlines.exclude_ms == 4500
    assert [m.state for m in s.read_all(MEMBERSHIP)] == [M.ACTIVE, M.ACTIVE]
    s.delete_cluster()


@pytest.mark.parametrize("members", ["x,1", "0,9", "0;1", "٣"])
def test_corrupt_placement_members_is_a_typed_error(store, members):
    from fdeplb.errors import CorruptRecordError

    store._client.hset(store._keys.placement, "members", members)
    with pytest.raises(CorruptRecordError, match="members"):
        store.current_placement()


def test_wrong_state_and_last_member_are_refused_naming_what_applies(capsys, store):
    code, _, err = run_cli(capsys, "rank", "exclude", "--redis-url", store.url, "--cluster", store.cluster,
                           "--rank", "0")
    assert code == 3 and "rank 0 is ACTIVE: `rank exclude` applies to a rank that is SUSPECT" in err
    for r in (0, 1):
        assert run_cli(capsys, "rank", "drain", "--redis-url", store.url, "--cluster", store.cluster,
                       "--rank", str(r))[0] == 0
    code, _, err = run_cli(capsys, "rank", "drain", "--redis-url", store.url, "--cluster", store.cluster,
                           "--rank", "2")
    assert code == 3 and "rank 2 is the last ACTIVE member" in err
    assert store.read(MEMBERSHIP, 2).state is M.ACTIVE  # nothing written


def test_a_command_on_a_deleted_record_is_a_state_error_naming_the_coming_restore(capsys, store, redis_url):
    # QA L1: status shows the rank as the coordinator will restore it; the command waits for that restore
    raw = RawRedis(redis_url, store.cluster)
    assert rank_cmd(capsys, store, "drain", 1)[0] == 0
    store._client.delete(raw.keys.member(1))
    before = raw.snapshot()
    for command in ("readmit", "drain", "exclude"):
        code, _, err = rank_cmd(capsys, store, command, 1)
        assert code == 3 and "missing (deleted)" in err and "restores it from the audit at its next pass" in err
    assert raw.snapshot() == before  # nothing written


def test_a_drain_the_members_left_cannot_cover_says_its_round_fails_closed(capsys, store):
    """QA: `rank drain` of a rank holding experts the other members have no redundant slot for said only
    "ACTIVE -> DRAINING"; its membership round then failed closed (DEGRADED, /health 503). It now says so."""
    code, out, err = rank_cmd(capsys, store, "drain", 1)  # experts 2, 3 on rank 1 only; 0, 1 twice: covered
    assert code == 0 and "ACTIVE -> DRAINING" in out and err == "", err
    code, out, err = rank_cmd(capsys, store, "drain", 2)  # rank 0 alone left: 2 and 3 have nowhere to go
    assert code == 0 and "ACTIVE -> DRAINING" in out, out + err
    assert err.startswith("note: the ACTIVE members left (0) cannot hold every expert (fail closed: ") \
        and "takes rank 2 out fails closed (status DEGRADED, /health 503) until it is readmitted" in err, err


def test_a_drain_with_a_corrupt_placement_still_exits_0(capsys, store, redis_url):
    """The fail-closed note is advice read after the transition: a placement that does not read must not turn the
    committed drain into an error exit."""
    raw = RawRedis(redis_url, store.cluster)
    raw.r.hset(raw.keys.placement, "phy2log", b"not an array")
    code, out, err = rank_cmd(capsys, store, "drain", 2)
    assert code == 0 and "ACTIVE -> DRAINING" in out and "note:" not in err, out + err
