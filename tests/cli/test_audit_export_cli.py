"""The audit export path on the command line (issue 34 item B): ``init-cluster`` / ``config set --audit-export``
accept only a regular file inside ``--audit-dir`` (``..`` and symbolic links resolved; no device, FIFO, symbolic or
hard link), and a coordinator that trims the audit starts only when its ``--audit-dir`` holds the export. A refusal is
exit 2 with one line, and writes nothing: neither the configuration nor the file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Store
from tests.cli.helpers import cli, init_args
from tests.helpers import RawRedis, run_cli


def bad_export(kind: str, tmp_path) -> tuple[str, str | None, str]:
    """(--audit-export, --audit-dir or None, the refusal's words) of one hostile or mistaken path."""
    d = tmp_path / "audit"
    d.mkdir(exist_ok=True)
    if kind == "passwd":
        return "/etc/passwd", str(d), "outside the audit directory"
    if kind == "new_outside":
        return str(tmp_path / "new.jsonl"), str(d), "outside the audit directory"
    if kind == "dotdot":
        return f"{d}/../escape.jsonl", str(d), f"resolves to {tmp_path / 'escape.jsonl'}, outside"
    if kind == "symlink_out":
        (tmp_path / "outside.jsonl").write_text("kept\n")
        (d / "link.jsonl").symlink_to(tmp_path / "outside.jsonl")
        return str(d / "link.jsonl"), str(d), "a symbolic link"
    if kind == "hardlink_out":
        (tmp_path / "outside.jsonl").write_text("kept\n")
        os.link(tmp_path / "outside.jsonl", d / "link.jsonl")
        return str(d / "link.jsonl"), str(d), "a hard link"
    if kind == "dev_null":
        return "/dev/null", str(d), "outside the audit directory"
    if kind == "dev_null_in_dev":
        return "/dev/null", "/dev", "resolves to /dev, a system directory"
    if kind == "root_dir":
        return str(d / "audit.jsonl"), "/", "resolves to the root directory"
    if kind == "etc_dir":
        return "/etc/passwd", "/etc", "resolves to /etc, a system directory"
    if kind == "fifo":
        os.mkfifo(d / "fifo")
        return str(d / "fifo"), str(d), "a FIFO"
    assert kind == "no_audit_dir"
    return str(d / "audit.jsonl"), None, "without --audit-dir"


KINDS = ["passwd", "new_outside", "dotdot", "symlink_out", "hardlink_out", "dev_null", "dev_null_in_dev", "root_dir", "etc_dir", "fifo",
         "no_audit_dir"]


def files_of(tmp_path) -> dict:
    """Every file under tmp_path (and /etc/passwd) with its size and mtime: a refusal changes none."""
    paths = ["/etc/passwd"] + [os.path.join(root, name) for root, dirs, files in os.walk(tmp_path)
                               for name in dirs + files]
    return {p: (os.lstat(p).st_mtime_ns, os.lstat(p).st_size) for p in paths}


@pytest.mark.parametrize("kind", KINDS)
def test_config_set_refuses_an_export_outside_the_audit_dir_writing_nothing(capsys, small_store, redis_url, tmp_path,
                                                                            kind):
    path, audit_dir, words = bad_export(kind, tmp_path)
    raw, files = RawRedis(redis_url, small_store.cluster), files_of(tmp_path)
    before = raw.snapshot()
    code, _, err = cli(capsys, small_store, "config", "set", "--audit-keep", "5", "--audit-export", path,
                       *(["--audit-dir", audit_dir] if audit_dir else []))
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert raw.snapshot() == before and files_of(tmp_path) == files


def test_config_set_stores_a_file_inside_the_audit_dir_as_its_absolute_path(capsys, small_store, tmp_path,
                                                                            monkeypatch):
    (tmp_path / "audit").mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, small_store, "config", "set", "--audit-keep", "5", "--audit-export",
                         "audit/../audit/a.jsonl", "--audit-dir", "audit")
    assert code == 0 and "version 0 -> 1" in out, out + err
    assert small_store.read_config(fresh=True).audit_export_path == str(tmp_path / "audit" / "a.jsonl")
    assert not (tmp_path / "audit" / "a.jsonl").exists()  # created by the first export, not by the setting


