"""The coordinator's audit trim as a round ends (issue 34 item B): records leave the stream only once they are
appended to the export and fsynced; an export that is refused (no ``--audit-dir``, a file swapped for a symbolic
link to ``/dev/null`` or a hard link to a file outside) or fails to write trims nothing and raises an audited
alarm. Real Redis, no processes."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal

import numpy as np
import pytest
import structlog

from fdeplb.orchestration.housekeeping import prune_after_round
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Store

KEEP = 3


@pytest.fixture
def audit_dir(tmp_path):
    d = tmp_path / "audit"
    d.mkdir()
    return d


@pytest.fixture
def store(redis_url, cluster_id, audit_dir):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3,
                                      audit_keep=KEEP, audit_export_path=str(audit_dir / "audit.jsonl")),
                 np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64))
    for i in range(6):  # records to trim
        store.append_note(store.read_cluster(), trigger="skip", actor="test", reason=f"note {i}")
    yield store
    store.delete_cluster()


def round_end(store: Store, audit_dir, fence: str = "") -> None:
    """What the coordinator holding ``fence`` runs as a round ends, with its --audit-dir (None: started without
    one)."""
    prune_after_round(store, store.read_config(fresh=True), store.read_cluster(), structlog.get_logger(),
                      "coordinator@test", fence, None if audit_dir is None else str(audit_dir))


def alarms(store: Store) -> list:
    return [a for a in store.audit() if a["trigger"] == "alarm"]


def test_the_audit_is_trimmed_only_after_the_export_is_written(store, audit_dir):
    ids = [a.id for a in store.audit()]
    round_end(store, audit_dir)
    lines = [json.loads(x) for x in (audit_dir / "audit.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == ids[:-KEEP]
    assert [a.id for a in store.audit()] == ids[-KEEP:] and not alarms(store)


def test_without_an_audit_dir_nothing_is_trimmed_and_an_alarm_is_audited(store, audit_dir):
    n = store.audit_length()
    round_end(store, None)
    assert store.audit_length() == n + 1  # the stream whole, plus the alarm
    (alarm,) = alarms(store)
    assert "audit not trimmed" in alarm["reason"] and "without --audit-dir" in alarm["reason"]
    assert json.loads(alarm["detail"])["export"] == str(audit_dir / "audit.jsonl")
    assert not (audit_dir / "audit.jsonl").exists()


def test_an_export_swapped_for_a_link_to_dev_null_never_trims(store, audit_dir):
    (audit_dir / "audit.jsonl").symlink_to("/dev/null")  # set while it was a plain path; swapped since
    ids = [a.id for a in store.audit()]
    round_end(store, audit_dir)
    assert [a.id for a in store.audit()][:len(ids)] == ids
    (alarm,) = alarms(store)
    assert "a symbolic link" in alarm["reason"] and json.loads(alarm["detail"])["error"].startswith("audit export")


def test_an_export_swapped_for_a_hard_link_to_a_file_outside_is_not_written(store, audit_dir, tmp_path):
    outside = tmp_path / "outside.txt"  # planted by someone who may write in the audit folder
    outside.write_text("kept\n")
    os.link(outside, audit_dir / "audit.jsonl")
    ids = [a.id for a in store.audit()]
    round_end(store, audit_dir)
    assert outside.read_text() == "kept\n" and [a.id for a in store.audit()][:len(ids)] == ids
    (alarm,) = alarms(store)
    assert "a hard link (2 names)" in alarm["reason"]


def test_a_failed_fsync_leaves_the_audit_whole(store, audit_dir, monkeypatch):
    import fdeplb.store.retention as retention

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(retention.os, "fsync", failing_fsync)
    ids = [a.id for a in store.audit()]
    round_end(store, audit_dir)
    assert [a.id for a in store.audit()][:len(ids)] == ids  # nothing trimmed: the export was never made durable
    (alarm,) = alarms(store)
    assert "Input/output error" in alarm["reason"] and alarm["actor"] == "coordinator@test"
    stream = [a.id for a in store.audit()]
    monkeypatch.undo()  # the disk recovers: the next round's end resumes the export (each record once) and trims
    round_end(store, audit_dir)
    assert store.audit_length() == KEEP
    assert [json.loads(x)["id"] for x in (audit_dir / "audit.jsonl").read_text().splitlines()] == stream[:-KEEP]


@pytest.fixture
def file_size_limit():
    """Sets the process's RLIMIT_FSIZE (SIGXFSZ ignored, so a write past it fails with EFBIG); restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    yield lambda limit: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def test_an_export_cut_short_by_a_write_error_resumes_on_retry(store, audit_dir, file_size_limit):
    path = audit_dir / "audit.jsonl"
    path.write_text('{"id": "0-1", "note": "an earlier export"}\n')
    ids = [a.id for a in store.audit()]
    file_size_limit(path.stat().st_size + 450)  # the file system refuses to grow it more: cut inside a line
    with pytest.raises(OSError) as info:
        store.trim_audit(KEEP, str(path), str(audit_dir), fence="")
    file_size_limit(resource.RLIM_INFINITY)
    assert info.value.errno == errno.EFBIG
    text = path.read_text()
    assert 2 <= text.count("\n") <= len(ids) - KEEP and not text.endswith("\n")  # partway, inside a line
    assert [a.id for a in store.audit()] == ids  # nothing trimmed
    assert store.trim_audit(KEEP, str(path), str(audit_dir), fence="") == len(ids) - KEEP  # the retry
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["0-1", *ids[:-KEEP]]  # each once, in order, the earlier export kept
    assert [a.id for a in store.audit()] == ids[-KEEP:]
    assert store.trim_audit(KEEP, str(path), str(audit_dir), fence="") == 0
    assert len(path.read_text().splitlines()) == len(lines)


