"""The replay reads strictly: schema 2 facts are read from ``detail`` only (never the text alone), and
strictly (:func:`fdeplb.checks.check_int`); ``--until`` reads a stream id with the store's one parser; ``--into`` is
all-or-nothing."""

from __future__ import annotations

import json
import re

import pytest

from fdeplb.cli import main
from fdeplb.store import Store
from tests.replay.helpers import HAPPY, index_of, lines_of, rechain


def _write(tmp_path, lines, name="mutated.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _fails(path, pattern, capsys):
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.search(pattern, err), err


# ---- schema 2: the facts are the detail's -------------------------------------------------------------------------
@pytest.mark.parametrize("detail", [None, "{}"], ids=["no detail", "empty detail"])
def test_a_schema2_gated_abort_without_its_figures_fails(detail, tmp_path, capsys):
    lines = lines_of("gated_skip")
    abort = lines[index_of(lines, key="cluster", trigger="abort")]
    if detail is None:
        abort.pop("detail")
    else:
        abort["detail"] = detail
    _fails(_write(tmp_path, rechain(lines)), r"line 4 .*gated round 1 without its gate's figures \(detail.gate\)",
           capsys)


def test_a_schema2_refusal_with_its_ranks_in_the_text_only_fails(tmp_path, capsys):
    lines = lines_of("stale_rank")
    lines[index_of(lines, trigger="start_refused")].pop("detail")
    _fails(_write(tmp_path, rechain(lines)), r"line 2 .*start_refused without its stale ranks", capsys)


@pytest.mark.parametrize("value", ["12", 12.0, True], ids=["text", "float", "bool"])
def test_heartbeat_detail_integers_are_checked_strictly(value, tmp_path, capsys):
    lines = lines_of("stale_rank")
    start = lines[index_of(lines, key="cluster", trigger="start")]
    detail = json.loads(start["detail"])
    detail["heartbeats"][0]["age_ms"] = value
    start["detail"] = json.dumps(detail, sort_keys=True, separators=(",", ":"))
    _fails(_write(tmp_path, rechain(lines)), r"line 3 .*detail is not what a start record carries: age_ms must be "
                                             r"an integer", capsys)


# ---- --until -------------------------------------------------------------------------------------------------------
def test_until_reads_a_stream_id_as_the_store_does(capsys):
    loaded_id = next(x["id"] for x in lines_of() if x.get("trigger") == "loaded")
    ms, seq = loaded_id.split("-")
    assert main(["replay", str(HAPPY), "--until", f"{ms}-0{seq}"]) == 0  # the same id, as Redis reads it
    assert "cluster      LOAD_SUCC [2]  v4" in capsys.readouterr().out
    assert main(["replay", str(HAPPY), "--until", f"{ms}-\u00b2"]) == 2  # a superscript two is no digit of an id
    assert "--until takes the cluster's version or an audit id" in capsys.readouterr().err
    assert main(["replay", str(HAPPY), "--until", "\u00b2"]) == 2
    assert "--until takes the cluster's version or an audit id" in capsys.readouterr().err


# ---- --into: all or nothing ----------------------------------------------------------------------------------------
def _cluster_keys(store: Store) -> list[bytes]:
    return sorted(store._client.scan_iter(match=f"fdeplb:[{{]{store.cluster}[}}]:*"))


def test_into_of_a_recording_with_a_bad_audit_id_writes_nothing_and_can_be_rerun(redis_url, cluster_id, tmp_path,
                                                                                capsys):
    lines = lines_of()
    lines[1]["id"] = "0-0"  # not in the chain: only the id is wrong
    bad = _write(tmp_path, lines)
    store = Store(redis_url, cluster_id)
    try:
        assert main(["replay", str(bad), "--into", redis_url, "--cluster", cluster_id]) == 1
        assert "line 2 (audit id 0-0): stream id 0-0, which Redis never assigns" in capsys.readouterr().err
        assert _cluster_keys(store) == []
        assert main(["replay", str(HAPPY), "--into", redis_url, "--cluster", cluster_id]) == 0  # not "exists"
    finally:
        store.delete_cluster()


def _import_args(**changes):
    from fdeplb.replay import replay_file
    from fdeplb.replay.recompute import Recorded

    report = replay_file(HAPPY)
    source = Recorded(report)
    audit = [(rec["id"], {k: v for k, v in rec.items() if k not in ("type", "id")}) for rec in report.audit]
    args = dict(plan_id=report.placement_plan, phy2log=report.stored_plans[report.placement_plan].new_phy2log,
                placement_version=1, records={"cluster": {"state": "FREE", "version": "7"}}, audit=audit,
                audit_head=report.chain, snapshots=report.snapshots, plans=list(report.stored_plans.values()))
    return source.config, {**args, **changes}


def test_import_checks_every_audit_id_before_writing_anything(redis_url, cluster_id):
    config, args = _import_args()
    audit = list(args["audit"])
    audit[1], audit[2] = audit[2], audit[1]  # ids no longer increase: XADD would refuse the second
    store = Store(redis_url, cluster_id)
    try:
        from fdeplb.errors import InputError

        with pytest.raises(InputError, match="audit record 3: id .* is not after"):
            store.import_recording(config, **{**args, "audit": audit})
        assert _cluster_keys(store) == []  # the snapshots and plans too
        store.import_recording(config, **args)
        assert store.audit_head() == args["audit_head"] and store.read_plan(args["plan_id"]) is not None
    finally:
        store.delete_cluster()


def test_import_takes_back_what_it_wrote_when_redis_refuses_a_write_inside_the_transaction(redis_url, cluster_id):
    from fdeplb.errors import InputError

    config, args = _import_args()
    store = Store(redis_url, cluster_id)
    try:
        store._client.set(store._keys.retained, "not a sorted set")  # ZADD fails inside EXEC (WRONGTYPE)
        with pytest.raises(InputError, match="Redis refused a write .*nothing is left written"):
            store.import_recording(config, **args)
        assert _cluster_keys(store) == []
        store.import_recording(config, **args)  # a rerun is not refused "exists"
        assert store.read_cluster().version == 7
    finally:
        store.delete_cluster()