@pytest.mark.parametrize("kind", ["passwd", "dotdot", "symlink_out", "hardlink_out", "root_dir", "fifo",
                                  "no_audit_dir"])
def test_init_cluster_refuses_an_export_outside_the_audit_dir_writing_nothing(capsys, redis_url, cluster_id,
                                                                              tmp_path, kind):
    pytest.importorskip("safetensors")
    store = Store(redis_url, cluster_id)
    path, audit_dir, words = bad_export(kind, tmp_path)
    args = init_args(store, tmp_path, "--audit-keep", "10", "--audit-export", path,
                     *(["--audit-dir", audit_dir] if audit_dir else []))
    files = files_of(tmp_path)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert store.key_count() == 0 and files_of(tmp_path) == files


def test_init_cluster_accepts_a_file_inside_the_audit_dir(capsys, redis_url, cluster_id, tmp_path):
    pytest.importorskip("safetensors")
    store = Store(redis_url, cluster_id)
    (tmp_path / "audit").mkdir()
    try:
        code, out, err = run_cli(capsys, *init_args(store, tmp_path, "--audit-keep", "10", "--audit-export",
                                                    str(tmp_path / "audit" / "a.jsonl"), "--audit-dir",
                                                    str(tmp_path / "audit")))
        assert code == 0 and "created" in out, out + err
        assert store.read_config(fresh=True).audit_export_path == str(tmp_path / "audit" / "a.jsonl")
    finally:
        store.delete_cluster()


@pytest.mark.parametrize("audit_dir,words", [(None, "without --audit-dir"), ("elsewhere", "outside the audit "
                                                                                        "directory"),
                                             ("/", "the root directory")])
def test_a_coordinator_that_cannot_export_refuses_to_start(capsys, redis_url, cluster_id, tmp_path, audit_dir,
                                                          words):
    store = Store(redis_url, cluster_id)
    (tmp_path / "elsewhere").mkdir()
    cfg = ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3, audit_keep=5,
                        audit_export_path=str(tmp_path / "audit.jsonl"))
    init_cluster(store, cfg, np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64))
    try:
        code, _, err = run_cli(capsys, "coordinator", "--redis-url", redis_url, "--cluster", cluster_id,
                               "--redis-wait-s", "0", *(["--audit-dir", str(tmp_path / audit_dir)] if audit_dir
                                                        else []))
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert store.lease_info().holder is None  # refused before it led
        assert not (tmp_path / "audit.jsonl").exists()
    finally:
        store.delete_cluster()


@pytest.mark.parametrize("audit_dir,words", [("audit", "outside the audit directory"), (None, "without --audit-dir"),
                                             ("/", "the root directory")])
def test_config_set_audit_keep_alone_is_refused_when_no_coordinator_would_start_with_the_stored_export(
        capsys, small_store, redis_url, tmp_path, audit_dir, words):
    # QA MED 1: the stored export lies outside the --audit-dir given (a cluster made with --audit-dir /)
    small_store.change_config({"audit_export_path": "/etc/passwd"}, actor="test")
    (tmp_path / "audit").mkdir()
    raw = RawRedis(redis_url, small_store.cluster)
    before, files = raw.snapshot(), files_of(tmp_path)
    given = [] if audit_dir is None else ["--audit-dir", audit_dir if audit_dir == "/" else str(tmp_path / audit_dir)]
    code, _, err = cli(capsys, small_store, "config", "set", "--audit-keep", "5", *given)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert raw.snapshot() == before and files_of(tmp_path) == files
    code, _, err = cli(capsys, small_store, "config", "set", "--audit-keep", "5", "--audit-export",
                       str(tmp_path / "audit" / "a.jsonl"), "--audit-dir", str(tmp_path / "audit"))
    assert code == 0, err  # with an export inside its --audit-dir: accepted
    assert small_store.read_config(fresh=True).audit_keep == 5
    code, _, err = cli(capsys, small_store, "config", "set", "--audit-keep", "0")  # trimming off: no export needed
    assert code == 0 and small_store.read_config(fresh=True).audit_keep == 0, err