def exported_ids(path) -> list[str]:
    """The ids of the export's lines, each line parsed as JSON (a line that is not fails the test)."""
    return [json.loads(x)["id"] for x in path.read_text().splitlines()]


def test_a_retry_after_audit_keep_was_raised_exports_each_record_once(store, audit_dir, file_size_limit):
    path = audit_dir / "audit.jsonl"
    for i in range(6):
        store.append_note(store.read_cluster(), trigger="skip", actor="test", reason=f"more {i}")
    ids = [a.id for a in store.audit()]
    file_size_limit(1500)  # EFBIG partway through the batch, inside a line
    with pytest.raises(OSError) as info:
        store.trim_audit(KEEP, str(path), str(audit_dir), fence="")
    file_size_limit(resource.RLIM_INFINITY)
    assert info.value.errno == errno.EFBIG and not path.read_text().endswith("\n")
    cut = path.read_text().count("\n")
    assert 3 <= cut < len(ids) - KEEP - 2 and [a.id for a in store.audit()] == ids
    smaller = len(ids) - cut + 2  # audit_keep raised: a batch of records the file holds already
    assert store.trim_audit(smaller, str(path), str(audit_dir), fence="") == cut - 2
    assert [a.id for a in store.audit()] == ids[cut - 2:]
    assert store.trim_audit(KEEP, str(path), str(audit_dir), fence="") == len(ids) - KEEP - cut + 2
    assert exported_ids(path) == ids[:-KEEP]  # each once, in order, every line JSON (the cut one completed)
    assert [a.id for a in store.audit()] == ids[-KEEP:]


def test_another_clusters_records_in_the_same_file_never_make_it_skip_its_own(store, audit_dir, redis_url):
    # review: resuming by the file's last id alone, a later id of another cluster sharing the export file made this
    # cluster skip its own records and then trim them, exported nowhere
    path = audit_dir / "audit.jsonl"
    other = Store(redis_url, store.cluster + "-other")
    init_cluster(other, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3,
                                      audit_keep=KEEP, audit_export_path=str(path)),
                 np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64))
    try:
        for i in range(6):  # the other cluster's records are newer than all of this one's
            other.append_note(other.read_cluster(), trigger="skip", actor="test", reason=f"other {i}")
        mine = [r.id for r in store.audit()][:-KEEP]
        assert other.trim_audit(KEEP, str(path), str(audit_dir), fence="") > 0
        assert store.trim_audit(KEEP, str(path), str(audit_dir), fence="") == len(mine)
        exported = [json.loads(line)["id"] for line in path.read_text().splitlines()]
        assert [i for i in exported if i in mine] == mine  # every record of this cluster exported, once, in order
    finally:
        other.delete_cluster()


