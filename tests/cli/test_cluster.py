"""``fdeplb init-cluster`` / ``coordinator`` / ``rearrange``: creating and operating a cluster from the shell."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.store import Store
from tests.helpers import run_cli as run, RawRedis


CKPT: list[str] = []  # a tiny real checkpoint (2 MoE layers x 8 experts), written once per module


@pytest.fixture(scope="module", autouse=True)
def checkpoint(tmp_path_factory):
    from fdeplb.weights import write_synthetic_checkpoint

    CKPT[:] = [str(write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", 2, 8))]
    return CKPT[0]


def init_args(url, cluster, *extra):
    return ("init-cluster", "--redis-url", url, "--cluster", cluster, "--num-layers", "2",
            "--num-logical-experts", "8", "--num-redundant-experts", "4", "--ep-size", "4",
            "--checkpoint", CKPT[0], *extra)


def test_init_cluster_creates_records_once(redis_url, cluster_id, capsys):
    code, out, _ = run(capsys, *init_args(redis_url, cluster_id))
    assert code == 0 and "created" in out
    store = Store(redis_url, cluster_id)
    placement = store.current_placement()
    assert placement.plan_id == "" and placement.phy2log.tolist() == [list(np.arange(12) % 8)] * 2
    assert store.read_cluster().state == "FREE"
    assert [store.read_rank(r).state for r in range(4)] == ["IDLE"] * 4
    code, out, _ = run(capsys, *init_args(redis_url, cluster_id))
    assert code == 0 and "exists already" in out
    # another topology for the same cluster id is refused and changes nothing
    before = store.read_config()
    code, _, err = run(capsys, *init_args(redis_url, cluster_id), "--ep-size", "2")
    assert code == 2 and "exists with topology" in err and "nothing changed" in err and store.read_config() == before


@pytest.mark.parametrize("extra,message", [
    (("--num-redundant-experts", "-4"), "must be >= 0"),
    (("--ep-size", "5"), "not a multiple of ep_size"),
    (("--policy", "magic"), "invalid choice: 'magic'"),
    (("--loading-ms", "0"), "--loading-ms must be >= 1"),
])
def test_init_cluster_bad_input_changes_nothing(redis_url, cluster_id, capsys, extra, message):
    code, _, err = run(capsys, *init_args(redis_url, cluster_id), *extra)
    assert code == 2 and message in err
    raw = RawRedis(redis_url, cluster_id)
    assert not raw.r.exists(raw.keys.config)


@pytest.mark.parametrize("missing,message", [
    ("dir", "no such checkpoint"),
    ("expert", "is not in checkpoint"),
])
def test_init_cluster_checks_the_checkpoint_and_writes_nothing(redis_url, cluster_id, capsys, tmp_path, missing,
                                                               message):
    from fdeplb.weights import write_synthetic_checkpoint

    # a checkpoint with 6 of the topology's 8 experts, or none at all
    path = write_synthetic_checkpoint(tmp_path / "ckpt", 2, 6) if missing == "expert" else tmp_path / "none"
    argv = list(init_args(redis_url, cluster_id))
    argv[argv.index("--checkpoint") + 1] = str(path)
    code, out, err = run(capsys, *argv)
    assert code == 4 and message in err and out == ""
    raw = RawRedis(redis_url, cluster_id)
    assert not raw.r.exists(raw.keys.config)


def test_init_cluster_stores_the_checkpoint_as_an_absolute_path(redis_url, cluster_id, capsys, monkeypatch):
    """QA: `--checkpoint ckpt` was stored as "ckpt", read by each rank from its own working directory."""
    from pathlib import Path

    ckpt = Path(CKPT[0])
    monkeypatch.chdir(ckpt.parent)
    args = list(init_args(redis_url, cluster_id))
    args[args.index("--checkpoint") + 1] = ckpt.name
    code, out, err = run(capsys, *args)
    assert code == 0, out + err
    stored = Path(Store(redis_url, cluster_id).read_config().checkpoint["path"])
    assert stored.is_absolute() and stored.samefile(ckpt), stored


def test_rearrange_without_a_coordinator_says_so_and_requests_nothing(redis_url, cluster_id, capsys):
    run(capsys, *init_args(redis_url, cluster_id))
    store = Store(redis_url, cluster_id)
    code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--timeout", "0.5")
    assert code == 3 and "no coordinator holds the lease" in err and "requested" not in out
    assert store.read_cluster().requested == 0


@pytest.mark.parametrize("reason", ["r" * 501, "two\nlines", "\x1b[31mred"])
def test_rearrange_refuses_a_bad_reason_and_requests_nothing(redis_url, cluster_id, capsys, reason):
    import json

    run(capsys, *init_args(redis_url, cluster_id))
    store = Store(redis_url, cluster_id)
    assert store.acquire_lease("test-coordinator", 60_000)  # a coordinator leads: the request would go through
    code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--reason", reason)
    assert code == 2 and "reason must be at most 500 characters without control characters" in err, out + err
    assert store.read_cluster().requested == 0 and store.read_cluster().requested_reason == ""
    code, out, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--reason",
                         "naïve but fine: " + "r" * 484)
    assert code == 0 and store.read_cluster().requested == 1, out + err
    code, out, _ = run(capsys, "status", "--redis-url", redis_url, "--cluster", cluster_id, "--json")
    assert json.loads(out)["rearrange"]["requested_reason"] == "naïve but fine: " + "r" * 484


def test_rearrange_refuses_a_stray_commit(redis_url, cluster_id, capsys):
    run(capsys, *init_args(redis_url, cluster_id))
    store = Store(redis_url, cluster_id)
    assert store.read_cluster().state == "FREE"
    # a commit is only accepted for a cordoned cluster's staged plan
    code, _, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--commit", "abc")
    assert code == 3 and "not cordoned" in err
    assert store.read_cluster().commit_requested == ""


@pytest.mark.parametrize("holder", ["", "two words", "x" * 100_000, "tab\there", "naïve"])
def test_coordinator_refuses_a_bad_holder_before_anything(redis_url, cluster_id, capsys, holder):
    """The holder is the actor of every audit record: a 100 kB one made each record 200 kB."""
    run(capsys, *init_args(redis_url, cluster_id))
    code, _, err = run(capsys, "coordinator", "--redis-url", "redis://127.0.0.1:1/0", "--cluster", cluster_id,
                       "--holder", holder, "--redis-wait-s", "30")  # refused before waiting for Redis
    assert code == 2 and "holder must be 1 to 300 printable ASCII characters" in err and len(err) < 300
    assert Store(redis_url, cluster_id).lease_info().holder is None


@pytest.mark.parametrize("command", ["rearrange", "coordinator"])
def test_operating_an_unknown_cluster_or_redis_fails_cleanly(redis_url, capsys, command):
    code, _, err = run(capsys, command, "--redis-url", redis_url, "--cluster", "t-never-initialised")
    assert code == 2 and "no cluster 't-never-initialised'" in err
    wait = ("--redis-wait-s", "0.3") if command == "coordinator" else ()
    code, _, err = run(capsys, command, "--redis-url", "redis://127.0.0.1:1/0", "--cluster", "c", *wait)
    assert code == 7
    if command == "coordinator":  # it waited for Redis (with a log line) up to its bound
        assert "waiting for redis" in err and "did not answer within 0.3 s" in err
    else:
        assert "cannot reach Redis" in err


def test_commit_request_on_a_cordoned_cluster_needs_the_staged_plan(redis_url, cluster_id, capsys):
    run(capsys, *init_args(redis_url, cluster_id, "--cordoned"))
    store = Store(redis_url, cluster_id)
    code, _, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--commit", "abc")
    assert code == 3 and "is FREE" in err and "LOAD_SUCC" in err
    raw = RawRedis(redis_url, cluster_id)
    raw.r.hset(raw.keys.rearrange, mapping={"state": "LOAD_SUCC", "plan_id": "p1"})  # test set-up
    code, _, err = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--commit", "p2")
    assert code == 3 and "asked: 'p2'" in err
    code, out, _ = run(capsys, "rearrange", "--redis-url", redis_url, "--cluster", cluster_id, "--commit", "p1")
    assert code == 0 and store.read_cluster().commit_requested == "p1"
    assert store.read_cluster().commit_requested_by == "cli"  # the commit's audit record names it


@pytest.mark.slow  # an fdeplb process
def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    """`fdeplb ... | head -1`: the command's output hits a closed pipe; it ends quietly, exit 0."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        proc = subprocess.run([sys.executable, "-m", "fdeplb", "statecharts", "--check"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
