"""A supervisor's restart of a crashed worker (issue 34 item 2): who may take a rank over without ``--replace``
(:mod:`fdeplb.orchestration.takeover`, judged on a fake ``/proc``), and the real thing: a SIGKILLed sim worker
restarted at once registers again, audited ``takeover_dead_pid``, while a second live worker is still refused."""

from __future__ import annotations

import json
import os
import signal

import pytest

from fdeplb.cli import main
from fdeplb.orchestration import takeover
from fdeplb.orchestration.takeover import DeadOwner, dead_owner
from fdeplb.replay import ReplayError, replay_file
from tests.helpers import wait_for
from tests.sim.helpers import one_line_error, two_rank_cluster, worker_process, write_trace

HERE = {"host": "node-a", "boot_id": "b-1", "pid_ns": "pid:[1]", "pid_start": 500}


def _fake_proc(tmp_path, **starts):
    """A /proc holding processes ``p<pid>=<start time>`` (field 22 of their stat line; the name has a space and ')')."""
    for name, start in starts.items():
        d = tmp_path / name[1:]
        d.mkdir()
        fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10  # fields 3.. ; field 22 at index 19
        (d / "stat").write_text(f"{name[1:]} (py thon) x) " + " ".join(fields) + "\n")
    return str(tmp_path)


def test_a_dead_or_reused_pid_on_this_host_is_dead_anything_else_may_be_alive(tmp_path):
    proc = _fake_proc(tmp_path, p41=700, p42=900)
    entry = {**HERE, "pid": 41, "pid_start": 700, "agent_id": "old"}
    assert dead_owner(entry, HERE, proc) is None  # the same process still runs: a second live agent
    assert dead_owner({**entry, "pid": 43}, HERE, proc) == DeadOwner(43, "gone")
    assert dead_owner({**entry, "pid": 42}, HERE, proc) == DeadOwner(42, "reused")  # started at another time
    for other in ({"host": "node-b"}, {"boot_id": "b-2"}, {"pid_ns": "pid:[2]"}):  # another host, boot, namespace
        assert dead_owner({**entry, "pid": 43, **other}, HERE, proc) is None
    assert dead_owner({"pid": 43, "agent_id": "old"}, HERE, proc) is None  # an entry without the facts: as before
    assert dead_owner({**entry, "pid": 43, "pid_start": None}, HERE, proc) is None
    assert dead_owner({**entry, "pid": 43}, {}, proc) is None  # this process cannot tell (not Linux)


def test_host_identity_reads_this_process():
    here = takeover.host_identity()
    if not here:
        pytest.skip("no /proc boot id or pid namespace here")
    assert set(here) == {"host", "boot_id", "pid_ns", "pid_start"}
    assert takeover.process_start(os.getpid()) == here["pid_start"]


def _takeovers(store):
    return [r for r in store.audit() if r["trigger"] == takeover.TAKEOVER]


@pytest.mark.slow
@pytest.mark.faults
def test_a_sigkilled_worker_restarted_at_once_serves_again_without_replace(redis_url, cluster_id, tmp_path):
    """The heartbeat TTL is 10 minutes: without the takeover the restart would be refused (exit 3) until it lapsed."""
    if not takeover.host_identity():
        pytest.skip("no /proc boot id or pid namespace here")
    store = two_rank_cluster(redis_url, cluster_id)
    trace = write_trace(tmp_path, 2, 8)
    args = ("--rank", "1", "--heartbeat-ttl-ms", "600000")
    first = worker_process(redis_url, cluster_id, *args, trace=trace)
    second = None
    try:
        wait_for(lambda: store.rank_agent(1) is not None or first.poll() is not None, 120, store, "rank 1 registered")
        old = store.rank_agent(1)
        assert first.poll() is None and store.rank_info()[1]["pid"] == first.pid
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        assert store.rank_info()[1]["agent_id"] == old and not store.rank_info()[1].get("stopped_ms")
        second = worker_process(redis_url, cluster_id, *args, trace=trace)  # at once, no --replace
        wait_for(lambda: _takeovers(store) and store.rank_agent(1) != old or second.poll() is not None, 60, store,
                 "the restarted worker took rank 1 over")
        assert second.poll() is None, second.communicate()
        (note,) = _takeovers(store)
        assert note["key"] == "rank:1" and note["actor"] == f"rank1@{second.pid}"
        assert f"pid {first.pid} is gone" in note["reason"] and store.rank_info()[1]["pid"] == second.pid
        # a second live agent for the same rank is still refused, and takes nothing over
        err = one_line_error(worker_process(redis_url, cluster_id, *args, trace=trace), 3)
        assert "driven by a live agent" in err and "--replace" in err
        assert store.rank_info()[1]["pid"] == second.pid and len(_takeovers(store)) == 1
        second.terminate()
        assert second.wait(timeout=60) == 0
        # the note replays: on rank 1's record as replayed (from = to = its state, its version)
        path = tmp_path / "takeover.jsonl"
        assert main(["audit", "--redis-url", redis_url, "--cluster", cluster_id, "--export", str(path)]) == 0
        assert replay_file(path).skipped == 1 and note["from"] == note["to"] == "IDLE"
        forged = tmp_path / "forged.jsonl"  # a note that does not match the record as replayed is refused
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        forged.write_text("".join(json.dumps({**ln, "version": 5} if ln.get("trigger") == takeover.TAKEOVER else ln)
                                  + "\n" for ln in lines))
        with pytest.raises(ReplayError, match="takeover_dead_pid for rank:1"):
            replay_file(forged)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.communicate(timeout=60)
        store.delete_cluster()


def test_a_takeover_note_does_not_cut_the_ranks_lane_in_the_timeline():
    from fdeplb.store import ClusterConfig
    from fdeplb.ui.view_model import timeline

    def rec(ts, machine, key, frm, to, trigger):
        return {"machine": machine, "key": key, "from": frm, "to": to, "trigger": trigger, "round": "1",
                "ts_ms": str(ts), "reason": "", "id": f"{ts}-0"}

    records = [rec(10, "cluster", "cluster", "FREE", "COLLECTING", "start"),
               rec(20, "rank", "rank:1", "IDLE", "LOADING", "stage"),
               rec(30, "rank", "rank:1", "LOADING", "LOADING", takeover.TAKEOVER)]
    config = ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=2)
    (lane,) = timeline(records, config, now_ms=40)["rounds"][0]["ranks"].values()
    assert lane == [{"state": "LOADING", "start_ms": 20, "end_ms": None}]