def test_a_paused_coordinator_exports_nothing_twice_and_trims_nothing(store, audit_dir, monkeypatch):
    import fdeplb.store.retention as retention
    from fdeplb.errors import FenceError

    path = audit_dir / "audit.jsonl"
    stale = store.acquire_lease("coordinator-a", 60_000)
    assert stale and store.release_lease(stale)
    fence = store.acquire_lease("coordinator-b", 60_000)  # a took over by b while a was paused
    real, paused = retention.append_lines, []

    def pause_then_append(fh, lines, ours=None):
        if not paused:  # a read its batch, then stopped; meanwhile b's round ends (one record more)
            paused.append(len(lines))
            store.append_note(store.read_cluster(), trigger="skip", actor="test", reason="while a was paused")
            round_end(store, audit_dir, fence)
        return real(fh, lines, ours)

    monkeypatch.setattr(retention, "append_lines", pause_then_append)
    ids = [a.id for a in store.audit()]
    with pytest.raises(FenceError, match="not the lease holder"):
        store.trim_audit(KEEP, str(path), str(audit_dir), fence=stale)
    assert paused == [len(ids) - KEEP]
    after = [a.id for a in store.audit()]
    ids.append(after[-1])  # the record appended while a was paused
    assert exported_ids(path) == ids[:-KEEP]  # b's export only, each record once, in order
    assert after == ids[-KEEP:] and not alarms(store)  # b trimmed; a trimmed nothing
    ids.append(store.append_note(store.read_cluster(), trigger="skip", actor="test", reason="one more"))
    round_end(store, audit_dir, stale)  # a's next round end exports the new oldest record, its trim is refused
    assert [a.id for a in store.audit()] == ids[-KEEP - 1:] and not alarms(store)  # no alarm: it could not write one
    assert exported_ids(path) == ids[:-KEEP]
    round_end(store, audit_dir, fence)  # b's: that record is in the file already, so only the trim is left
    assert exported_ids(path) == ids[:-KEEP] and [a.id for a in store.audit()] == ids[-KEEP:]


def test_an_export_locked_by_a_paused_writer_trims_nothing_and_raises_the_alarm(store, audit_dir, monkeypatch):
    import fcntl

    from fdeplb.store import audit_export

    monkeypatch.setattr(audit_export, "LOCK_WAIT_S", 0.05)
    path = audit_dir / "audit.jsonl"
    ids = [a.id for a in store.audit()]
    with open(path, "a") as paused:  # a writer stopped while it holds the lock
        fcntl.flock(paused.fileno(), fcntl.LOCK_EX)
        round_end(store, audit_dir)
        (alarm,) = alarms(store)
        assert "lock" in alarm["reason"] and path.read_text() == ""
        assert [a.id for a in store.audit()][:len(ids)] == ids
    round_end(store, audit_dir)  # released: the next round end exports and trims
    assert exported_ids(path) == [*ids, alarm.id][:len(ids) + 1 - KEEP]


def test_the_trim_script_names_the_slots_scripts_py_lays_out_and_shares_the_fence_check():
    from fdeplb.store.scripts import AUDIT_TRIM_ARGV, AUDIT_TRIM_KEYS, CHAIN_PRELUDE, lua_file, script_text
    from tests.helpers import header_slots

    assert header_slots("audit_trim", "KEYS") == list(AUDIT_TRIM_KEYS)
    assert header_slots("audit_trim", "ARGV") == list(AUDIT_TRIM_ARGV)
    assert script_text("audit_trim") == lua_file(CHAIN_PRELUDE) + lua_file("audit_trim")
    assert "fence_refused(" in lua_file("audit_trim") and "'ERR_FENCE'" not in lua_file("audit_trim")


def test_a_coordinator_exports_into_its_audit_dir_as_a_round_ends(redis_url, cluster_id, tmp_path):
    from fdeplb.orchestration.operator import change_settings
    from tests.helpers import thread_cluster, wait_for

    audit_dir = tmp_path / "audit"
    audit_dir.mkdir()
    with thread_cluster(redis_url, f"{cluster_id}-t", tmp_path) as tc:
        store = tc.store()
        change_settings(store, {"audit_keep": 2, "audit_export_path": str(audit_dir / "a.jsonl")}, by="test",
                        audit_dir=str(audit_dir))
        tc.start_agents()
        tc.start_coordinator(audit_dir=str(audit_dir))
        store.request_round("test")
        wait_for(lambda: (rec := store.read_cluster()).state == "FREE" and rec.round >= 1, 60, store, "round 1")
        lines = [json.loads(x) for x in (audit_dir / "a.jsonl").read_text().splitlines()]
        assert [x["trigger"] for x in lines][:2] == ["config_changed", "start"] and not alarms(store)
        sid = lambda i: tuple(int(x) for x in i.split("-"))  # noqa: E731
        assert sid(lines[-1]["id"]) < sid(store.audit()[0].id)  # exported, then trimmed: nothing in both
